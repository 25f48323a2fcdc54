"""What a per-(row, vocab tile) scale on the A operand costs the fused path's dX and dW GEMM steps.

    python -m bench.kernels.scaled_operand [--rows 2048] [--vocab 151936]
        [--hidden 4096]

A design question of issue 11 (the dlogits pass, ~5% of the valid floor at qwen3-8b): without
entropy or softcap, dlogits = s[r, t] * e[r, v] + (target term), where e = exp(z - m[r, t]) is
what the forward already computes per 256-column tile t (m the running row max) and
s[r, t] = -g_lp[r] / T * exp(m[r, t] - lse[r]) is known once the row's lse is. If the forward
stored e (bf16) instead of d = z - m, the dX and dW steps could apply s to their A operand in
registers (one multiply an element, no exp) and the separate in-place dlogits pass would go.
This times each step plain and with that scale (same Triton tiles as fused_cuda's steps, TMA
operands; pointer loads without USE_TMA, for the interpreter test), one block of `rows` rows,
next to cuBLAS, on random operands. SCALE: 0 none, 1 the A tile scaled in fp32 and rounded
back, 2 scaled in bf16, 3 (dX only, timing: not the same sum) the fp32 accumulator rescaled as
each vocab tile starts, as FlashAttention rescales its output.

H100, one 2048-row qwen3-8b block (bench/results/scaled_operand_h100.txt): dX 3.44 ms plain,
5.26 / 4.91 / 4.50 (SCALE 1 / 2 / 3); dW 3.62 plain, 5.29 / 5.11 (SCALE 1 / 2). The in-place
dlogits pass these would replace costs ~0.55 ms a block: kept as a separate pass. WS: the dX
K loop with Triton's automatic warp specialization (tl.range(warp_specialize=True), which
Triton 3.6 documents for Blackwell and builds on sm_90 too): 3.43 plain, 4.90 scaled in bf16,
no change.
"""
import argparse

import torch
import triton
import triton.language as tl
import triton.testing

from lowerings.linear_logprobs.kernels.tiles import _desc, _tile

TILE_V = 256   # the forward's vocab tile: one scale per (row, TILE_V columns)


@triton.jit
def _dx_kernel(a_ptr, w_ptr, s_ptr, out_ptr, R, V, H, n_tiles, SCALE: tl.constexpr,
               USE_TMA: tl.constexpr, TILE_V: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               WS: tl.constexpr = False):
    """out[R, H] = (s-scaled a)[R, V] @ w[V, H]; a's K step k0 takes scale column k0 // TILE_V
    (SCALE 1, 2), or the accumulator is scaled by that column as each tile starts (SCALE 3)."""
    pid = tl.program_id(0)
    n_m, n_h = tl.cdiv(R, BLOCK_M), tl.cdiv(H, BLOCK_H)
    width = GROUP_M * n_h
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    pid_m, pid_h = first + (pid % width) % size, (pid % width) // size
    a_d = _desc(a_ptr, R, V, V, USE_TMA, BLOCK_M, BLOCK_K)
    w_d = _desc(w_ptr, V, H, H, USE_TMA, BLOCK_K, BLOCK_H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k0 in tl.range(0, V, BLOCK_K, warp_specialize=WS):
        a = _tile(a_d, pid_m * BLOCK_M, k0, R, V, V, USE_TMA, BLOCK_M, BLOCK_K)
        if SCALE != 0 and SCALE != 3:
            sc = tl.load(s_ptr + rows.to(tl.int64) * n_tiles + k0 // TILE_V, mask=rows < R,
                         other=0.0)
            if SCALE == 1:
                a = (a.to(tl.float32) * sc[:, None]).to(a_ptr.dtype.element_ty)
            else:
                a = a * sc.to(a_ptr.dtype.element_ty)[:, None]
        if SCALE == 3:   # FlashAttention-style: the running sum rescaled when a tile starts
            if k0 % TILE_V == 0:
                sc = tl.load(s_ptr + rows.to(tl.int64) * n_tiles + k0 // TILE_V, mask=rows < R,
                             other=0.0)
                acc = acc * sc[:, None]
        acc = tl.dot(a, _tile(w_d, k0, pid_h * BLOCK_H, V, H, H, USE_TMA, BLOCK_K, BLOCK_H), acc)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + hs[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < R)[:, None])


