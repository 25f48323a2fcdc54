"""Vocab-parallel TP over NCCL: grpo_loss with tp_group on 2+ GPUs against one GPU, same inputs.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m bench.tp [--shape qwen3-8b ...]
        [--variants base gspo bias softcap] [--no-time] [--profile DIR]

Every rank builds the bench's inputs for the shape (same seed: identical hidden, ids, mask,
old/ref log-probs and the full lm_head W [V, H]) on its own GPU and keeps its contiguous vocab
shard W[r V/R : (r + 1) V/R]. Rows printed by rank 0, in one run:

  tp=R eager / compiled   grpo_loss(..., tp_group=WORLD) with gradient_mode="recompute" (the
                          recompute op on each rank's shard, one all-gather of per-token
                          statistics, an all-reduce of dX)
  tp=R fused eager / compiled   the same with gradient_mode="fused" ("auto"'s pick on CUDA): the
                          fused-gradient row blocks on each shard, one all-gather of statistics
                          a block, one all-reduce of dX
  tp=1 recompute / fused (compiled)  grpo_loss on rank 0 alone with the full W (gradient_mode as
                          named); tp=1 recompute eager, run on every rank, is the reference

with the median fwd+bwd time (bench.measure.time_step on persistent leaves: CUDA events, 10
steps queued back to back after 6 untimed ones, the same counts on every rank; the best of 4
rounds in which the rows of a group, the TP rows and the tp=1 rows, take turns in ABBA order,
so eager and compiled rows see the same process state and clock: TIMING says why), the peak memory
beyond inputs and grads on rank 0, the bytes one rank sends through the collectives a step, and
the results against tp=1 recompute eager: loss (abs), dX (full, rel) and the dW (and d_bias) rows
of each rank's shard (rel; the TP rows give the worst rank and list every rank's), then the
scaling: tp=R fused against tp=1 fused, eager and compiled.
Each --variants entry reruns every row with that loss setting (base: dapo, beta 0.04; gspo; an
lm_head bias; a softcap of 30; all: the three together, one compile per row where the CPU test
has one core a rank), each --shape entry with those inputs.
A check fails the run (exit 1) when any row's loss or grads differ by more than bf16 rounding
(loss 1e-4 relative; dX, dW 2e-2 relative: bf16 grads from a different summation order).
"""
import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_grpo as cg
from bench.measure import Timing, sync, time_step
from bench.shapes import SHAPES, TARGETS, make_inputs


# fixed counts: every rank must issue the same collectives. Each row is timed in ROUNDS rounds,
# the rows of a group (the TP rows on every rank; the tp=1 rows on rank 0) in alternating order,
# each row's best round reported. At a host-bound shape (qwen2.5-0.5b on an H200) a round's
# median is bimodal, ~19-20 ms or ~27-35 ms for the same step, eager or compiled alike
# (bench.probes.tp1_variants, bench/results/tp1_rounds_h200.txt): the host, not the step, sets
# which; rows timed once, one after the other, compared that, not eager and compiled. What the
# host adds only ever adds, so the best round is the step's own time.
TIMING = Timing(warmup=6, reps=10)
ROUNDS = 4


def _kwargs(x, cfg) -> dict:
    """The packed inputs' extra arguments (cu_seqlens; GSPO's bound on the sequences' lengths,
    from the host once, as a trainer computes flash-attn's max_seqlen)."""
    if not x.packed:
        return {}
    kw = dict(cu_seqlens=x.cu_seqlens)
    if cfg.importance_sampling_level == "sequence":
        kw["max_seqlen"] = int((x.cu_seqlens[1:] - x.cu_seqlens[:-1]).max())
    return kw


