"""Where the end-to-end compiled step's first call goes outside Dynamo and Inductor: Triton's
compiles (kernel: cache hit or miss) and launcher builds (a C module a signature), in this
process, during `python -m bench.e2e`.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TRITON_CACHE_DIR=$(mktemp -d) \\
        python -m bench.probes.first_call [--workers N] -- --providers compiled_grpo+compile

--workers sets lowerings.linear_logprobs.precompile.WORKERS (0: every kernel compiles at its
first launch, here). Prints, at exit, the seconds each part took and how many there were.
"""
import argparse
import atexit
import logging
import runpy
import sys
import time
from collections import defaultdict

import triton
import triton.compiler
import triton.compiler.compiler
from triton.backends.nvidia import driver as nv_driver

from lowerings.linear_logprobs import precompile

_spent = defaultdict(lambda: [0, 0.0])


def _timed(label, fn, src_arg=0):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            src = args[src_arg] if len(args) > src_arg else None
            kernel = getattr(src, "fn", None)
            name = getattr(getattr(kernel, "fn", kernel), "__name__", "")
            key = f"{label} {'>' if dt > 0.05 else '<'}50ms"
            _spent[key][0] += 1
            _spent[key][1] += dt
            if dt > 0.05 and name:
                _spent[f"  {label}: {name}"][0] += 1
                _spent[f"  {label}: {name}"][1] += dt
    return wrapper


def _report():
    print("first-call parts (count, seconds):", flush=True)
    for key, (n, s) in sorted(_spent.items()):
        print(f"  {key:<48} {n:4d} {s:8.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=precompile.WORKERS)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    precompile.WORKERS = a.workers
    logging.basicConfig(format="%(message)s")
    logging.getLogger(precompile.__name__).setLevel(logging.DEBUG)   # the workers' own timings
    compile_ = _timed("triton.compile", triton.compiler.compiler.compile)
    triton.compiler.compile = triton.compiler.compiler.compile = compile_
    launcher = nv_driver.CudaLauncher
    init = launcher.__init__
    launcher.__init__ = lambda self, src, *args, **kw: _timed("launcher build", init, 1)(
        self, src, *args, **kw)
    wait, start, t0 = precompile.wait, precompile._start, time.perf_counter()

    def started(specs):   # when the trace handed kernels to the workers, and how many
        print(f"first_call: {len(specs)} kernels to the workers at {time.perf_counter() - t0:.1f} s",
              flush=True)
        return start(specs)

    def waited(*args, **kwargs):
        if precompile._pending:
            print(f"first_call: first launch waits at {time.perf_counter() - t0:.1f} s", flush=True)
        return _timed("precompile.wait", wait)(*args, **kwargs)

    precompile._start, precompile.wait = started, waited
    atexit.register(_report)
    sys.argv = ["bench.e2e"] + [r for r in a.rest if r != "--"]
    runpy.run_module("bench.e2e", run_name="__main__")


if __name__ == "__main__":
    main()
