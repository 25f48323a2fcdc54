"""GPU A/B of the fused path's dW step on one row block (sm_90): the Triton persistent kernel
(kernels.dw, the TMA reduce-add epilogue), the warp-specialized Gluon kernel (kernels.dw_gluon) at
each --ws-tiles entry, and cuBLAS (addmm_, beta = 1) on the same valid rows.

    python -m bench.kernels.dw_ws [--rows 2048] [--valid 2048 271]
        [--vocab 151936] [--hidden 4096] [--ws-tiles 128,256,64,3,4,168,2 ...] [--reps 20]

First checks each kernel's stored and accumulated dW against an fp32 reference (largest error
relative to the reference's largest magnitude; the stored case with no valid row must write
zeros), then prints each one's median time over --reps launches (CUDA events, after 2 s of it
untimed) and its TFLOP/s on the valid rows.
"""
import argparse
import functools
import statistics
import time

import torch

import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs.recompute import dense
from lowerings.linear_logprobs.recompute import rows as rows_mod
from lowerings.linear_logprobs.recompute import dw_steps
from lowerings.linear_logprobs.recompute.dense import cdiv
from lowerings.linear_logprobs.kernels.dw import _dw_step_persistent_kernel
from lowerings.linear_logprobs.kernels.dw_gluon import _dw_step_ws_kernel


def triton_step(ws, xg, dw, counts, rows, acc):
    """The Triton persistent dW step (kernels.dw, TMA operands and the TMA reduce-add epilogue)
    over the first counts[0] of `rows` rows, storing or adding (acc)."""
    v, h = dw.shape
    wc, wh, wk, warps, stages = tuning.step_tiles(2)[1]
    n_cblocks, n_hblocks = cdiv(v, wc), cdiv(h, wh)
    n_prog = min(n_cblocks * n_hblocks, dense.sm_count(ws.device.index))
    _dw_step_persistent_kernel[(n_prog,)](
        ws, xg, dw, counts, 0, rows, 0, v, h, ws.stride(0), xg.stride(0), dw.stride(0), n_cblocks,
        n_hblocks, 0, 1, n_prog, ACCUMULATE=acc, ON_DEVICE=False, DOT_PREC="tf32", USE_TMA=True,
        TMA_OUT=True, BLOCK_C=wc, BLOCK_H=wh, BLOCK_K=wk, GROUP_C=rows_mod.GROUP_M,
        num_warps=warps, num_stages=stages)


def ws_step(ws, xg, dw, counts, rows, acc, n_later=0, final=1, on_device=False, tiles=None):
    """The Gluon dW step (kernels.dw_gluon) at `tiles` (dw_steps.DW_WS_TILES by default); with
    on_device, the fused path's skip rule over counts[1 : 1 + n_later] and `final`."""
    v, h = dw.shape
    wc, wh, wk, stages, warps, regs, nc = tiles or dw_steps.DW_WS_TILES
    n_cblocks, n_hblocks = cdiv(v, wc), cdiv(h, wh)
    _dw_step_ws_kernel[(min(n_cblocks * n_hblocks, dense.sm_count(ws.device.index)),)](
        ws, xg, dw, counts, 0, rows, 0, v, h, ws.stride(0), xg.stride(0), dw.stride(0), n_cblocks,
        n_hblocks, n_later, final, ACCUMULATE=acc, ON_DEVICE=on_device, BLOCK_C=wc, BLOCK_H=wh,
        BLOCK_K=wk, GROUP_C=rows_mod.GROUP_M, STAGES=stages, NC=nc, num_warps=warps,
        maxnreg=regs)


def _cublas_step(ws, xg, dw, count, rows, acc):
    n = count.n_host   # cuBLAS cannot stop at a device count: given the host's
    a, b = ws[:n, :dw.shape[0]].T, xg[:n]
    dw.addmm_(a, b) if acc else torch.mm(a, b, out=dw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--valid", type=int, nargs="+", default=[2048, 271])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ws-tiles", nargs="+", default=["128,256,64,3,4,168,2",
                                                        "128,256,64,3,8,168,1"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dense._ensure_allocator()
    dev, bf = torch.device("cuda"), torch.bfloat16
    r, v, h = args.rows, args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    vp = cdiv(v, 64) * 64
    ws = (torch.rand(r, vp, device=dev, generator=g) * 0.02).to(bf)   # e-like: small, positive
    xg = torch.randn(r, h, device=dev, generator=g).to(bf)
    dw0 = (torch.randn(v, h, device=dev, generator=g) * 1e-2).to(bf)
    kernels = {"triton_persistent": triton_step}
    for t in args.ws_tiles:
        kernels[f"gluon_ws[{t}]"] = functools.partial(ws_step,
                                                      tiles=tuple(int(x) for x in t.split(",")))
    kernels["cublas"] = _cublas_step
    print(f"dW step, block of {r} rows, V={v}, H={h}, bf16, {torch.cuda.get_device_name()}")
    for n in args.valid + [0]:
        count = torch.tensor([n], dtype=torch.int32, device=dev)
        count.n_host = n
        prod = ws[:n, :v].float().T @ xg[:n].float()
        for name, step in kernels.items():
            errs = []
            for acc in (False, True):
                if n == 0 and acc:
                    continue
                dw = dw0.clone()
                step(ws, xg, dw, count, r, acc)
                ref = prod + dw0.float() if acc else prod
                scale = ref.abs().max().clamp_min(1e-30)
                errs.append(f"{'add' if acc else 'store'} {((dw.float() - ref).abs().max() / scale).item():.2e}")
            print(f"  n={n:5d} {name:32s} max err / max |ref|: {', '.join(errs)}")
        del prod
    for n in args.valid:
        count = torch.tensor([n], dtype=torch.int32, device=dev)
        count.n_host = n
        flops = 2.0 * n * v * h
        for name, step in kernels.items():
            dw = dw0.clone()
            t_end = time.perf_counter() + 2.0
            while time.perf_counter() < t_end:
                step(ws, xg, dw, count, r, True)
                torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                step(ws, xg, dw, count, r, True)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            ms = statistics.median(times)
            print(f"  n={n:5d} {name:32s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s (add)")


if __name__ == "__main__":
    main()
