"""Peak host memory of every gradient mode and path on CPU, each case in a fresh process.

    python -m bench.memory                    # every case at the CI shape (tests/test_memory_cpu.py)
    python -m bench.memory --shape issue      # N = 4096, H = 256, V = 65536 (one [N, V] fp32: 1 GiB)
    python -m bench.memory --case fused --budget 128

What is measured: the growth of the process's RSS high-water mark (VmHWM) over one forward and
backward, less the inputs (built before the mark is reset through /proc/self/clear_refs) and
the parameter gradients the backward must return ([N, H] + [V, H]). That is what a mode holds on
top of what any loss needs: the workspace. Linux only. MALLOC_MMAP_THRESHOLD_ is fixed so that
freed large blocks leave RSS (glibc otherwise raises the threshold after the first big free and
keeps freed chunks in its heap, where RSS counts them).

The bound each case is held to (``bound_mib``; docs/gradient-modes.md states them):
  recompute paths (token_logprobs, grpo_loss recompute and auto on CPU, packed, each TP rank):
      the CPU body's row groups: a few [R, C] tiles of WS_BYTES each, the [N, H] dX accumulator
      and the [N]-sized per-token vectors: RECOMPUTE_TILES * WS_BYTES + 2 [N, H] + 64 [N] floats.
  fused (every path): fused_workspace_mib, which buys R rows of the [R, V] workspace and of the
      CPU body's [R, C] tiles (fused/schedule.ws_row_bytes), + the same 2 [N, H] + 64 [N] floats
      + FIXED_MIB; while the budget holds 16 rows and N <= 64 R (fused/plan.py: MIN_ROWS, MAX_BLOCKS).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPES = {   # N tokens as (B, T), H, V
    "ci": dict(B=2, T=1024, H=64, V=65536),
    "issue": dict(B=2, T=2048, H=256, V=65536),
}
CASES = ("token_logprobs", "recompute", "auto", "fused", "packed", "packed_fused", "tp", "tp_fused",
         "naive")
RECOMPUTE_TILES = 8      # [R, C] tiles of the CPU body's backward alive at once, at most
FIXED_MIB = 48           # library code paged in on first use (RSS counts it), allocator slack, [G] vectors

_SCRIPT = r"""
import json, os, sys, torch
import compiled_grpo as cg
case, B, T, H, V, budget = sys.argv[1], *map(int, sys.argv[2:6]), float(sys.argv[6])
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD", 1))
group = None
if world > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + os.environ["PG_FILE"], rank=rank, world_size=world)
    group = dist.group.WORLD
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
def kib(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
torch.manual_seed(0)
packed = case.startswith("packed")
lead = (B * T,) if packed else (B, T)
hidden = torch.randn(*lead, H, requires_grad=True)
v_loc = V // world
weight = (torch.randn(v_loc, H) / H ** 0.5).requires_grad_()
ids = torch.randint(0, V, lead)   # the same global ids on every rank (the same seed)
mask = torch.ones(lead, dtype=torch.bool)
adv = torch.randn(B)
old = torch.full(lead, -11.0); ref = torch.full(lead, -11.0)
kw = dict(tp_group=group) if group is not None else {}
if packed:
    kw["cu_seqlens"] = torch.arange(B + 1) * T
    adv = adv.repeat_interleave(T)
mode = {"recompute": "recompute", "fused": "fused", "packed_fused": "fused", "tp_fused": "fused"}.get(case, "auto")
cfg = cg.GRPOConfig(beta=0.04, metrics="with_entropy", gradient_mode=mode, fused_workspace_mib=budget)
inputs_mib = sum(t.numel() * t.element_size() for t in (hidden, weight, ids, mask, adv, old, ref)) / 2**20
open("/proc/self/clear_refs", "w").write("5")   # VmHWM := current RSS
base = kib("VmRSS")
if case == "token_logprobs":
    out = cg.token_logprobs(hidden, weight, ids, mask=mask, with_entropy=True, **kw)
    (out.logprobs.sum() + out.entropy.sum()).backward()
elif case == "naive":
    logits = hidden @ weight.T
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    (lp * mask).sum().backward()
else:
    cg.grpo_loss(hidden, weight, ids, adv, mask, old, ref, config=cfg, **kw).loss.backward()
grads_mib = (hidden.grad.numel() * 4 + weight.grad.numel() * 4) / 2**20
peak_mib = (kib("VmHWM") - base) / 1024
print(json.dumps({"case": case, "rank": rank, "beyond_mib": round(peak_mib - grads_mib, 1),
                  "grads_mib": round(grads_mib, 1), "inputs_mib": round(inputs_mib, 1),
                  "nv_mib": B * T * V * 4 / 2**20}))
if world > 1:
    dist.destroy_process_group()
"""


def bound_mib(case: str, B: int, T: int, H: int, V: int, budget: float, world: int = 1) -> float:
    """The documented bound of a case's peak beyond inputs and gradients (module docstring)."""
    from lowerings.linear_logprobs import cpu as _cpu
    if case == "naive":
        return float("inf")
    n = B * T
    per_token = (2 * n * H + 64 * n) * 4 / 2**20        # dX accumulators, [N] vectors
    if "fused" in case:
        return budget + per_token + FIXED_MIB
    return RECOMPUTE_TILES * _cpu.WS_BYTES / 2**20 + per_token + FIXED_MIB


def run(case: str, shape: str = "ci", budget: float = 640.0, threads: int = 2) -> list[dict]:
    """One case in fresh processes (two gloo ranks for the tp cases): each process's figures."""
    s = SHAPES[shape]
    world = 2 if case.startswith("tp") else 1
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-c", _SCRIPT, case, *(str(s[k]) for k in "BTHV"), str(budget)]
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", WORLD=str(world),
                   PG_FILE=os.path.join(d, "pg"), THREADS=str(max(1, threads // world)),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = [subprocess.Popen(args, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"bench.memory {case}: exit {p.returncode}\n{err[-3000:]}")
    res = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for r in res:
        r["bound_mib"] = round(bound_mib(case, *(s[k] for k in "BTHV"), budget, world), 1)
        r["budget_mib"] = budget
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="ci")
    p.add_argument("--case", choices=CASES, action="append")
    p.add_argument("--budget", type=float, action="append",
                   help="fused_workspace_mib (repeatable; the fused cases run at each)")
    a = p.parse_args(argv)
    s = SHAPES[a.shape]
    print(f"# bench.memory, CPU, shape {a.shape}: N = {s['B'] * s['T']}, H = {s['H']}, V = {s['V']} fp32 "
          f"(one [N, V] fp32: {s['B'] * s['T'] * s['V'] * 4 / 2**20:.0f} MiB)")
    print(f"{'case':<16}{'rank':>5}{'budget':>8}{'beyond inputs+grads':>21}{'bound':>8}")
    for case in a.case or CASES:
        for budget in (a.budget or [640.0]) if "fused" in case else [640.0]:
            for r in run(case, a.shape, budget):
                print(f"{case:<16}{r['rank']:>5}{budget:>8.0f}{r['beyond_mib']:>17.1f} MiB"
                      f"{r['bound_mib']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
