"""Where the host's time in Triton's launcher goes, for the fused path's kernels (small policies
are host-bound: bench/results/host_bound_small_h200_4bc647a.txt).

    python -m bench.probes.launch_overhead [--shape qwen2.5-0.5b] [--steps 20]

Runs grpo_loss's eager fused step on the shape, then cProfile over `--steps` steps restricted
to triton's runtime (JITFunction.run and what it calls: the generated binder, the cache key,
the launch metadata, CompiledKernel.run) and prints the host time a launch of each kernel.
Then times one kernel's launch three ways on the same arguments, 300 launches each: through
JITFunction (kernel[grid](...)), through the CompiledKernel it returned (no binding, no key),
and the binder alone: what a launch cache that skips the binding would save.
"""
import argparse
import pstats
import time

import torch
from triton.runtime.jit import JITFunction

from bench.measure import host_cprofile, host_times
from bench.shapes import SHAPES, dapo_step, make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    step, _, _ = dapo_step(make_inputs(SHAPES[a.shape], torch.device("cuda"), targets="sampled"))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # one launch of each kernel recorded: (JITFunction, args, kwargs, grid)
    seen = {}
    real = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        seen.setdefault(self.fn.__name__, (self, args, kwargs, grid))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = record
    try:
        step()
    finally:
        JITFunction.run = real
    host, wall = host_times(step, a.steps)
    prof = host_cprofile(step, a.steps)
    print(f"{a.shape}: host {host:.2f} ms a step queued, wall {wall:.2f} ms a step")
    print(f"cProfile over {a.steps} steps, triton's runtime (tottime: the function's own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats("triton", 25)
    n = 300   # few enough that the launch queue (~1k entries) never fills: host time only
    for name, (fn, args, kwargs, grid) in sorted(seen.items()):
        kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)
        bound, _, _ = fn.device_caches[torch.cuda.current_device()][4](*args, **kwargs)
        vals = tuple(bound.values())
        g = grid(bound) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        runner = kernel[g]
        binder = fn.device_caches[torch.cuda.current_device()][4]
        out = {}
        for tag, call in (("JITFunction", lambda: fn.run(*args, grid=grid, warmup=False, **kwargs)),
                          ("CompiledKernel", lambda: runner(*vals)),
                          ("binder only", lambda: binder(*args, **kwargs))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            out[tag] = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
        print(f"  {name:28s} " + ", ".join(f"{k} {v:6.1f} us" for k, v in out.items()))


if __name__ == "__main__":
    main()
