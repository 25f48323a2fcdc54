"""The dW steps of the row-masked and fused-gradient CUDA paths (launchers: recompute/rows.py,
fused/blocks.py): dW[v0 : v0 + cols] (+)= ws[:n].T @ xg[:n] over a row group's n valid rows, as a
grid of output tiles or a persistent grid walking them, and the epilogue both share.

Legend: n valid rows of the group (its K loop), C = cols vocab rows of dW, H hidden.
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.writes import writes
from lowerings.linear_logprobs.kernels.tiles import (DW_VARYING, VARYING_PTRS, _desc, _dot, _swizzle, _swizzle_id,
                                                     _tile, _valid_rows)


@writes("dw_ptr")
@triton.jit(do_not_specialize=DW_VARYING, do_not_specialize_on_alignment=VARYING_PTRS)
def _dw_step_kernel(ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H, stride_ws,
                    stride_x, stride_dw, n_cblocks, n_hblocks, n_later, final,
                    ACCUMULATE: tl.constexpr, ON_DEVICE: tl.constexpr,
                    DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_C: tl.constexpr):
    """dW[v0 : v0 + cols] (+)= ws[:n, :cols].T @ xg[:n], n = clamp(count - row0, 0, n_rows)
    valid rows of the group (xg: its compacted hidden rows): the K loop stops at n, so padding
    costs no FLOP. fp32 accumulator, rounded to dW's dtype once per group (as the cuBLAS
    beta = 1 step of the dense path; twice with TMA_OUT, see _dw_tile); a group with no valid
    row leaves dW as it is. ON_DEVICE (the fused path, whose blocks run last to first): the
    launcher runs the step twice, storing and adding, and _dw_skips lets one of them work."""
    pid_c, pid_h = _swizzle(n_cblocks, n_hblocks, GROUP_C)
    n_valid, add, a_src, b_src, dw_dst = _dw_operands(
        ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H, stride_ws, stride_x,
        stride_dw, n_later, ON_DEVICE, USE_TMA, TMA_OUT, BLOCK_C, BLOCK_H, BLOCK_K)
    if _dw_skips(n_valid, add, final, ACCUMULATE, ON_DEVICE):
        return
    _dw_tile(a_src, b_src, dw_ptr, dw_dst, pid_c, pid_h, n_valid, v0, cols, H, stride_ws,
             stride_x, stride_dw, ACCUMULATE, DOT_PREC, USE_TMA, TMA_OUT, BLOCK_C, BLOCK_H,
             BLOCK_K)


@triton.jit
def _dw_out(dw_ptr, v0, cols, H, stride_dw, TMA_OUT: tl.constexpr, BLOCK_C: tl.constexpr,
            BLOCK_H: tl.constexpr):
    """Where the dW steps write dW[v0 : v0 + cols]: a TMA descriptor of those rows (TMA_OUT)
    or the pointer itself (_dw_tile's masked stores)."""
    if TMA_OUT:
        # The reduce-add through this descriptor is a write torch's TTIR analysis does not see:
        # the launchers declare dW written (launch.writes), so no launch relies on that analysis.
        return tl.make_tensor_descriptor(dw_ptr + tl.cast(v0, tl.int64) * stride_dw,
                                         shape=[cols, H], strides=[stride_dw, 1],
                                         block_shape=[BLOCK_C, BLOCK_H])
    else:
        return dw_ptr


@triton.jit
def _dw_operands(ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H, stride_ws,
                 stride_x, stride_dw, n_later, ON_DEVICE: tl.constexpr, USE_TMA: tl.constexpr,
                 TMA_OUT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """(n, add, a_src, b_src, dw_dst) of the dW steps: the group's valid rows; with ON_DEVICE,
    whether dW already holds a sum (add: a block run before this one had valid rows, from the
    n_later counts after count_ptr's, read on the device); its ws / xg operands (_desc) of
    max(n, 1) rows (a tensor map has no empty dims; the K loop reads none then) and where the
    tiles go (_dw_out)."""
    n_valid, add = _dw_rows(count_ptr, row0, n_rows, n_later, ON_DEVICE)
    a_src = _desc(ws_ptr, tl.maximum(n_valid, 1), cols, stride_ws, USE_TMA, BLOCK_K, BLOCK_C)
    b_src = _desc(x_ptr, tl.maximum(n_valid, 1), H, stride_x, USE_TMA, BLOCK_K, BLOCK_H)
    dw_dst = _dw_out(dw_ptr, v0, cols, H, stride_dw, TMA_OUT, BLOCK_C, BLOCK_H)
    return n_valid, add, a_src, b_src, dw_dst


@triton.jit
def _dw_rows(count_ptr, row0, n_rows, n_later, ON_DEVICE: tl.constexpr):
    """(n, add) of a dW step: the group's valid rows, and with ON_DEVICE whether dW already holds
    a sum (a block run before this one had valid rows: the n_later counts after count_ptr's)."""
    n_valid = _valid_rows(count_ptr, row0, n_rows, True)
    earlier = n_valid * 0
    if ON_DEVICE:
        for i in range(n_later):
            earlier += tl.load(count_ptr + 1 + i)
    return n_valid, earlier > 0


@triton.jit
def _dw_skips(n_valid, add, final, ACCUMULATE: tl.constexpr, ON_DEVICE: tl.constexpr):
    """Whether a dW step leaves dW as it is. Adding: with no valid row, and ON_DEVICE unless a
    block run before had some (add). Storing: ON_DEVICE when one had, or with no valid row
    unless this is the final block run (final != 0), which then stores dW as zeros (its K loop
    is empty): dW is stored once, by the first block with valid rows or the final one."""
    if ACCUMULATE:
        if ON_DEVICE:
            return (n_valid == 0) | (add == 0)
        else:
            return n_valid == 0
    else:
        if ON_DEVICE:
            return add | ((n_valid == 0) & (final == 0))
        else:
            return n_valid < 0


@triton.jit
def _dw_tile(a_src, b_src, dw_ptr, dw_dst, pid_c, pid_h, n_valid, v0, cols, H, stride_ws,
             stride_x, stride_dw, ACCUMULATE: tl.constexpr, DOT_PREC: tl.constexpr,
             USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr, BLOCK_C: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_C, BLOCK_H] tile of the dW steps: fp32 sum over the n_valid rows (K steps),
    plus dW's old value with ACCUMULATE. Pointer stores (TMA_OUT off) load the old value after
    the K loop and round the sum once into dW (loading it before, as the accumulator's start,
    measured 22.6 against 13.6 ms for the qwen3-8b step on an H100,
    bench/results/bench_fused_h100_log.txt). With TMA_OUT (dw_dst a _dw_out descriptor) the
    tile is rounded to dW's dtype and handed to the TMA unit: a bulk store, or with ACCUMULATE
    a bulk reduce-add (cp.reduce.async.bulk.tensor) that the L2 applies to the old value, so the
    program never waits on the old value's load. That rounds twice (the tile, then the sum):
    still deterministic, each element has one writer per launch and launches are ordered."""
    acc = tl.zeros((BLOCK_C, BLOCK_H), dtype=tl.float32)
    for ki in range(tl.cdiv(n_valid, BLOCK_K)):
        k0 = ki * BLOCK_K
        a = _tile(a_src, k0, pid_c * BLOCK_C, n_valid, cols, stride_ws, USE_TMA, BLOCK_K, BLOCK_C)
        b = _tile(b_src, k0, pid_h * BLOCK_H, n_valid, H, stride_x, USE_TMA, BLOCK_K, BLOCK_H)
        acc = _dot(tl.trans(a), b, acc, DOT_PREC)
    if TMA_OUT:
        out = acc.to(dw_ptr.dtype.element_ty)
        if ACCUMULATE:
            dw_dst.atomic_add([pid_c * BLOCK_C, pid_h * BLOCK_H], out)
        else:
            dw_dst.store([pid_c * BLOCK_C, pid_h * BLOCK_H], out)
    else:
        cs = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (cs < cols)[:, None] & (hs < H)[None, :]
        ptrs = dw_ptr + (v0 + cs).to(tl.int64)[:, None] * stride_dw + hs[None, :]
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@writes("dw_ptr")
@triton.jit(do_not_specialize=DW_VARYING, do_not_specialize_on_alignment=VARYING_PTRS)
def _dw_step_persistent_kernel(ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H,
                               stride_ws, stride_x, stride_dw, n_cblocks, n_hblocks, n_later,
                               final, n_programs, ACCUMULATE: tl.constexpr,
                               ON_DEVICE: tl.constexpr, DOT_PREC: tl.constexpr,
                               USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_K: tl.constexpr, GROUP_C: tl.constexpr):
    """_dw_step_kernel as a persistent grid of n_programs (one per SM): each walks output tiles
    tile_id = pid, pid + n_programs, ... through one flattened (tile, K step) loop, so Triton's
    pipeliner issues the next tile's first operand loads while this tile's dW read-modify-write
    drains (the short K = n <= R loop of a block leaves a non-persistent tile's epilogue and
    prologue exposed: ~15% of the step at R = 2048). Same arithmetic, same rounding."""
    n_valid, add, a_src, b_src, dw_dst = _dw_operands(
        ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H, stride_ws, stride_x,
        stride_dw, n_later, ON_DEVICE, USE_TMA, TMA_OUT, BLOCK_C, BLOCK_H, BLOCK_K)
    if _dw_skips(n_valid, add, final, ACCUMULATE, ON_DEVICE):
        return
    for tile_id in tl.range(tl.program_id(0), n_cblocks * n_hblocks, n_programs, flatten=True):
        pid_c, pid_h = _swizzle_id(tile_id, n_cblocks, n_hblocks, GROUP_C)
        _dw_tile(a_src, b_src, dw_ptr, dw_dst, pid_c, pid_h, n_valid, v0, cols, H, stride_ws,
                 stride_x, stride_dw, ACCUMULATE, DOT_PREC, USE_TMA, TMA_OUT, BLOCK_C, BLOCK_H,
                 BLOCK_K)
