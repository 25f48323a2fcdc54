"""Which dW step a launch takes, and the Gluon step's tiles: the Triton persistent step
(kernels.dw) or, on sm_90, the warp-specialized Gluon step (kernels.dw_gluon).

Legend: H hidden.
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs.device import cdiv

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
    return torch.cuda.get_device_capability(index)[0] == 9


def _dw_ws_ok(ws: Tensor, tma_out: bool) -> bool:
    """Whether the dW step runs as the Gluon kernel (DW_WS): where the Triton step would take
    TMA operands and a TMA epilogue (tma_out: 16-bit, aligned operands and dW on sm_90+), on an
    sm_90 device (its wgmma and setmaxnreg are Hopper's; an sm_100 GPU keeps the Triton step)."""
    return DW_WS and tma_out and ws.is_cuda and _hopper(ws.device.index)