def _step(fn, hidden, weight, bias, x, cfg):
    """(step, leaves): one fwd+bwd on persistent leaves, as bench.measure times a provider: the
    steps queued back to back, grads cleared on the host between them (no clone, no sync, no
    dtype conversion inside the timed step)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    kw = _kwargs(x, cfg)

    def step():
        if b is not None:
            b.grad = None
        out = fn(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg, bias=b, **kw)
        out.loss.backward()
    return step, SimpleNamespace(hidden=h, weight=w)


def _bench_rows(rows: list, device) -> list:
    """[(step, leaves)] -> each row's best ms over ROUNDS rounds (of each round's median step:
    bench.measure.time_step, CUDA events, device time), the rows in order in even rounds and
    reversed in odd ones (ABBA)."""
    times = [[] for _ in rows]
    for r in range(ROUNDS if device.type == "cuda" else 1):   # CPU (the gloo smoke test): once
        order = range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))
        for k in order:
            times[k].append(time_step(*rows[k], device, TIMING)["ms"])
    return [min(t) for t in times]


class _Collectives(TorchDispatchMode):
    """Counts what one rank sends through the functional collectives that grpo_loss's TP path
    issues (eager runs), in NCCL's ring terms: an all-gather of S bytes a rank sends (R - 1) S,
    an all-reduce of S bytes 2 (R - 1) / R S."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.sent, self.calls = world, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()   # e.g. "_c10d_functional::all_reduce"
        if name.startswith("_c10d_functional::all_") and isinstance(args[0], torch.Tensor):
            size = args[0].numel() * args[0].element_size()
            r = self.world
            self.sent += (r - 1) * size if "gather" in name else 2 * (r - 1) * size // r
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _run(fn, hidden, weight, bias, x, cfg, **kw):
    """One fwd+bwd from fresh leaves: (loss, dX, dW, db, peak MiB beyond inputs and grads);
    db None without a bias."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    cuda = h.is_cuda
    sync(h.device)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    kw.update(_kwargs(x, cfg))
    out = fn(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg, bias=b, **kw)
    out.loss.backward()
    sync(h.device)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (h, w, b) if t is not None)
    peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20 if cuda else float("nan")
    return (out.loss.detach().float(), h.grad.float(), w.grad.float(),
            None if b is None else b.grad.float(), peak)


VARIANTS = ("base", "gspo", "bias", "softcap", "all")   # all: gspo, a bias and a softcap at once


def _config(variant: str, mode: str):
    return cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode,
                         importance_sampling_level="sequence" if variant in ("gspo", "all") else "token",
                         final_logit_softcapping=30.0 if variant in ("softcap", "all") else None)


def _profile(step, rank: int, out: str, label: str):
    """torch.profiler over 3 steps of one row on every rank (the collectives need all of them);
    rank 0 writes the kernel table by device time and a Chrome trace under out/."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            step()
        sync(torch.device("cuda" if cuda else "cpu"))
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, label.replace(" ", "_").replace("=", ""))
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        with open(stem + ".txt", "w") as f:
            f.write(f"# {label}: 3 steps, torch.profiler, sorted by {key}\n{table}\n")
        prof.export_chrome_trace(stem + ".json")
        print(f"profile of {label}: {stem}.txt")


