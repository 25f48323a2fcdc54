"""The dX step's split over V (split-K), shared by the fused path's block dX step
(fused_block._dx_split_kernel) and the recompute path's chunked dX step (rows._dx_step_kernel):
the split count, read on the device from a row group's valid rows, and the kernel that adds the
splits' fp32 partials in split order (deterministic) and scatters the sum to dX.

Legend: R' rows of a row group or block (its n valid ones first, n on the device, from row0 of
the valid-first order), H hidden, V vocab, S the split count, n_pad = n rounded up to BLOCK_M;
split s of valid row i is the fp32 partial part[s * n_pad + i] [., H].
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.tiles import VARYING_PTRS, _valid_rows
from lowerings.linear_logprobs.kernels.writes import writes


@triton.jit
def _dx_splits(n_valid, n_hblocks, n_sms, max_rows, S_MAX: tl.constexpr, BLOCK_M: tl.constexpr):
    """(S, n_pad): the dX step's split count over V for a group of n_valid rows, read on the
    device. Its T = cdiv(n_valid, BLOCK_M) * n_hblocks output tiles, each a K = V loop, fill
    T / (cdiv(T, SMs) * SMs) of the waves they take; S splits make T * S shorter programs. S > 1
    is taken when it fills at least 9/8 as much (split-K costs an fp32 partial pass) and its
    partials fit: S * n_pad <= max_rows (the fused path: its partials buffer; the recompute
    path: its grid's row slots, n_mblocks * BLOCK_M). A full 2048-row qwen3-8b block (T = 256
    on 132 SMs: 97%) keeps S = 1; its 271-row tail (T = 48: 36%) takes S = 5 (91%).
    S_MAX = 1: never split."""
    n_pad = tl.cdiv(n_valid, BLOCK_M) * BLOCK_M
    tiles = (n_pad // BLOCK_M) * n_hblocks
    best = tiles * 0 + 1                   # S = 1, as a device scalar like tiles
    best_num = tiles                       # fill of S = best: best_num / (best_den * SMs)
    best_den = tl.cdiv(tiles, n_sms)
    for s in tl.static_range(2, S_MAX + 1):
        num = tiles * s
        den = tl.cdiv(num, n_sms)
        take = (num * best_den * 8 > best_num * den * 9) & (s * n_pad <= max_rows)
        best = tl.where(take, s, best)
        best_num = tl.where(take, num, best_num)
        best_den = tl.where(take, den, best_den)
    return best, n_pad


@writes("dx_ptr")
@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _dx_split_reduce_kernel(part_ptr, dx_ptr, perm_ptr, count_ptr, row0, n_rows, H, stride_dx,
                            n_hblocks, n_sms, max_rows, S_MAX: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                            scale_ptr, ROW_SCALE: tl.constexpr):
    """dX[perm[row0 + i]] = sum over s < S of part[s * n_pad + i] (fp32, in split order,
    rounded once) for the group's valid rows i; nothing when its S is 1 (the dX step stored dX
    itself). n_hblocks, n_sms, max_rows, S_MAX and BLOCK_M are the dX step's, so both read the
    same S. ROW_SCALE: times scale[i]."""
    n_valid = _valid_rows(count_ptr, row0, n_rows, True)
    n_split, n_pad = _dx_splits(n_valid, n_hblocks, n_sms, max_rows, S_MAX, BLOCK_M)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if (n_split == 1) | (tl.program_id(0) * BLOCK_R >= n_valid):
        return
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < n_valid)[:, None] & (hs < H)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for s in range(0, n_split):
        prow = (s * n_pad + r).to(tl.int64)
        acc += tl.load(part_ptr + prow[:, None] * H + hs[None, :], mask=mask, other=0.0)
    if ROW_SCALE:
        acc = acc * tl.load(scale_ptr + r, mask=r < n_valid, other=0.0)[:, None]
    dst = tl.load(perm_ptr + row0 + r, mask=r < n_valid, other=0)
    tl.store(dx_ptr + dst.to(tl.int64)[:, None] * stride_dx + hs[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=mask)
