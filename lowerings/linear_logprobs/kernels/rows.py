"""The row-masked paths' @triton.jit kernels besides the logits tiles (launchers: recompute/rows.py,
fused/blocks.py through cuda_rows._gather): the row gather of the valid rows, and the recompute
backward's dX step over one vocab chunk.

Legend: R rows of a row group (its n valid ones first, n on the device), H hidden, V vocab,
C a vocab chunk's columns.
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.splits import _dx_splits
from lowerings.linear_logprobs.kernels.tiles import VARYING_PTRS, _desc, _dot, _swizzle, _tile, _valid_rows
from lowerings.linear_logprobs.kernels.writes import writes


@writes("acc_ptr", dx_ptr="STORE")
@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _dx_step_kernel(ws_ptr, w_ptr, acc_ptr, dx_ptr, perm_ptr, count_ptr, row0, n_rows, v0, cols,
                    V, H, stride_ws, stride_w, stride_dx, n_mblocks, n_hblocks, n_sms,
                    ACCUMULATE: tl.constexpr, STORE: tl.constexpr, DOT_PREC: tl.constexpr,
                    USE_TMA: tl.constexpr, ACC_TMA: tl.constexpr, S_MAX: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """acc[:n] (+)= ws[:n, :cols] @ W[v0 : v0 + cols] for the n = clamp(count - row0, 0,
    n_rows) valid rows of a row group (fp32 acc [n_rows, H]); with STORE (the group's last
    chunk) the sum goes to dX[perm[row0 + r]] in dX's dtype instead of back to acc. Row blocks
    past n exit at once: padding costs no FLOP. ACC_TMA (with STORE off): the tile goes to acc
    through a tensor map of its [n, H] valid rows, a bulk store or (ACCUMULATE) a bulk fp32
    reduce-add the L2 applies to the old value, so the program does not wait on the old
    value's load; old + tile is the same fp32 sum either way (one writer an element a launch,
    launches ordered).

    Split K (S_MAX > 1): where the group's vm valid row tiles leave programs idle (the
    partial group at the end of the valid rows), each tile's K range (the chunk's columns) is
    split ks ways, the fused path's rule over the grid's row slots (splits._dx_splits with
    max_rows = n_mblocks * BLOCK_M, so ks * vm <= n_mblocks): program slot pid_m = split * vm
    + m sums its share of row tile m into its own acc rows [pid_m BM, pid_m BM + BM) over all
    chunks, and splits._dx_split_reduce_kernel adds the ks partials in split order after the
    group's last chunk and scatters them to dX. Still one writer an element a launch:
    deterministic, and a full group (ks = 1) takes the same steps and bits as without it.
    H100, qwen3-8b, 39% valid: the 271-row tail group's dX took 1.80 ms over 48 of 128
    programs, as long as a full group's; 1.02 ms in 2 splits (96 programs)
    (bench/results/recompute_dx_split_h100.txt)."""
    pid_m, pid_h = _swizzle(n_mblocks, n_hblocks, GROUP_M)
    n_valid = _valid_rows(count_ptr, row0, n_rows, True)
    ks, n_pad = _dx_splits(n_valid, n_hblocks, n_sms, n_mblocks * BLOCK_M, S_MAX, BLOCK_M)
    vm = n_pad // BLOCK_M
    if pid_m >= ks * vm:
        return
    split = pid_m // vm
    m = pid_m - split * vm                           # the row tile; pid_m: its acc rows
    per = tl.cdiv(tl.cdiv(cols, BLOCK_K), ks) * BLOCK_K
    k_lo = split * per
    k_hi = tl.minimum(cols, k_lo + per)
    a_src = _desc(ws_ptr, n_valid, cols, stride_ws, USE_TMA, BLOCK_M, BLOCK_K)
    # all of W (no offset pointer: v0 may be a specialized int): a K step past the chunk's
    # last column reads the next chunk's W rows, multiplied by ws's zero fill
    b_src = _desc(w_ptr, V, H, stride_w, USE_TMA, BLOCK_K, BLOCK_H)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = _tile(a_src, m * BLOCK_M, k0, n_valid, cols, stride_ws, USE_TMA, BLOCK_M, BLOCK_K)
        b = _tile(b_src, v0 + k0, pid_h * BLOCK_H, V, H, stride_w, USE_TMA, BLOCK_K, BLOCK_H)
        acc = _dot(a, b, acc, DOT_PREC)
    if ACC_TMA and not STORE:
        # in two [BLOCK_M, BLOCK_H / 2] halves: a whole fp32 tile's staging buffer (128 KiB)
        # beside the operand stages is more shared memory than a block has
        # split: every slot's rows (past n_valid only zeros, ws's fill, land there)
        acc_rows = tl.where(ks > 1, ks * vm * BLOCK_M, n_valid)
        acc_dst = tl.make_tensor_descriptor(acc_ptr, shape=[acc_rows, H], strides=[H, 1],
                                            block_shape=[BLOCK_M, BLOCK_H // 2])
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_H // 2)), (0, 2, 1)))
        if ACCUMULATE:
            acc_dst.atomic_add([pid_m * BLOCK_M, pid_h * BLOCK_H], lo)
            acc_dst.atomic_add([pid_m * BLOCK_M, pid_h * BLOCK_H + BLOCK_H // 2], hi)
        else:
            acc_dst.store([pid_m * BLOCK_M, pid_h * BLOCK_H], lo)
            acc_dst.store([pid_m * BLOCK_M, pid_h * BLOCK_H + BLOCK_H // 2], hi)
    else:
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)                      # the group's rows
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # their acc rows
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (rows < n_valid)[:, None] & (hs < H)[None, :]
        acc_ptrs = acc_ptr + slots.to(tl.int64)[:, None] * H + hs[None, :]
        if ACCUMULATE:
            acc += tl.load(acc_ptrs, mask=mask, other=0.0)
        if STORE:
            if ks == 1:
                dst = tl.load(perm_ptr + row0 + rows, mask=rows < n_valid, other=0)
                tl.store(dx_ptr + dst.to(tl.int64)[:, None] * stride_dx + hs[None, :],
                         acc.to(dx_ptr.dtype.element_ty), mask=mask)
            else:   # a split's partial stays in acc for _dx_split_reduce_kernel
                tl.store(acc_ptrs, acc, mask=mask)
        else:
            tl.store(acc_ptrs, acc, mask=mask)


@writes("out_ptr")
@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _gather_rows_kernel(x_ptr, perm_ptr, count_ptr, out_ptr, row0, n_rows, H, stride_x,
                        stride_out, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[r] = x[perm[row0 + r]] for the r < clamp(count - row0, 0, n_rows) valid rows of a
    row group (the compacted operand of the row-masked path); rows past them are left as they
    are (every reader masks them)."""
    pid_r = tl.program_id(0)
    n_valid = _valid_rows(count_ptr, row0, n_rows, True)
    if pid_r * BLOCK_R >= n_valid:
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    src = tl.load(perm_ptr + row0 + r, mask=r < n_valid, other=0)
    mask = (r < n_valid)[:, None] & (hs < H)[None, :]
    vals = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + hs[None, :], mask=mask)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + hs[None, :], vals, mask=mask)
