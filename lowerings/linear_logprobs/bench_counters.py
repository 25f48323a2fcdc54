"""One fused-gradient step and the valid floor's three cuBLAS GEMMs, for Nsight Compute.

    ncu --profile-from-start off --clock-control none [--metrics ...] \\
        python -m lowerings.linear_logprobs.bench_counters [--shape qwen3-8b] [--targets sampled]
        [--block-rows R ...]

Builds the bench's inputs, runs grpo_loss's step (DAPO + k3 KL, the bench's loss) twice to
compile and warm it, then profiles, between cudaProfilerStart and cudaProfilerStop, one step
and the floor's GEMMs on the valid rows (logits = X W^T, dX = dZ W, dW = dZ^T X), so ncu's
per-kernel counters (DRAM and L2 bytes, tensor-pipe activity, duration at the replay's clock)
compare our kernels with cuBLAS's on the same rows. The counters, not the times, are the point:
ncu replays each kernel alone, with its caches flushed, at whatever clock the GPU gives it.
--block-rows: also cuBLAS's three GEMMs of one block of R valid rows (logits, dX, and dW with
beta = 1, as the fused dW step adds a block into dW): the rate the block schedule allows.
"""
import argparse

import torch

import compiled_grpo as cg
from bench.shapes import SHAPES, TARGETS, make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--targets", default="sampled", choices=TARGETS)
    ap.add_argument("--block-rows", type=int, nargs="+", default=[])
    args = ap.parse_args()
    x = make_inputs(SHAPES[args.shape], torch.device("cuda"), targets=args.targets)
    packed = dict(cu_seqlens=x.cu_seqlens, max_seqlen=SHAPES[args.shape].T) if x.packed else {}
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04)
    hidden = x.hidden.detach().requires_grad_()
    weight = x.weight.detach().requires_grad_()

    def step():
        hidden.grad = weight.grad = None
        cg.grpo_loss(hidden, weight, x.token_ids, x.advantages, x.mask, x.old_logprobs,
                     x.ref_logprobs, config=cfg, **packed).loss.backward()

    h2 = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    xv = h2[torch.nonzero(x.mask.reshape(-1))[:, 0]]                         # [N_valid, H]
    dz = torch.randn(xv.shape[0], w.shape[0], device="cuda", dtype=w.dtype)  # [N_valid, V]
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    xv @ w.T, dz @ w, dz.T @ xv
    dwb = torch.zeros_like(w)                                                # [V, H]
    for r in args.block_rows:
        xb, zb = xv[:r].contiguous(), dz[:r].contiguous()
        xb @ w.T, zb @ w, dwb.addmm_(zb.T, xb)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{args.shape}: N_valid = {xv.shape[0]}, profiled one step and the floor's 3 GEMMs, "
          f"then cuBLAS's for blocks of {args.block_rows} rows")


if __name__ == "__main__":
    main()
