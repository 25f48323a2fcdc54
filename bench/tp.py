"""Vocab-parallel TP over NCCL: grpo_loss with tp_group on 2+ GPUs against one GPU, same inputs.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m bench.tp [--shape qwen3-8b]

Every rank builds the bench's inputs for the shape (same seed: identical hidden, ids, mask,
old/ref log-probs and the full lm_head W [V, H]) on its own GPU and keeps its contiguous vocab
shard W[r V/R : (r + 1) V/R]. Rows printed by rank 0, in one run:

  tp=R eager / compiled   grpo_loss(..., tp_group=WORLD) with gradient_mode="recompute" (the
                          recompute op on each rank's shard, one all-gather of per-token
                          statistics, an all-reduce of dX)
  tp=R fused eager / compiled   the same with gradient_mode="fused" ("auto"'s pick on CUDA): the
                          fused-gradient row blocks on each shard, one all-gather of statistics
                          a block, one all-reduce of dX
  tp=1 recompute (compiled) / fused  grpo_loss on rank 0 alone with the full W (gradient_mode as
                          named); tp=1 recompute eager, run on every rank, is the reference

with the median fwd+bwd time, the peak memory beyond inputs and grads on rank 0, and the results
against tp=1 recompute eager: loss (abs), dX (full, rel) and the dW rows of each rank's shard
(rel; the TP rows give the worst rank and list every rank's).
A check fails the run (exit 1) when any row's loss or grads differ by more than bf16 rounding
(loss 1e-4 relative; dX, dW 2e-2 relative: bf16 grads from a different summation order).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bench(step, reps=10):
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _run(fn, hidden, weight, x, cfg, **kw):
    """One fwd+bwd from fresh leaves: (loss, dX, dW, peak MiB beyond inputs and grads)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    cuda = h.is_cuda
    _sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if x.packed:   # flat [N] inputs: cu_seqlens, and GSPO's bound on the sequences' lengths
        kw["cu_seqlens"] = x.cu_seqlens
        if cfg.importance_sampling_level == "sequence":
            kw["max_seqlen"] = int((x.cu_seqlens[1:] - x.cu_seqlens[:-1]).max())
    out = fn(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg, **kw)
    out.loss.backward()
    _sync()
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20 if cuda else float("nan")
    return out.loss.detach().float(), h.grad.float(), w.grad.float(), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", help="a bench shape; *-packed ones pass cu_seqlens")
    ap.add_argument("--gspo", action="store_true", help="sequence-level importance sampling (GSPO)")
    args = ap.parse_args()
    for k in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):   # NVLink multicast stays off
        os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")   # gloo: a CPU smoke test (cpu-tiny)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    shape = SHAPES[args.shape]
    x = make_inputs(shape, dev, torch.bfloat16 if cuda else torch.float32)
    V = shape.V
    lo, hi = rank * V // world, (rank + 1) * V // world
    w_full = x.weight.detach()
    w_shard = w_full[lo:hi].contiguous()
    level = "sequence" if args.gspo else "token"
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="recompute", importance_sampling_level=level)
    group = dist.group.WORLD
    tp = lambda *a, **k: cg.grpo_loss(*a, tp_group=group, **k)  # noqa: E731
    rows = []
    fails = []
    compiled_tp = torch.compile(tp, fullgraph=True)
    fused = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused", importance_sampling_level=level)
    for name, fn, c in ((f"tp={world} eager", tp, cfg), (f"tp={world} compiled", compiled_tp, cfg),
                        (f"tp={world} fused eager", tp, fused),
                        (f"tp={world} fused compiled", compiled_tp, fused)):
        loss, dx, dw, peak = _run(fn, x.hidden, w_shard, x, c)
        ms = _bench(lambda: _run(fn, x.hidden, w_shard, x, c))
        rows.append((name, ms, peak, loss, dx, dw))
    # The reference, on every rank: tp=1 recompute eager with the full W; each rank checks its own
    # dW shard against its rows.
    loss, dx, dw, peak = _run(cg.grpo_loss, x.hidden, w_full, x, cfg)
    ref = (loss, dx, dw[lo:hi])
    del dw
    dist.barrier()
    if rank == 0:
        compiled_1 = torch.compile(cg.grpo_loss, fullgraph=True)
        for label, fn, mode in (("tp=1 recompute", cg.grpo_loss, "recompute"),
                                ("tp=1 recompute compiled", compiled_1, "recompute"),
                                ("tp=1 fused", cg.grpo_loss, "fused")):
            if mode == "fused" and not cuda:
                continue
            c1 = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode, importance_sampling_level=level)
            loss, dx, dw, peak = _run(fn, x.hidden, w_full, x, c1)
            ms = _bench(lambda: _run(fn, x.hidden, w_full, x, c1))
            rows.append((label, ms, peak, loss, dx, dw[lo:hi]))
    dist.barrier()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # [runs, 3] errors of this rank (loss abs, dX rel, own dW shard rel), gathered on every rank
    errs = torch.tensor([[(r[3] - ref[0]).abs().item(), rel(r[4], ref[1]), rel(r[5], ref[2])]
                         for r in rows[:4]], dtype=torch.float64, device=dev)
    every = [torch.empty_like(errs) for _ in range(world)]
    dist.all_gather(every, errs)
    if rank == 0:
        every = torch.stack(every).cpu()                                    # [ranks, runs, 3]
        where = (f"{torch.cuda.get_device_name()} x{world}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                 if cuda else f"CPU x{world}, gloo")
        print(f"\n**{shape.name}**{' GSPO' if args.gspo else ''} (N={shape.N}, H={shape.H}, V={shape.V}), {where}, "
              f"torch {torch.__version__}; "
              f"TP rows: the worst rank's error, each rank's own dW shard against tp=1 recompute eager\n")
        print("| run | ms | peak MiB beyond grads (rank 0) | loss vs tp=1 | dX rel vs tp=1 | dW shard rel vs tp=1 "
              "| dW shard rel, each rank |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for k, (name, ms, peak, loss, dx, dw) in enumerate(rows):
            if k < 4:
                dl, ex, ew = every[:, k].amax(0).tolist()
                each = " ".join(f"{e:.1e}" for e in every[:, k, 2].tolist())
            else:
                dl, ex, ew, each = (loss - ref[0]).abs().item(), rel(dx, ref[1]), rel(dw, ref[2]), ""
            print(f"| {name} | {ms:.1f} | {peak:.0f} | {dl:.1e} | {ex:.1e} | {ew:.1e} | {each} |")
            if dl > 1e-4 * ref[0].abs().item() + 1e-6 or ex > 2e-2 or ew > 2e-2:
                fails.append(name)
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
