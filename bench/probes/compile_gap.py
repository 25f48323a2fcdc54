"""Where compiling grpo_loss costs time (issue 65): eager against torch.compile(fullgraph=True) of
the same step, and the CUDA kernels of one step of each side by side (the kernels only one side
launches, or launches more often, first).

    python -m bench.probes.compile_gap [--shapes qwen2.5-0.5b qwen3-8b] [--modes auto recompute]
                                       [--kernels] [--compile-mode reduce-overhead] [--pairs 40]
                                       [--clocks] [--tp1]

Eager and compiled are timed in alternating rounds, ABBA (median of each side's rounds), so drift
(clocks, temperature) falls on both alike; --pairs N adds N pairs of single steps, one of each
side back to back (ABBA again), and the median and quartiles of the per-pair ratio: drift over
a round (seconds at long shapes) cancels within a pair. --clocks samples nvidia-smi (SM clock,
power, temperature every 20 ms) and reports each side's mean over its timed rounds: a GPU at its
power limit runs a step with fewer idle gaps at a lower clock. --kernels adds the per-kernel table of
one step.
"""
import argparse
import subprocess
import time
from collections import Counter
from datetime import datetime

import torch
from torch._dynamo.utils import counters

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs
from bench.probes.compiled_recompute_time import timed


def kernels(run) -> tuple:
    """{kernel name: (count, total us)} of one step."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    count, us = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1
            us[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return count, us


class Clocks:
    """nvidia-smi sampling SM clock (MHz), power (W) and temperature (C) every 20 ms; mean(t0, t1)
    averages the samples taken between two time.time() stamps."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu"
    CAP = ",clocks_event_reasons.sw_power_cap"    # "Active" while the power limit holds the clock

    def __init__(self):
        dev = ["-i", str(torch.cuda.current_device())]
        fields = self.FIELDS + self.CAP
        if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", *dev],
                          capture_output=True).returncode != 0:
            fields = self.FIELDS                     # a driver without the field
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "20", *dev],
            stdout=subprocess.PIPE, text=True)
        self.samples = None

    def stop(self):
        self.proc.terminate()
        out, _ = self.proc.communicate()
        self.samples = []
        for line in out.splitlines():
            try:
                ts, mhz, watts, temp, *cap = (f.strip() for f in line.split(","))
                t = datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                capped = None if not cap else float("Not" not in cap[0])
                self.samples.append((t, float(mhz), float(watts), float(temp), capped))
            except ValueError:
                continue

    def mean(self, windows) -> str:
        s = [x for x in self.samples if any(t0 <= x[0] <= t1 for t0, t1 in windows)]
        if not s:
            return "no samples"
        cap = [x[4] for x in s if x[4] is not None]
        cap = f", power cap holding the clock in {100 * sum(cap) / len(cap):.0f}%" if cap else ""
        return (f"SM {sum(x[1] for x in s) / len(s):.0f} MHz, {sum(x[2] for x in s) / len(s):.0f} W, "
                f"{sum(x[3] for x in s) / len(s):.0f} C{cap} ({len(s)} samples)")


def one_rank_group():
    """The WORLD group of a one-process NCCL job (bench.tp's tp=1 eager / compiled rows pass
    grpo_loss such a tp_group)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD


def bench_step(name: str, mode: str = "auto", tp1: bool = False):
    """(loss, step) at the bench shape `name`: loss(*inputs) the DAPO + k3 KL grpo_loss value
    (tp1: with a tp_group of one rank), step(f) a call of f's forward + backward on persistent
    leaves, their grads cleared."""
    x = make_inputs(SHAPES[name], "cuda", torch.bfloat16, seed=0)
    # the shape's model as the bench runs it: Gemma 2's final-logit softcap, packed shapes' cu_seqlens
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode,
                        final_logit_softcapping=x.softcap)
    w = x.weight.detach().requires_grad_()
    h = x.hidden.detach().requires_grad_()

    def step(f):
        def run():
            f(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs).backward()
            h.grad = w.grad = None
        return run

    group = one_rank_group() if tp1 else None

    def loss(*args):
        return cg.grpo_loss(*args, cu_seqlens=x.cu_seqlens, config=cfg, tp_group=group).loss
    return loss, step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen3-8b"])
    p.add_argument("--modes", nargs="+", default=["auto"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=0)
    p.add_argument("--clocks", action="store_true")
    p.add_argument("--tp1", action="store_true", help="grpo_loss with a tp_group of one rank (bench.tp's tp=1 rows)")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode (e.g. reduce-overhead)")
    a = p.parse_args(argv)
    for name, mode in [(n, m) for n in a.shapes for m in a.modes]:
        loss, step = bench_step(name, mode, a.tp1)
        torch._dynamo.reset()
        counters.clear()
        comp = torch.compile(loss, fullgraph=True, dynamic=False, mode=a.compile_mode)
        timed(step(comp), reps=1)   # compiles outside the sampled windows
        te, tc, windows = [], [], {loss: [], comp: []}
        clocks = Clocks() if a.clocks else None
        for r in range(a.rounds):   # ABBA: each side runs first in every other round (the GPU
            # warms over a round: at long shapes the second side always ran on a hotter chip)
            for side in ((te, loss), (tc, comp))[::1 if r % 2 == 0 else -1]:
                t0 = time.time()
                side[0].append(timed(step(side[1]), reps=9))
                windows[side[1]].append((t0, time.time()))
        te, tc = sorted(te)[len(te) // 2], sorted(tc)[len(tc) // 2]
        skips = f", cudagraph skips {counters['inductor']['cudagraph_skips']}" if a.compile_mode else ""
        print(f"\n## {name} ({mode}): eager {te:.2f} ms, compiled {tc:.2f} ms ({tc / te:.3f}x){skips}", flush=True)
        if clocks is not None:
            time.sleep(0.1)
            clocks.stop()
            print(f"   eager: {clocks.mean(windows[loss])}; compiled: {clocks.mean(windows[comp])}")
        if a.pairs:
            ratios = []
            for r in range(a.pairs):
                t = {f: timed(step(f), reps=1, warm=0) for f in ((loss, comp), (comp, loss))[r % 2]}
                ratios.append(t[comp] / t[loss])
            q = sorted(ratios)
            print(f"   {a.pairs} pairs, compiled / eager a pair: median {q[len(q) // 2]:.4f}, "
                  f"quartiles {q[len(q) // 4]:.4f} .. {q[3 * len(q) // 4]:.4f}", flush=True)
        if not a.kernels:
            continue
        (ce, ue), (cc, uc) = kernels(step(loss)), kernels(step(comp))
        print(f"kernels a step: eager {sum(ce.values())} ({sum(ue.values()) / 1e3:.2f} ms), "
              f"compiled {sum(cc.values())} ({sum(uc.values()) / 1e3:.2f} ms)")
        names = sorted(set(ue) | set(uc), key=lambda k: -abs(uc[k] - ue[k]))
        print(f"{'kernel':<70}{'eager n':>8}{'us':>10}{'compiled n':>11}{'us':>10}")
        for k in names[:25]:
            print(f"{k[:69]:<70}{ce[k]:>8}{ue[k]:>10.0f}{cc[k]:>11}{uc[k]:>10.0f}")


if __name__ == "__main__":
    main()