@triton.jit
def _dw_kernel(a_ptr, x_ptr, s_ptr, out_ptr, R, V, H, n_tiles, n_programs, SCALE: tl.constexpr,
               USE_TMA: tl.constexpr, TILE_V: tl.constexpr, BLOCK_C: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_C: tl.constexpr):
    """out[V, H] = (s-scaled a)[R, V].T @ x[R, H], persistent as the fused dW step: the K step
    over rows r0 scales a's [BLOCK_K, BLOCK_C] tile by s[r, col0 // TILE_V] (BLOCK_C divides
    TILE_V, so one scale column a tile)."""
    n_c, n_h = tl.cdiv(V, BLOCK_C), tl.cdiv(H, BLOCK_H)
    a_d = _desc(a_ptr, R, V, V, USE_TMA, BLOCK_K, BLOCK_C)
    x_d = _desc(x_ptr, R, H, H, USE_TMA, BLOCK_K, BLOCK_H)
    o_d = _desc(out_ptr, V, H, H, USE_TMA, BLOCK_C, BLOCK_H)
    for tile in tl.range(tl.program_id(0), n_c * n_h, n_programs, flatten=True):
        width = GROUP_C * n_h
        first = (tile // width) * GROUP_C
        size = tl.minimum(n_c - first, GROUP_C)
        pid_c, pid_h = first + (tile % width) % size, (tile % width) // size
        acc = tl.zeros((BLOCK_C, BLOCK_H), dtype=tl.float32)
        for k0 in range(0, R, BLOCK_K):
            a = _tile(a_d, k0, pid_c * BLOCK_C, R, V, V, USE_TMA, BLOCK_K, BLOCK_C)
            if SCALE:
                r = k0 + tl.arange(0, BLOCK_K)
                sc = tl.load(s_ptr + r.to(tl.int64) * n_tiles + (pid_c * BLOCK_C) // TILE_V,
                             mask=r < R, other=0.0)
                if SCALE == 1:
                    a = (a.to(tl.float32) * sc[:, None]).to(a_ptr.dtype.element_ty)
                else:
                    a = a * sc.to(a_ptr.dtype.element_ty)[:, None]
            b = _tile(x_d, k0, pid_h * BLOCK_H, R, H, H, USE_TMA, BLOCK_K, BLOCK_H)
            acc = tl.dot(tl.trans(a), b, acc)
        out = acc.to(out_ptr.dtype.element_ty)
        if USE_TMA:
            o_d.store([pid_c * BLOCK_C, pid_h * BLOCK_H], out)
        else:
            cs = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
            hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
            tl.store(out_ptr + cs.to(tl.int64)[:, None] * H + hs[None, :], out,
                     mask=(cs < V)[:, None] & (hs < H)[None, :])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    R, V, H = args.rows, args.vocab, args.hidden
    dt = torch.bfloat16
    a = torch.rand(R, V, device="cuda", dtype=dt)
    w = torch.randn(V, H, device="cuda", dtype=dt) / H ** 0.5
    x = torch.randn(R, H, device="cuda", dtype=dt)
    n_tiles = triton.cdiv(V, TILE_V)
    s = torch.rand(R, n_tiles, device="cuda", dtype=torch.float32)
    dx, dw = torch.empty(R, H, device="cuda", dtype=dt), torch.empty(V, H, device="cuda", dtype=dt)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=400, return_mode="median")  # noqa

    def dx_step(scale, ws=False):
        bm, bh, bk = 128, 256, 64
        _dx_kernel[(triton.cdiv(R, bm) * triton.cdiv(H, bh),)](
            a, w, s, dx, R, V, H, n_tiles, SCALE=scale, USE_TMA=True, TILE_V=TILE_V, BLOCK_M=bm,
            BLOCK_H=bh, BLOCK_K=bk, GROUP_M=8, WS=ws, num_warps=8, num_stages=3)

    def dw_step(scale):
        bc, bh, bk = 128, 256, 64
        n_prog = min(sms, triton.cdiv(V, bc) * triton.cdiv(H, bh))
        _dw_kernel[(n_prog,)](a, x, s, dw, R, V, H, n_tiles, n_prog, SCALE=scale, USE_TMA=True,
                              TILE_V=TILE_V, BLOCK_C=bc, BLOCK_H=bh, BLOCK_K=bk, GROUP_C=8,
                              num_warps=8, num_stages=3)

    # the scaled steps against the reference: the scale applied in fp32, then the GEMM
    a_s = (a.float() * s.repeat_interleave(TILE_V, 1)[:, :V]).to(dt)
    dx_step(1), dw_step(1)
    ref_x, ref_w = a_s.float() @ w.float(), a_s.float().T @ x.float()
    err_x = (dx.float() - ref_x).abs().max() / ref_x.abs().max()
    err_w = (dw.float() - ref_w).abs().max() / ref_w.abs().max()
    flop = 2 * R * V * H
    for name, f in [("dX cuBLAS", lambda: torch.mm(a, w, out=dx)),
                    ("dX plain", lambda: dx_step(0)), ("dX scaled fp32", lambda: dx_step(1)),
                    ("dX scaled bf16", lambda: dx_step(2)), ("dX acc rescale", lambda: dx_step(3)),
                    ("dW cuBLAS", lambda: torch.mm(a.T, x, out=dw)),
                    ("dW plain", lambda: dw_step(0)), ("dW scaled fp32", lambda: dw_step(1)),
                    ("dW scaled bf16", lambda: dw_step(2)),
                    ("dX plain again", lambda: dx_step(0)),
                    ("dX plain, WS", lambda: dx_step(0, True)),
                    ("dX scaled bf16, WS", lambda: dx_step(2, True)),
                    ("dW plain again", lambda: dw_step(0))]:
        try:
            ms = bench(f)
        except Exception as e:   # a variant this Triton cannot build here: say so, go on
            print(f"{name:16s} {type(e).__name__}: {str(e)[:300]}")
            continue
        print(f"{name:16s} {ms:7.3f} ms  {flop / ms / 1e9:6.0f} TFLOP/s")
    print(f"scaled steps' max error / max value: dX {err_x:.1e}, dW {err_w:.1e}")


if __name__ == "__main__":
    main()
