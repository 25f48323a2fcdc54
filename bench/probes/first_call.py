"""Where the end-to-end compiled step's first call goes outside Dynamo and Inductor: Triton's
compiles (kernel: cache hit or miss) and launcher builds (a C module a signature), in this
process, during `python -m bench.e2e`.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TRITON_CACHE_DIR=$(mktemp -d) \\
        python -m bench.probes.first_call [--workers N] -- --providers compiled_grpo+compile

--workers sets lowerings.linear_logprobs.launching.precompile.WORKERS (0: every kernel compiles at its
first launch, here). Prints, at exit, the seconds each part took and how many there were.

    python -m bench.probes.first_call --alternate ROUNDS [--providers P ...] [--log-dir DIR] -- E2E_ARGS

compares first calls fairly: ROUNDS rounds of every provider in turn (default compiled_grpo+compile,
then TRL's trl_chunked+compile), each in a fresh process with Inductor's caches off and a fresh
TRITON_CACHE_DIR (nothing one run compiled serves the next), and prints one row a run: first call,
step, peak, Dynamo's attempts (a restart shows as two) and the kernels Triton compiled here for
longer than 50 ms (the precompile workers' kernels found: 0). README's e2e row was measured
this way (bench/results/e2e_first_call_h100_d5cfed0.txt).
"""
import argparse
import atexit
import logging
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import triton
import triton.compiler
import triton.compiler.compiler
from triton.backends.nvidia import driver as nv_driver

from lowerings.linear_logprobs.launching import precompile

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


def summary(provider: str, out: str) -> dict:
    """One run's row from its output: bench.e2e's table row of the provider, Dynamo's
    compile_attempt lines and this probe's count of Triton compiles over 50 ms."""
    row = dict(provider=provider, first_s=None, ms=None, peak_gib=None, status="no row")
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] == provider:
            ok = cells[5] == "ok"
            row.update(status=cells[5], **({k: float(v) for k, v in
                                            zip(("ms", "first_s", "peak_gib"), cells[1:4])} if ok else {}))
    row["attempts"] = len(set(re.findall(r"^compile_attempt_(\d+)\s", out, re.M)))
    slow = re.search(r"^\s*triton\.compile >50ms\s+(\d+)", out, re.M)
    row["slow_compiles"] = int(slow.group(1)) if slow else 0
    return row


def alternate(rounds: int, providers: list[str], workers: int, e2e_args: list[str],
              log_dir: str | None = None, run=subprocess.run) -> list[dict]:
    """Each provider in turn, ROUNDS times, each run a fresh process of this probe with
    Inductor's caches off and its own empty TRITON_CACHE_DIR; one summary row a run."""
    rows = []
    for r in range(rounds):
        for p in providers:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", TRITON_CACHE_DIR=cache)
                cmd = [sys.executable, "-m", "bench.probes.first_call", "--workers", str(workers),
                       "--", "--providers", p, "--compile-times", *e2e_args]
                res = run(cmd, env=env, capture_output=True, text=True)
            out = res.stdout + res.stderr
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(log_dir, f"round{r + 1}.{p.replace('+', '_')}.log"), "w") as f:
                    f.write(out)
            rows.append(dict(summary(p, out), round=r + 1))
            print(_row_line(rows[-1]), flush=True)
    return rows


def _row_line(r: dict) -> str:
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    return (f"| {r['round']} | {r['provider']} | {f(r['first_s'], '.1f')} | {f(r['ms'], '.1f')} | "
            f"{f(r['peak_gib'], '.2f')} | {r['attempts']} | {r['slow_compiles']} | {r['status']} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=precompile.WORKERS)
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="run each provider ROUNDS times in turn, a fresh process and caches each")
    ap.add_argument("--providers", nargs="+", default=["compiled_grpo+compile", "trl_chunked+compile"])
    ap.add_argument("--log-dir", default=None, help="with --alternate: each run's whole output here")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.alternate:
        print("| round | provider | first call s | step ms | peak GiB | Dynamo attempts | "
              "Triton compiles > 50 ms here | status |\n|---:|---|---:|---:|---:|---:|---:|---|", flush=True)
        alternate(a.alternate, a.providers, a.workers, [r for r in a.rest if r != "--"], a.log_dir)
        return
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
    from compiled_grpo import fused_grads   # the per-block gradient's Inductor compile, at run time
    fused_grads._compile_block = _timed("block graph compile", fused_grads._compile_block)
    atexit.register(_report)
    sys.argv = ["bench.e2e"] + [r for r in a.rest if r != "--"]
    runpy.run_module("bench.e2e", run_name="__main__")


if __name__ == "__main__":
    main()
