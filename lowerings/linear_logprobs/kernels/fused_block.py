"""The @triton.jit kernels of the fused-gradient block steps (launchers: fused/blocks.py; the
helpers they share with the recompute path's kernels are in kernels/logits.py, the dW step in
kernels/dw.py).

Legend: R' rows of a block (its n valid ones first, n on the device), H hidden, V vocab,
S the dX step's split count over V.
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.logits import _dz_tile, _transform
from lowerings.linear_logprobs.kernels.splits import _dx_splits
from lowerings.linear_logprobs.kernels.tiles import (VARYING_PTRS, _desc, _dot, _swizzle_id, _tile,
                                                     _valid_rows)


@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _fused_dlogits_kernel(z_ptr, ws_ptr, zoff_ptr, ids_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                          dbp_ptr, count_ptr, n_rows, V, stride_ws, n_ztiles, inv_temp, cap_pre,
                          cap_post, HAS_CAP: tl.constexpr, ROUND: tl.constexpr,
                          WITH_ENTROPY: tl.constexpr, NEED_DB: tl.constexpr,
                          TILE_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The fused-gradient path's dlogits, in place: for the n = clamp(count, 0, n_rows) valid
    rows of a block, z = d + zoff[row, col // TILE_V] from the stored logits tile (z, written by
    _fwd_kernel with STORE_Z; with ROUND, z = _transform(a) of the stored rounded logit a: the
    forward's z exactly), then ws[r, c] = dz as _dlogits_kernel forms it (no lse grad),
    in ws's dtype at the same address (z and ws are two dtype views of one buffer: each element
    is read before it is overwritten, by the same program). dbp[pid_n, c]: column sums for
    d_bias. Rows past n are neither read nor written (the GEMM steps stop at n)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    n_valid = _valid_rows(count_ptr, 0, n_rows, True)
    if pid_n * BLOCK_N >= n_valid:
        if NEED_DB:
            tl.store(dbp_ptr + pid_n.to(tl.int64) * V + cols, tl.zeros((BLOCK_V,), tl.float32),
                     mask=col_mask)
        return
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_valid
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_ws + cols[None, :]
    d = tl.load(z_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if ROUND:
        z, y = _transform(d, inv_temp, cap_pre, cap_post, HAS_CAP)
    elif TILE_V % BLOCK_V == 0:   # one stored max per row in this tile: a [BLOCK_N] load
        off = tl.load(zoff_ptr + rows.to(tl.int64) * n_ztiles + (pid_v * BLOCK_V) // TILE_V,
                      mask=row_mask, other=0.0)
        z = d + off[:, None]
    else:
        off = tl.load(zoff_ptr + rows.to(tl.int64)[:, None] * n_ztiles + (cols // TILE_V)[None, :],
                      mask=mask, other=0.0)
        z = d + off
    if not ROUND:
        if HAS_CAP:   # tanh(a s / c) = z / cap_post (z = c y / T)
            y = z / tl.cast(cap_post, tl.float32)
        else:
            y = z
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    dz = _dz_tile(z, y, cols, ids, lse, g_lp, g_lp, gent_ptr, ent_ptr, rows, row_mask, inv_temp,
                  HAS_CAP, WITH_ENTROPY)
    dz = tl.where(mask, dz, 0.0)
    tl.store(ws_ptr + offs, dz.to(ws_ptr.dtype.element_ty), mask=mask)
    if NEED_DB:
        tl.store(dbp_ptr + pid_n.to(tl.int64) * V + cols, tl.sum(dz, 0), mask=col_mask)


@triton.jit
def _scale_kernel(t_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """t[:n] *= g in fp32 (g a device scalar), a grid-stride loop of BLOCK chunks. g == 1, the
    seed of loss.backward(), leaves t as it is: every program reads g and exits, so the common
    case makes no pass over t (and a few programs a SM, not one a chunk, make it ~µs)."""
    g = tl.load(g_ptr).to(tl.float32)
    if g == 1.0:
        return
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(t_ptr + offs, mask=mask).to(tl.float32)
        tl.store(t_ptr + offs, (t * g).to(t_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _dx_split_kernel(ws_ptr, w_ptr, part_ptr, dx_ptr, perm_ptr, count_ptr, n_rows, V, H,
                     stride_ws, stride_w, stride_dx, n_hblocks, n_sms, max_rows,
                     S_MAX: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, scale_ptr, ROW_SCALE: tl.constexpr):
    """dX[perm[i]] = ws[i] @ W for the block's n valid rows i, its K = V loop split S ways
    (_dx_splits). Program pid < S * T takes split pid // T of output tile pid % T (swizzled as
    the one-split step), the rest exit: the grid is the static cdiv(R', BLOCK_M) * H blocks *
    S_MAX. S = 1 stores dX directly; S > 1 stores fp32 partials part[s * n_pad + i] [., H] that
    _dx_split_reduce_kernel sums in split order (deterministic for a given n). ROW_SCALE: dX rows
    are scaled by scale[i] (fp32) as they are stored (the exp-scaled backward: ws holds e')."""
    n_valid = _valid_rows(count_ptr, 0, n_rows, True)
    n_split, n_pad = _dx_splits(n_valid, n_hblocks, n_sms, max_rows, S_MAX, BLOCK_M)
    n_mblocks = n_pad // BLOCK_M
    tiles = n_mblocks * n_hblocks
    pid = tl.program_id(0)
    if pid >= tiles * n_split:
        return
    split = pid // tiles
    pid_m, pid_h = _swizzle_id(pid % tiles, n_mblocks, n_hblocks, GROUP_M)
    # split s covers columns [s * kc, (s + 1) * kc), whole BLOCK_K steps (the last one to V)
    kc = tl.cdiv(tl.cdiv(V, n_split), BLOCK_K) * BLOCK_K
    k_lo = split * kc
    k_hi = tl.minimum(k_lo + kc, V)
    a_src = _desc(ws_ptr, n_valid, V, stride_ws, USE_TMA, BLOCK_M, BLOCK_K)
    b_src = _desc(w_ptr, V, H, stride_w, USE_TMA, BLOCK_K, BLOCK_H)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = _tile(a_src, pid_m * BLOCK_M, k0, n_valid, V, stride_ws, USE_TMA, BLOCK_M, BLOCK_K)
        b = _tile(b_src, k0, pid_h * BLOCK_H, V, H, stride_w, USE_TMA, BLOCK_K, BLOCK_H)
        acc = _dot(a, b, acc, DOT_PREC)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < n_valid)[:, None] & (hs < H)[None, :]
    if n_split == 1:
        if ROW_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=rows < n_valid, other=0.0)[:, None]
        dst = tl.load(perm_ptr + rows, mask=rows < n_valid, other=0)
        tl.store(dx_ptr + dst.to(tl.int64)[:, None] * stride_dx + hs[None, :],
                 acc.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        prow = (split * n_pad + rows).to(tl.int64)
        tl.store(part_ptr + prow[:, None] * H + hs[None, :], acc, mask=mask)


# --- the exp-scaled backward (fused/blocks.py; GRPOConfig.fused_scaled_backward) ------------------
#
# Without an entropy gradient or a softcap, a row's dlogits are
#     dz[v] = (g_lp (1[v = y] - p[v])) s / T,   p[v] = e^(z[v] - lse)
# and with e[v] = e^(z[v] - R*) stored by the forward (R* one per-row reference), that is
#     dz[v] = c e'[v],   c = -g_lp e^(R* - lse) s / T,   e'[v] = e[v] except
#     e'[y] = (p[y] - 1) e^(lse - R*)                           (p[y] from the fp32 logprob)
# so dX rows = c * (e' @ W) (a scale as they are stored) and dW = e'.T @ (c * X) (X's rows
# scaled once, [R, H]): no pass over the [R, V] tile between the GEMMs.
# The reference: M = z[y] + E_LEAD (the target logit, from one dot product a row), so that
# R* - lse = E_LEAD + logp[y] and e^(z - R*) = p e^(-logp[y] - E_LEAD): nothing above p ~ e^-71
# underflows. A row whose max passes M + E_HEADROOM (logp[y] < ~-48: a token the policy gives
# almost no mass) had its tiles stored against R = max(M, tile max - E_HEADROOM) instead, and
# the combine kernel brings those tiles to R* (its programs with no such row skip that loop).
# Neither R* nor e'[y] depends on g_lp, so ws holds e' when the block forward returns; the
# backward's one extra kernel (_exp_prep_kernel) forms c and scales X's rows.


@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _target_ref_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, count_ptr, ref_ptr, n_rows, V, H, stride_x,
                       stride_w, inv_temp, lead, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """ref[r] = M = (x[r] . w[ids[r]] + b[ids[r]]) s / T + lead (fp32) for the block's valid rows
    r < n: the target logit as the forward computes it (any rounding will do: M is only the
    reference e is stored against)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_valid = _valid_rows(count_ptr, 0, n_rows, True)
    if tl.program_id(0) * BLOCK_R >= n_valid:
        return
    row_mask = rows < n_valid
    ids = tl.minimum(tl.maximum(tl.load(ids_ptr + rows, mask=row_mask, other=0), 0), V - 1)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (hs < H)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + hs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ids.to(tl.int64)[:, None] * stride_w + hs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * w, 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ids, mask=row_mask, other=0.0).to(tl.float32)
    m = acc * tl.cast(inv_temp, tl.float32) + lead
    # a NaN target logit (0 * inf in a banned token's row) would make max(M, .) differ between
    # the GPU (fmax: the other operand) and the interpreter (NaN); -inf stores every tile
    # against its own max and re-references the row
    tl.store(ref_ptr + rows, tl.where(m == m, m, float("-inf")), mask=row_mask)


@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _exp_prep_kernel(x_ptr, lse_ptr, glp_ptr, ref_ptr, count_ptr, n_rows, H, stride_x, inv_temp,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """For the block's valid rows r < n (the block comment above): c = -g_lp e^(R* - lse) s / T
    -> ref[2 R' + r] (by the programs of the first h-block) and x[r, h-block] *= c (in x's
    dtype: the dW step's operand). ws already holds e' (kernels.combine._combine_kernel, STORE_E)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_valid = _valid_rows(count_ptr, 0, n_rows, True)
    if tl.program_id(0) * BLOCK_R >= n_valid:
        return
    row_mask = rows < n_valid
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    r_star = tl.load(ref_ptr + n_rows + rows, mask=row_mask, other=0.0)
    g = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    c = tl.where(row_mask, -g * tl.exp(r_star - lse) * tl.cast(inv_temp, tl.float32), 0.0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = row_mask[:, None] & (hs < H)[None, :]
    xp = x_ptr + rows.to(tl.int64)[:, None] * stride_x + hs[None, :]
    x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    tl.store(xp, (x * c[:, None]).to(x_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(ref_ptr + 2 * n_rows + rows, c, mask=row_mask)


@triton.jit
def _first_fit_kernel(lens_ptr, blk_ptr, n_seq, block_rows, n_blocks, BLOCK_G: tl.constexpr,
                      CHUNK: tl.constexpr):
    """One program, sequential over the S sequences in first-fit order (lens: their lengths in
    that order, longest first for first-fit decreasing; fused_order.pack_sequences): each goes
    to the first of the n_blocks blocks (fill [BLOCK_G] in registers) that still holds its
    rows, blk[i] = that block. The lengths come CHUNK at a time (one global-load latency a
    chunk rather than two dependent ones a sequence; not timed on a GPU yet: the A/B of
    first-fit decreasing ran a loop loading each sequence's length) and the chunk's blocks go
    out in one store.
    The caller launches enough blocks for any first-fit (next_fit_blocks' bounds hold for
    it), so one always fits; the clamp only keeps a broken bound from writing past them."""
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, CHUNK)
    fill = tl.where(g < n_blocks, 0, block_rows + 1).to(tl.int64)   # no block past G fits
    for i0 in range(0, n_seq, CHUNK):
        in_seq = i0 + c < n_seq
        lens = tl.load(lens_ptr + i0 + c, mask=in_seq, other=0).to(tl.int64)   # [CHUNK]
        blks = tl.zeros((CHUNK,), tl.int64)
        for j in range(CHUNK):   # past S: length 0, block 0, fill unchanged, not stored
            n = tl.sum(tl.where(c == j, lens, 0), 0)
            b = tl.minimum(tl.min(tl.where(fill + n <= block_rows, g, BLOCK_G), 0), n_blocks - 1)
            fill = tl.where(g == b, fill + n, fill)
            blks = tl.where(c == j, b.to(tl.int64), blks)
        tl.store(blk_ptr + i0 + c, blks, mask=in_seq)
