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
  tp=1 recompute / fused  grpo_loss on rank 0 alone with the full W (gradient_mode as named)

with the median fwd+bwd time, the peak memory beyond inputs and grads on rank 0, and the TP
results against the tp=1 recompute ones: loss (abs), dX (full, rel) and this rank's dW rows (rel).
A check fails the run (exit 1) when the TP loss or grads differ by more than bf16 rounding
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
    out = fn(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg, **kw)
    out.loss.backward()
    _sync()
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20 if cuda else float("nan")
    return out.loss.detach().float(), h.grad.float(), w.grad.float(), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
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
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="recompute")
    group = dist.group.WORLD
    tp = lambda *a, **k: cg.grpo_loss(*a, tp_group=group, **k)  # noqa: E731
    rows = []
    ref = None
    fails = []
    compiled_tp = torch.compile(tp, fullgraph=True)
    fused = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused")
    for name, fn, c in ((f"tp={world} eager", tp, cfg), (f"tp={world} compiled", compiled_tp, cfg),
                        (f"tp={world} fused eager", tp, fused),
                        (f"tp={world} fused compiled", compiled_tp, fused)):
        loss, dx, dw, peak = _run(fn, x.hidden, w_shard, x, c)
        ms = _bench(lambda: _run(fn, x.hidden, w_shard, x, c))
        rows.append((name, ms, peak, loss, dx, dw))
    dist.barrier()
    if rank == 0:
        for mode in ("recompute", "fused") if cuda else ("recompute",):
            c1 = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode)
            loss, dx, dw, peak = _run(cg.grpo_loss, x.hidden, w_full, x, c1)
            ms = _bench(lambda: _run(cg.grpo_loss, x.hidden, w_full, x, c1))
            rows.append((f"tp=1 {mode}", ms, peak, loss, dx, dw[lo:hi]))
            if mode == "recompute":
                ref = rows[-1]
    dist.barrier()
    if rank == 0:
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        where = (f"{torch.cuda.get_device_name()} x{world}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                 if cuda else f"CPU x{world}, gloo")
        print(f"\n**{shape.name}** (N={shape.N}, H={shape.H}, V={shape.V}), {where}, torch {torch.__version__}, "
              f"rank 0's shard [{lo}, {hi})\n")
        print("| run | ms | peak MiB beyond grads (rank 0) | loss vs tp=1 | dX rel vs tp=1 | dW shard rel vs tp=1 |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, ms, peak, loss, dx, dw in rows:
            dl, ex, ew = (loss - ref[3]).abs().item(), rel(dx, ref[4]), rel(dw, ref[5])
            print(f"| {name} | {ms:.1f} | {peak:.0f} | {dl:.1e} | {ex:.1e} | {ew:.1e} |")
            if name.startswith("tp=") and not name.startswith("tp=1") and (
                    dl > 1e-4 * ref[3].abs().item() + 1e-6 or ex > 2e-2 or ew > 2e-2):
                fails.append(name)
        print("TP CHECK:", "FAIL " + ", ".join(fails) if fails else "PASS")
    dist.destroy_process_group()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