def run_case(shape, variant: str, rank: int, world: int, dev, cuda: bool, timed: bool,
             targets: str = "sampled", profile_dir: str = "") -> list:
    """The rows of one (shape, variant) on every rank; rank 0 prints the table. Returns the
    failing rows' names (rank 0; [] elsewhere)."""
    torch._dynamo.reset()   # each case compiles its own programs (no recompile limit across cases)
    x = make_inputs(shape, dev, torch.bfloat16 if cuda else torch.float32, targets=targets)
    V = shape.V
    lo, hi = rank * V // world, (rank + 1) * V // world
    w_full = x.weight.detach()
    w_shard = w_full[lo:hi].contiguous()
    b_full = b_shard = None
    if variant in ("bias", "all"):
        g = torch.Generator(device="cpu").manual_seed(1)
        b_full = (torch.randn(V, generator=g) * 0.5).to(dev, w_full.dtype)   # [V], same on every rank
        b_shard = b_full[lo:hi].contiguous()
    cfg, fused = _config(variant, "recompute"), _config(variant, "fused")
    group = dist.group.WORLD
    tp = lambda *a, **k: cg.grpo_loss(*a, tp_group=group, **k)  # noqa: E731
    rows = []
    compiled_tp = torch.compile(tp, fullgraph=True)
    steps = []
    for name, fn, c in ((f"tp={world} eager", tp, cfg), (f"tp={world} compiled", compiled_tp, cfg),
                        (f"tp={world} fused eager", tp, fused),
                        (f"tp={world} fused compiled", compiled_tp, fused)):
        counter = _Collectives(world)
        if fn is tp:
            with counter:
                loss, dx, dw, db, peak = _run(fn, x.hidden, w_shard, b_shard, x, c)
        else:
            loss, dx, dw, db, peak = _run(fn, x.hidden, w_shard, b_shard, x, c)
        rows.append([name, float("nan"), peak, loss, dx, dw, db, counter.sent if fn is tp else None])
        steps.append(_step(fn, x.hidden, w_shard, b_shard, x, c))
        if profile_dir and name.endswith("fused compiled"):
            _profile(steps[-1][0], rank, profile_dir, f"{shape.name} {variant} {name}")
    if timed:
        for row, ms in zip(rows, _bench_rows(steps, dev)):
            row[1] = ms
    del steps
    # The reference, on every rank: tp=1 recompute eager with the full W; each rank checks its own
    # dW (and d_bias) shard against its rows.
    loss, dx, dw, db, peak = _run(cg.grpo_loss, x.hidden, w_full, b_full, x, cfg)
    ref = (loss, dx, dw[lo:hi], None if db is None else db[lo:hi])
    del dw
    dist.barrier()
    if rank == 0:
        compiled_1 = torch.compile(cg.grpo_loss, fullgraph=True)
        steps = []
        for label, fn, mode in (("tp=1 recompute", cg.grpo_loss, "recompute"),
                                ("tp=1 recompute compiled", compiled_1, "recompute"),
                                ("tp=1 fused", cg.grpo_loss, "fused"),
                                ("tp=1 fused compiled", compiled_1, "fused")):
            if (mode == "fused" and not cuda) or (not timed and fn is compiled_1 and cuda):
                continue   # --no-time on GPUs: the TP rows' checks only (each compile ~30 s)
            c1 = _config(variant, mode)
            loss, dx, dw, db, peak = _run(fn, x.hidden, w_full, b_full, x, c1)
            steps.append(_step(fn, x.hidden, w_full, b_full, x, c1))
            if profile_dir and label == "tp=1 fused compiled":
                _profile(steps[-1][0], 0, profile_dir, f"{shape.name} {variant} {label}")
            rows.append([label, float("nan"), peak, loss, dx, dw[lo:hi], None if db is None else db[lo:hi], None])
        if timed:
            for row, ms in zip(rows[-len(steps):], _bench_rows(steps, dev)):
                row[1] = ms
        del steps
    dist.barrier()
    rel = lambda a, b: 0.0 if a is None else ((a - b).norm() / b.norm()).item()  # noqa: E731
    # [runs, 4] errors of this rank (loss abs, dX rel, own dW shard rel, own d_bias shard rel),
    # gathered on every rank
    errs = torch.tensor([[(r[3] - ref[0]).abs().item(), rel(r[4], ref[1]), rel(r[5], ref[2]), rel(r[6], ref[3])]
                         for r in rows[:4]], dtype=torch.float64, device=dev)
    every = [torch.empty_like(errs) for _ in range(world)]
    dist.all_gather(every, errs)
    fails = []
    if rank == 0:
        every = torch.stack(every).cpu()                                    # [ranks, runs, 4]
        where = (f"{torch.cuda.get_device_name()} x{world}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                 if cuda else f"CPU x{world}, gloo")
        print(f"\n**{shape.name}**, {variant} (N={shape.N}, H={shape.H}, V={shape.V}), {where}, "
              f"torch {torch.__version__}; TP rows: the worst rank's error, each rank's own dW "
              f"(and d_bias) shard against tp=1 recompute eager; KiB sent: one rank's collectives a "
              f"step in NCCL ring terms (counted in the eager runs; compiled runs issue the same)\n")
        print("| run | ms | peak MiB beyond grads (rank 0) | KiB sent a step (rank 0) | loss vs tp=1 | dX rel vs tp=1 "
              "| dW shard rel vs tp=1 | d_bias shard rel | dW shard rel, each rank |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for k, (name, ms, peak, loss, dx, dw, db, sent) in enumerate(rows):
            if k < 4:
                dl, ex, ew, eb = every[:, k].amax(0).tolist()
                each = " ".join(f"{e:.1e}" for e in every[:, k, 2].tolist())
            else:
                dl, ex, ew, eb, each = ((loss - ref[0]).abs().item(), rel(dx, ref[1]), rel(dw, ref[2]),
                                        rel(db, ref[3]), "")
            kib = "" if sent is None else f"{sent / 2**10:.1f}"
            print(f"| {name} | {ms:.1f} | {peak:.0f} | {kib} | {dl:.1e} | {ex:.1e} | {ew:.1e} | {eb:.1e} | {each} |")
            if dl > 1e-4 * ref[0].abs().item() + 1e-6 or ex > 2e-2 or ew > 2e-2 or eb > 2e-2:
                fails.append(f"{shape.name} {variant}: {name}")
        if timed and cuda:
            ms = {r[0]: r[1] for r in rows}
            for how in ("eager", "compiled"):   # like against like: tp=1's row of the same kind
                t1, tr = ms["tp=1 fused" + (" compiled" if how == "compiled" else "")], ms[f"tp={world} fused {how}"]
                print(f"scaling, fused {how}: tp={world} {tr:.1f} ms against tp=1 {t1:.1f} ms: "
                      f"{t1 / tr:.2f}x on {world} GPUs")
    return fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["qwen3-8b"],
                    help="bench shapes; *-packed ones pass cu_seqlens")
    ap.add_argument("--variants", nargs="+", default=["base"], choices=VARIANTS,
                    help="base: dapo, beta 0.04; gspo: sequence-level importance sampling; bias: an lm_head "
                         "bias [V] (sharded); softcap: final_logit_softcapping=30; all: the three at once")
    ap.add_argument("--gspo", action="store_true", help="the same as --variants gspo")
    ap.add_argument("--no-time", action="store_true", help="the checks only (no timed repetitions)")
    ap.add_argument("--targets", default="sampled", choices=TARGETS,
                    help="token ids (bench.shapes.make_inputs): sampled from the policy, as rollouts are")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="also profile the fused compiled rows (tp=R and tp=1) with torch.profiler into DIR")
    args = ap.parse_args()
    if args.gspo:
        args.variants = ["gspo"]
    for k in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):   # NVLink multicast stays off
        os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")   # gloo: a CPU smoke test (cpu-tiny)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    fails = []
    for name in args.shape:
        for variant in args.variants:
            fails += run_case(SHAPES[name], variant, rank, world, dev, cuda, not args.no_time, args.targets,
                              args.profile)
    if rank == 0:
        print("TP CHECK:", "FAIL " + ", ".join(fails) if fails else "PASS")
    fails = [fails]
    dist.broadcast_object_list(fails, src=0)
    fails = fails[0]
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if fails else 0)   # no interpreter teardown (see bench/fsdp.py: a joinable gloo thread)


if __name__ == "__main__":
    main()
