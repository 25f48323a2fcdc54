"""Host time a step of grpo_loss's eager fused path (small policies are host-bound), A/B in one
process: the cached Triton scratch (cuda._tma_alloc) and the block steps' bodies called directly
(fused_steps.block_steps), against a fresh torch.empty a launch and the custom ops (the code before
38397ec).

    python -m bench.kernels.host [SHAPE ...]   (default qwen2.5-0.5b; CUDA)

Per variant, twice, the four variants twice in turn: "lead-in", one step's host time right after
a synchronize; "queued host", host time a step over 20 steps queued back to back; "wall", those
steps' wall time a step (bench/results/host_scratch_h100.txt).
"""
import sys
import time

import torch
import triton

import lowerings.linear_logprobs.fused.steps as lf
import lowerings.linear_logprobs.recompute.dense as lc
from bench.shapes import SHAPES, dapo_step, make_inputs

pc = time.perf_counter


def measure(step, steps=20):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = pc()
    step()
    lead = pc() - t0
    torch.cuda.synchronize()
    t0 = pc()
    for _ in range(steps):
        step()
    t1 = pc()
    torch.cuda.synchronize()
    t2 = pc()
    return lead * 1e3, (t1 - t0) / steps * 1e3, (t2 - t0) / steps * 1e3


def fresh_alloc(size, align, stream):   # the allocator before this change
    return torch.empty(size, dtype=torch.int8, device="cuda")


new_steps = lf.block_steps
old_steps = lambda hidden: (lf.fused_block_forward, lf.fused_block_backward)  # noqa: E731


def main():
    for shape in sys.argv[1:] or ["qwen2.5-0.5b"]:
        step, _, _ = dapo_step(make_inputs(SHAPES[shape], torch.device("cuda")))

        def show(tag, alloc, steps):
            triton.set_allocator(alloc)
            lf.block_steps = steps
            res = [measure(step) for _ in range(2)]
            print(f"{shape:14s} {tag:32s} " + "  |  ".join(
                f"lead-in {a:6.2f} queued host {b:6.2f} wall {c:6.2f}" for a, b, c in res) + " ms a step")

        for _ in range(2):
            show("new (cached scratch, bodies)", lc._tma_alloc, new_steps)
            show("fresh scratch, bodies", fresh_alloc, new_steps)
            show("fresh scratch, ops (before)", fresh_alloc, old_steps)
            show("cached scratch, ops", lc._tma_alloc, old_steps)
        lf.block_steps = new_steps
        triton.set_allocator(lc._tma_alloc)


if __name__ == "__main__":
    main()
