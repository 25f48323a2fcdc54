"""GPU profile of grpo_loss's fused-gradient path (fused.py, fused_cuda.py) on the bench's inputs.

    python -m lowerings.linear_logprobs.bench_fused [--shape qwen3-8b] [--all-valid] [--sweep]
        [--compile]

Prints the fwd+bwd median (eager), the valid-token floor (three cuBLAS GEMMs of N_valid*H*V) in
the same run, peak memory beyond inputs and grads, and the CUDA time of each kernel family of one
step (torch.profiler). --all-valid: every position valid (the all-positions target). --compile:
the loss under torch.compile(fullgraph=True) (what the loss's own kernels add there). --sweep:
the same for a few dW / dX step tiles (LINEAR_LOGPROBS_{DW,GEMM}_TILES are read at import, so
the sweep patches cuda_rows' tables).
"""
import argparse
import collections

import torch
import triton.testing

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs
from lowerings.linear_logprobs import cuda_rows


def bench(fn):
    return triton.testing.do_bench(fn, warmup=2, rep=1500, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--all-valid", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    x = make_inputs(SHAPES[args.shape], torch.device("cuda"))
    mask = torch.ones_like(x.mask) if args.all_valid else x.mask
    n_valid = int(mask.sum())
    h2 = x.hidden.detach().reshape(-1, x.hidden.shape[-1])
    w = x.weight.detach()
    rows = torch.nonzero(mask.reshape(-1))[:, 0]
    xv = h2[rows]
    dz = torch.randn(n_valid, w.shape[0], device="cuda", dtype=w.dtype)
    floor = bench(lambda: xv @ w.T) + bench(lambda: dz @ w) + bench(lambda: dz.T @ xv)
    del dz
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04)
    hidden = x.hidden.detach().requires_grad_()
    weight = x.weight.detach().requires_grad_()

    def loss_fn(hidden, weight):
        return cg.grpo_loss(hidden, weight, x.token_ids, x.advantages, mask, x.old_logprobs,
                            x.ref_logprobs, config=cfg).loss

    fn = torch.compile(loss_fn, fullgraph=True) if args.compile else loss_fn

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight).backward()

    def measure(tag):
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = bench(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        fam = collections.Counter()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.key.split("(")[0][:48]
                fam[name] += e.device_time_total / 1e3
        print(f"{tag}: {ms:.2f} ms = {ms / floor:.3f}x valid floor ({floor:.2f} ms, N_valid={n_valid}), "
              f"peak beyond grads {peak:.0f} MiB")
        for name, t in fam.most_common(12):
            print(f"    {t:8.2f} ms  {name}")

    measure("fused" + (" compiled" if args.compile else ""))
    if args.sweep:
        for tiles in [(128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 32, 8, 4)]:
            for table in ("DW_TILES", "GEMM_TILES"):
                old = getattr(cuda_rows, table)
                setattr(cuda_rows, table, dict(old, **{2: tiles}))
                try:
                    measure(f"{table}[bf16]={tiles}")
                finally:
                    setattr(cuda_rows, table, old)


if __name__ == "__main__":
    main()
