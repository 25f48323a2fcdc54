"""bench.tp's "tp=1 compiled" row (grpo_loss with a one-rank tp_group, recompute) against its
eager twin, timed as bench.tp times (bench.measure.time_step: back to back, ABBA rounds), with
the compile's settings varied: dynamic=None (bench.tp's) or False, the whole GRPOOutput
returned (bench.tp's) or only the loss.

    torchrun --nproc_per_node 1 -m bench.probes.tp1_variants [--shape qwen2.5-0.5b] [--mode recompute]
"""
import argparse

import torch
import torch.distributed as dist

import compiled_grpo as cg
from bench.measure import Timing, time_step
from bench.shapes import SHAPES, make_inputs
from bench.tp import _config


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--mode", default="recompute")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    x = make_inputs(SHAPES[a.shape], dev, torch.bfloat16)
    cfg = _config("base", a.mode)
    group = dist.group.WORLD
    whole = lambda *args, **k: cg.grpo_loss(*args, tp_group=group, **k)  # noqa: E731
    loss_only = lambda *args, **k: cg.grpo_loss(*args, tp_group=group, **k).loss  # noqa: E731
    no_group = lambda *args, **k: cg.grpo_loss(*args, **k)  # noqa: E731
    variants = {"eager, whole output": whole,
                "compiled, dynamic=None, whole output (bench.tp)": torch.compile(whole, fullgraph=True),
                "compiled, dynamic=False, whole output": torch.compile(whole, fullgraph=True, dynamic=False),
                "compiled, dynamic=False, loss only": torch.compile(loss_only, fullgraph=True, dynamic=False),
                "no tp_group, eager": no_group,
                "no tp_group, compiled (dynamic=None)": torch.compile(no_group, fullgraph=True)}
    h = x.hidden.detach().clone().requires_grad_()
    w = x.weight.detach().clone().requires_grad_()
    leaves = type("L", (), {"hidden": h, "weight": w})()

    def step_of(f):
        def step():
            out = f(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg)
            (out if isinstance(out, torch.Tensor) else out.loss).backward()
        return step
    steps = {k: step_of(f) for k, f in variants.items()}
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(a.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(time_step(steps[k], leaves, dev, Timing(warmup=6, reps=10))["ms"])
    print(f"{a.shape} ({a.mode}, tp_group of one rank unless said): median of {a.rounds} ABBA rounds")
    for k, t in times.items():
        print(f"  {k:<52}{sorted(t)[len(t) // 2]:8.2f} ms   rounds {' '.join(f'{v:.1f}' for v in t)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
