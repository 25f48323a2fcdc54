"""The dW step of the row-masked (recompute) and fused-gradient CUDA paths, one launcher for
both: dW[v0 : v0 + cols] (+)= ws[:n, :cols].T @ xg[:n] over a row group's n valid rows (n read on
the device), as the warp-specialized Gluon kernel (kernels.dw_gluon) on sm_90 wherever the
Triton kernel would write dW through TMA, else the Triton persistent kernel (kernels.dw).

Legend: n valid rows of the group (the K loop), C = cols vocab rows of dW, H hidden.
"""
import functools
from typing import Callable, Optional

import triton
from torch import Tensor

from lowerings.linear_logprobs.recompute import dense as _dense
from lowerings.linear_logprobs.device import cdiv
from lowerings.linear_logprobs.kernels.dw import _dw_step_persistent_kernel
from lowerings.linear_logprobs.kernels.dw_gluon import _dw_step_ws_kernel

# The dW step as a persistent grid (kernels.dw._dw_step_persistent_kernel) where the Gluon step
# does not run: H100, qwen3-8b bench, 39% valid: step 39.8 ms against 41.8 with one program per
# tile (the recompute path's kernels.dw._dw_step_kernel; HISTORY.md).
# The dW step as a warp-specialized Gluon kernel (kernels.dw_gluon: a TMA loader warp running ahead
# of two 4-warp wgmma consumers, each on half of a tile's vocab rows, sharing each stage's xg
# tile, across tiles; the old dW tile prefetched into the epilogue buffer, one rounding a
# block), taken on sm_90 wherever the Triton step would write dW through TMA (_dw_ws_ok). H100,
# one 2048-row qwen3-8b block (bench.kernels.dw_ws, bench/results/dw_ws_h100.txt): 3.88 ms against one
# 8-warp consumer's 3.96, cuBLAS's (beta = 1) 3.96 and the Triton step's 4.13; Nsight Compute
# 5.33 against 5.42 M cycles a full block; a 271-row tail block 1.01 against 1.03 / 1.31 / 1.35
# ms; half the accumulated block's rounding error of the Triton step's TMA reduce-add (which
# rounds twice). DW_WS = False keeps the Triton step (A/B runs);
# DW_WS_TILES: (BLOCK_C, BLOCK_H, BLOCK_K, STAGES, warps a consumer, maxnreg, NC:
# 2 consumers on each tile's vocab halves, or 1 on the whole tile: "128,256,64,3,8,168,1").
DW_WS = True
DW_WS_TILES = (128, 256, 64, 3, 4, 168, 2)
# ... and where H is an odd multiple of 128 (qwen2.5-0.5b's 896: 256-wide H tiles leave the last
# half empty, 12.5% of the step's MMAs), 128-wide H tiles on 256 vocab rows (the same smem a
# stage, 128 x 128 a consumer): H100, qwen2.5-0.5b step's dW 4.57-4.59 -> 3.85-3.89 ms, the same
# bits (bench/results/dw_narrow_h100_ed00f21.txt). dw_ws_tiles picks.
DW_WS_TILES_NARROW = (256, 128, 64, 3, 4, 168, 2)


def dw_ws_tiles(h: int) -> tuple:
    """The Gluon dW step's tiles for hidden size h: DW_WS_TILES, or DW_WS_TILES_NARROW where its
    H tiles cover h with fewer padded columns."""
    pad = lambda t: cdiv(h, t[1]) * t[1]  # noqa: E731
    return DW_WS_TILES_NARROW if pad(DW_WS_TILES_NARROW) < pad(DW_WS_TILES) else DW_WS_TILES


@functools.lru_cache(maxsize=None)
def _hopper(index: Optional[int]) -> bool:
    """Whether the active Triton target is sm_90 (the one the launches compile for, as
    cuda._use_tma reads it: a fake-driver trace on a CPU machine sees what an H100 runs), once
    a device: the query costs host time at every one of the recompute path's ~150 dW launches."""
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and target.arch == 90


def _dw_ws_ok(ws: Tensor, tma_out: bool) -> bool:
    """Whether the dW step runs as the Gluon kernel (DW_WS): where the Triton step would take
    TMA operands and a TMA epilogue (tma_out: 16-bit, aligned operands and dW on sm_90+), on an
    sm_90 target (its wgmma and setmaxnreg are Hopper's; an sm_100 GPU keeps the Triton step)."""
    return DW_WS and tma_out and ws.is_cuda and _hopper(ws.device.index)


def launch(wrap: Callable, ws: Tensor, xg: Tensor, dw: Tensor, count: Tensor, row0, n_rows,
           v0: int, cols: int, h: int, tiles: tuple, prec: str, tma: bool, sms: int,
           group: int, accumulate: bool, on_device: bool = False, n_later: int = 0,
           final: int = 0) -> None:
    """One dW step: dW[v0 : v0 + cols] (+)= ws[:n, :cols].T @ xg[:n] with n = clamp(count[0] -
    row0, 0, n_rows), storing or adding (accumulate), a grid of at most `sms` programs walking
    the output tiles (GROUP_C = group vocab blocks share their xg columns in L2).
    on_device (the fused path, whose blocks run last to first): whether dW holds a sum yet is
    read from count[1 : 1 + n_later], and `final` marks the last block run (kernels.dw._dw_skips;
    the caller launches storing and adding). `tiles`: the Triton step's (DW_TILES entry); the
    Gluon step takes dw_ws_tiles(h). `wrap` maps a kernel to what launches it
    (launch.declared for the recompute op, precompile.capturable for the fused steps)."""
    tma_out = _dense._dw_tma_out(tma, dw)
    args = (ws, xg, dw, count, row0, n_rows, v0, cols, h, ws.stride(0), xg.stride(0),
            dw.stride(0))
    if _dw_ws_ok(ws, tma_out):
        wc, wh, wk, stages, warps, regs, nc = dw_ws_tiles(h)
        n_cblocks, n_hblocks = cdiv(cols, wc), cdiv(h, wh)
        wrap(_dw_step_ws_kernel)[(min(n_cblocks * n_hblocks, sms),)](
            *args, n_cblocks, n_hblocks, n_later, final, ACCUMULATE=accumulate,
            ON_DEVICE=on_device, BLOCK_C=wc, BLOCK_H=wh, BLOCK_K=wk, GROUP_C=group,
            STAGES=stages, NC=nc, num_warps=warps, maxnreg=regs)
    else:
        wc, wh, wk, warps, stages = tiles
        n_cblocks, n_hblocks = cdiv(cols, wc), cdiv(h, wh)
        n_prog = min(n_cblocks * n_hblocks, sms)
        wrap(_dw_step_persistent_kernel)[(n_prog,)](
            *args, n_cblocks, n_hblocks, n_later, final, n_prog, ACCUMULATE=accumulate,
            ON_DEVICE=on_device, DOT_PREC=prec, USE_TMA=tma, TMA_OUT=tma_out, BLOCK_C=wc,
            BLOCK_H=wh, BLOCK_K=wk, GROUP_C=group, num_warps=warps, num_stages=stages)
