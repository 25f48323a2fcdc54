"""Where an eager step's host time goes, every function (not only Triton's launcher: that is
bench.probes.launch_overhead): small policies' eager fused steps can be host-bound.

    python -m bench.probes.host_hotspots [--shape qwen2.5-0.5b] [--steps 20] [--mode fused] [--launches]

Prints the host time a step queued back to back and the step's wall time, then cProfile over
`--steps` queued steps sorted by each function's own time (tottime), and torch.profiler's CPU
ops by self time over as many; --launches: one step's launches by the op that issued them.
"""
import argparse
import pstats

import torch

from bench.measure import host_cprofile, host_op_table, host_times
from bench.shapes import SHAPES, dapo_step, make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", default="auto", choices=["auto", "fused", "recompute"])
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--launches", action="store_true",
                    help="also: one step's GPU launches counted by the op that issued them")
    a = ap.parse_args()
    import compiled_grpo as cg
    step, _, _ = dapo_step(make_inputs(SHAPES[a.shape], torch.device("cuda"), targets="sampled"),
                           cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=a.mode))
    for _ in range(5):
        step()
    host, wall = host_times(step, a.steps)
    print(f"{a.shape} ({a.mode}): host {host:.2f} ms a step queued, wall {wall:.2f} ms a step")
    prof = host_cprofile(step, a.steps)
    print(f"cProfile over {a.steps} steps, by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    print(host_op_table(step, a.steps))
    if a.launches:
        launches(step)


def launches(step):
    """The GPU launches of one step, counted by the op that issued them (Triton's launches through
    fast_launch show as cuLaunchKernelEx, Inductor's by their kernel names)."""
    import collections
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        step()
        torch.cuda.synchronize()
    ops = collections.Counter()
    for e in tp.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith(
                ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cudaMemset")):
            continue
        name, op = None, e.cpu_parent
        while op is not None and name is None:
            if op.name.startswith(("aten::", "triton", "compiled_grpo::")):
                name = op.name
            op = op.cpu_parent
        ops[(name or e.name)[:48]] += 1
    print(f"launches of one step: {sum(ops.values())}")
    for name, n in ops.most_common(40):
        print(f"{n:5d}  {name}")


if __name__ == "__main__":
    main()
