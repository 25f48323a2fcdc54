"""The merge of the forward's vocab splits, shared by every CUDA path (recompute, row-masked,
fused): one kernel in one fixed order, so a row's values do not depend on the path or the batch
(launchers: cuda.combine, fused_cuda.block_forward).

Legend: R' rows, S vocab splits of the forward (split_plan.fwd_split_plan).
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.tiles import VARYING_PTRS, _valid_rows
from lowerings.linear_logprobs.kernels.writes import writes


@writes("lp_ptr", "ent_ptr", "lse_ptr", ref_ptr="STORE_E", ws_ptr="STORE_E")
@triton.jit(do_not_specialize=("n_rows",), do_not_specialize_on_alignment=VARYING_PTRS)
def _combine_kernel(m_ptr, s_ptr, t_ptr, zt_ptr, count_ptr, lp_ptr, ent_ptr, lse_ptr, n_rows,
                    n_splits, WITH_ENTROPY: tl.constexpr, HAS_COUNT: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, ref_ptr, ws_ptr, zoff_ptr,
                    ids_ptr, V, stride_ws, n_ztiles, STORE_E: tl.constexpr,
                    E_HEADROOM: tl.constexpr, TILE_V: tl.constexpr):
    """(logprobs, entropy, lse) [R'] from the forward splits' statistics m, s, t, zt [S, R']
    (row stride R'), in one launch (by the programs with program_id(1) = 0), 0 at rows past the
    count (HAS_COUNT; their statistics were never written). The one merge of every CUDA path
    (recompute, row-masked, fused): the S splits reduce in one fixed order (BLOCK_S and the
    tile fixed per shape), so a row's values are the same whichever path or batch computed it:

        m* = max_s m,  S = sum_s s e^(m - m*),  lse = m* + log S,  logp = sum_s zt - lse
        H  = log S - sum_s e^(m - m*) (t + (m - m*) s) / S        (a split with s = 0 adds 0)

    STORE_E (the exp-scaled backward): also R* = max(M, m* - E_HEADROOM) -> ref[R' + row], with
    M = ref[row] the reference the forward stored e = exp(z - R) against: the largest of the
    row's tile references R (R* = M unless some tile's max passed M + E_HEADROOM). Then ws
    (e, TILE_V-column tiles, R in zoff) is brought to e' against R*:
      - the rare rows with R* > M: every tile times e^(R - R*), the row's tiles shared by the
        grid's second dimension (a program a row block and column share; programs with no
        such row skip it after one reduction; H200, every row re-referenced: bench.kernels.fused
        --targets least, docs/performance.md);
      - every valid row's target entry: e'[y] = (p[y] - 1) e^(lse - R*), p[y] from the fp32
        logprob (the loop above leaves that column to this store: no two threads write it).
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_valid = _valid_rows(count_ptr, 0, n_rows, HAS_COUNT)
    valid = rows < n_valid
    sp = tl.arange(0, BLOCK_S)
    mask = (sp < n_splits)[:, None] & valid[None, :]
    offs = sp[:, None] * n_rows + rows[None, :]                              # [BLOCK_S, BLOCK_R]
    m = tl.load(m_ptr + offs, mask=mask, other=float("-inf"))
    m_all = tl.max(m, 0)
    if STORE_E:   # every program of the row block's column split: its share of the tiles
        ref = tl.load(ref_ptr + rows, mask=valid, other=0.0)
        r_star = tl.maximum(ref, m_all - E_HEADROOM)
        ids = tl.load(ids_ptr + rows, mask=valid, other=-1)
        ws_rows = ws_ptr + rows.to(tl.int64) * stride_ws                   # [BLOCK_R]
        fix = valid & (r_star > ref)
        if tl.max(fix.to(tl.int32), 0) > 0:
            per = tl.cdiv(n_ztiles, tl.num_programs(1))
            for tile in range(tl.program_id(1) * per,
                              tl.minimum(tl.program_id(1) * per + per, n_ztiles)):
                cols = tile * TILE_V + tl.arange(0, TILE_V)
                r_t = tl.load(zoff_ptr + rows.to(tl.int64) * n_ztiles + tile, mask=fix, other=0.0)
                fmask = fix[:, None] & (cols < V)[None, :] & (cols[None, :] != ids[:, None])
                e = tl.load(ws_rows[:, None] + cols[None, :], mask=fmask, other=0.0).to(tl.float32)
                e = e * tl.exp(r_t - r_star)[:, None]
                tl.store(ws_rows[:, None] + cols[None, :], e.to(ws_ptr.dtype.element_ty),
                         mask=fmask)
    if tl.program_id(1) == 0:   # the statistics, R* and the target entries: one program a row
        s = tl.load(s_ptr + offs, mask=mask, other=0.0)
        d = tl.where(mask, m - m_all[None, :], float("-inf"))   # masked lanes: scale 0, no NaN
        scale = tl.exp(d)
        s_all = tl.sum(s * scale, 0)
        log_s = tl.log(s_all)
        lse = m_all + log_s
        lp = tl.sum(tl.load(zt_ptr + offs, mask=mask, other=0.0), 0) - lse
        if WITH_ENTROPY:
            t = tl.load(t_ptr + offs, mask=mask, other=0.0)
            shift = tl.where(s > 0, d * s, 0.0)
            ent = log_s - tl.sum(scale * (t + shift), 0) / s_all
        else:
            ent = tl.zeros((BLOCK_R,), tl.float32)
        out = rows < n_rows
        tl.store(lp_ptr + rows, tl.where(valid, lp, 0.0), mask=out)
        tl.store(ent_ptr + rows, tl.where(valid, ent, 0.0), mask=out)
        tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=out)
        if STORE_E:
            tl.store(ref_ptr + n_rows + rows, r_star, mask=valid)
            e_y = (tl.exp(lp) - 1.0) * tl.exp(lse - r_star)
            tl.store(ws_rows + ids, e_y.to(ws_ptr.dtype.element_ty), mask=valid)
