"""The @triton.jit kernels of `compiled_grpo::linear_logprobs` on CUDA (launchers: recompute/dense.py).

Legend: N tokens (dynamic), H hidden, V vocab (static), BN/BV/BK tile sizes.
"""
import triton
import triton.language as tl

from lowerings.linear_logprobs.kernels.tiles import VARYING_PTRS, _swizzle, _swizzle_id, _valid_rows
from lowerings.linear_logprobs.kernels.writes import writes


@triton.jit
def _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The X and W operands of _logits_tile: in-kernel TMA descriptors (made once per program;
    their 128-byte tensor maps live in Triton's global scratch, see _ensure_allocator) or the
    raw pointers."""
    if USE_TMA:
        x_src = tl.make_tensor_descriptor(x_ptr, shape=[N, H], strides=[stride_x, 1],
                                          block_shape=[BLOCK_N, BLOCK_K])
        w_src = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[stride_w, 1],
                                          block_shape=[BLOCK_V, BLOCK_K])
    else:
        x_src = x_ptr
        w_src = w_ptr
    return x_src, w_src


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1): exp overflowing to inf gives 1, underflowing to 0 gives
    -1, so no overflow at any x (+-inf -> +-1); absolute error ~2e-7, so ~cap * 2e-7 in a
    softcapped logit: about its fp32 ulp at |z| ~ cap, far under the error of the
    fp32-accumulated GEMM that produced it. One exp and one division, no sign select: the
    sign(x) (1 - e) / (1 + e), e = exp(-2|x|) form spilled the softcapped forward (940 bytes a
    thread, none now; aot_check, sm_90). Not libdevice.tanh: the TRITON_INTERPRET tests cannot
    run extern calls; this way they test the form the GPU runs."""
    return 1.0 - 2.0 / (_exp(2.0 * x) + 1.0)


@triton.jit
def _exp(x):
    """e^x as tl.exp computes it, ex2.approx of x * log2(e) in fp32 (the same product, the same
    MUFU result), with results under 2^-126 (x < -87.3) flushed to 0: tl.exp lowers to
    ex2.approx.f32, whose denormal handling ptxas wraps around the MUFU as a compare and two
    predicated multiplies (three more instructions an element of every exp'd tile); tl.math.exp2
    lowers to ex2.approx.ftz.f32. Every exp of a logits tile's epilogue takes it: a sum of
    e^(z - max) >= 1 cannot see a term under 2^-126, and a dlogit p (...) with p < 2^-126 moves
    a gradient by less than 2^-126 |g| s / T an element. (The interpreter's numpy exp2 keeps
    denormals: the CPU tests and the GPU differ there only.)"""
    return tl.math.exp2(x * 1.4426950408889634)


@triton.jit
def _col_ids(ids):
    """A row's target id (int64, as the caller's token ids come) as the int32 a tile's column
    indices are, so the one-hot compare of every element of a tile is one 32-bit compare, not
    two (ISETP and its .EX half) and a sign extension of the column. Valid ids are < V < 2^31;
    the ids of masked rows (-1, -100 or anything) only select a column of a row whose values
    nothing reads."""
    return ids.to(tl.int32)


@triton.jit
def _logits_tile(x_src, w_src, b_ptr, row0, col0, rows, cols, row_mask, col_mask, H, stride_x,
                 stride_w, inv_temp, cap_pre, cap_post, HAS_BIAS: tl.constexpr,
                 HAS_CAP: tl.constexpr, ROUND: tl.constexpr, RDTYPE: tl.constexpr,
                 DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """(z, y, a16) [BLOCK_N, BLOCK_V], z and y fp32 (a16: the ROUND tile a in RDTYPE, else a in fp32):
    with a = x[rows] @ w[cols].T + b[cols] and the model's
    logit_scale s, softcap c and temperature T,
        HAS_CAP:  y = tanh(a * cap_pre), z = y * cap_post   (cap_pre = s / c, cap_post = c / T)
        else:     z = y = a * inv_temp                      (inv_temp = s / T)
    i.e. z = c * tanh(a * s / c) / T (HF / TRL order: scale, cap, temperature), z = a * s / T
    without a cap (s folds into inv_temp only then; s = 1 is the unscaled kernel exactly).
    ROUND (round_logits): a = x @ w.T is rounded to RDTYPE (the operands' 16-bit dtype), and
    again after adding the bias (rounded too), before the scale, cap and temperature in fp32:
    the logits TRL 1.16's head computes under autocast (a bf16 GEMM output, then a bf16 add).
    rows = row0 + arange(BLOCK_N), cols = col0 + arange(BLOCK_V). USE_TMA: x_src / w_src are
    descriptors whose loads zero-fill rows >= N, cols >= V and k >= H (what the pointer path's
    masks do)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            a = x_src.load([row0, k0])
            b = w_src.load([col0, k0])
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PREC)
    else:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_src + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
        w_ptrs = w_src + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        for k0 in range(0, H, BLOCK_K):
            k_mask = (ks + k0) < H
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    a16 = acc   # ROUND: the rounded logits in RDTYPE (the fused forward stores them as they are)
    if ROUND:
        a16 = acc.to(RDTYPE)
        acc = a16.to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0)
        if ROUND:
            a16 = (acc + b.to(RDTYPE).to(tl.float32)[None, :]).to(RDTYPE)
            acc = a16.to(tl.float32)
        else:
            acc += b.to(tl.float32)[None, :]
    z, y = _transform(acc, inv_temp, cap_pre, cap_post, HAS_CAP)
    return z, y, a16


@triton.jit
def _transform(a, inv_temp, cap_pre, cap_post, HAS_CAP: tl.constexpr):
    """(z, y) of a logits tile a (fp32): the model's scale, cap and temperature as
    _logits_tile states them. One definition: the fused path's dlogits pass recomputes z from a
    stored rounded a with it (round_logits), bit for bit the forward's z."""
    if HAS_CAP:
        y = _tanh(a * tl.cast(cap_pre, tl.float32))
        return y * tl.cast(cap_post, tl.float32), y
    else:
        z = a * tl.cast(inv_temp, tl.float32)
        return z, z


@triton.jit
def _tile_stats(z, cols, ids, m, s, t, zt, WITH_ENTROPY: tl.constexpr):
    """One logits tile z [BN, BV] fp32 (-inf on masked columns) folded into its rows' running
    statistics: (m, s, t, zt, m_sh, d, e) with m the max, s = sum e^(z - m),
    t = sum e^(z - m) (z - m) (WITH_ENTROPY), zt += the target logit (ids' column: int32 ids,
    _col_ids, as _fwd_kernel loads them), and the
    tile as d = z - m_sh <= 0 and e = e^d (m_sh: the new max, finite). The one definition of
    the forward's epilogue (_fwd_kernel)."""
    # the target logit first: after the max, z is only needed as d = z - m_new (same
    # registers), so the tile is held once rather than as z and exp(z) side by side
    zt += tl.sum(tl.where(cols[None, :] == ids[:, None], z, 0.0), 1)
    m_new = tl.maximum(m, tl.max(z, 1))
    m_sh = tl.maximum(m_new, -3.0e38)  # finite when every column so far is -inf (banned)
    alpha = _exp(m - m_sh)
    d = z - m_sh[:, None]                              # <= 0, -inf on masked columns
    e = _exp(d)                                        # 0 on masked columns
    if WITH_ENTROPY:
        # t = sum e * (z - m), rescaled to the new max: alpha * (t + (m - m_new) * s)
        shift = tl.where(s > 0, (m - m_new) * s, 0.0)  # s = 0 before the first tile
        # 0 log 0 = 0: e = 0 on masked columns and at -inf logits (banned tokens), where d
        # is -inf: clamped to a finite d, e * d is 0 there (a select on e > 0 spilled the
        # fused forward: 440 bytes a thread, none now; aot_check, sm_90)
        t = alpha * (t + shift) + tl.sum(e * tl.maximum(d, -3.0e38), 1)
    s = s * alpha + tl.sum(e, 1)
    return m_new, s, t, zt, m_sh, d, e


@triton.jit
def _tile_out(d, e, m_sh, ref, STORE_E: tl.constexpr, E_HEADROOM: tl.constexpr):
    """(value, reference) of a tile the fused forward stores (_fwd_kernel's STORE_Z): d, whose
    reference is m_sh, or (STORE_E) e^(z - R) = e^d e^(m_sh - R) with R = max(ref,
    m_sh - E_HEADROOM), so the stored value is at most e^E_HEADROOM."""
    if STORE_E:
        r_t = tl.maximum(ref, m_sh - E_HEADROOM)
        return e * _exp(m_sh - r_t)[:, None], r_t
    else:
        return d, m_sh


# The batch's sizes and offsets (N, the row blocks, the output row offset and length) are not
# specialized: Triton would compile another variant for N % 16 == 0 or N == 1, and a variant's
# code may round a row's statistics differently (H200: N = 16383 against 16384 changed 473
# rows' log-probs, bench/probes/invariance_probe.py). One variant for every batch keeps rows
# bitwise independent of it (batch invariance).
BATCH_ARGS = ("N", "n_blocks", "out_row0", "out_n")


@writes("m_ptr", "s_ptr", "t_ptr", "zt_ptr", z_ptr="STORE_Z", zoff_ptr="STORE_Z")
@triton.jit(do_not_specialize=BATCH_ARGS, do_not_specialize_on_alignment=VARYING_PTRS)
def _fwd_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, count_ptr, N, V, H,
                stride_x, stride_w, inv_temp, cap_pre, cap_post, cols_per_split, n_blocks,
                n_splits, out_row0, out_n, z_ptr, zoff_ptr, stride_z, n_ztiles,
                HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, ROUND: tl.constexpr,
                WITH_ENTROPY: tl.constexpr, HAS_COUNT: tl.constexpr,
                DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                STORE_Z: tl.constexpr, ref_ptr, STORE_E: tl.constexpr,
                E_HEADROOM: tl.constexpr):
    """Statistics of rows [0, N) of x (ids alike) into column out_row0 + row of the [S, out_n]
    buffers. HAS_COUNT: only the first clamp(count - out_row0, 0, N) rows are valid (rows
    compacted valid-first, count on the device); programs past them exit at once.
    STORE_Z (the fused-gradient path, fused/schedule.py): each logits tile also goes to z [N, stride_z]
    relative to the running row max after it, d = z - m_sh <= 0, in z's dtype (fp16 for 16-bit
    operands), and m_sh to zoff[row, tile] fp32 [N, n_ztiles]: z = d + zoff exactly where p
    is large (d near 0), and an error |d| * 2^-11 where p <= e^d is small (stored from the
    MMA's registers: a TMA store through shared memory measured no faster, H100). With ROUND the
    tile goes to z as the rounded logit a (exact in the 16-bit RDTYPE that z then has), so the
    dlogits pass recomputes the forward's z bit for bit, as the recompute path and TRL's head do
    (zoff is then not written: nothing reads it). It is stored before the tile's statistics:
    the forward ran 12.4-12.7 ms a qwen3-8b step against 13.2-13.4 storing after them, where
    a's registers stay live through the epilogue (H100, two A/B runs each:
    bench/results/round_store_h100_1cf350e.txt; ptxas spilled 116 bytes a thread there until
    the epilogue's exps and id compares got shorter, none since).
    The vocab-tile loop is flattened with its K loop, so the pipeliner issues the next tile's
    operand loads during this tile's statistics epilogue (H100, qwen3-8b fused step: 40.2
    against 41.0-41.2 ms unflattened; HISTORY.md).
    (No parameter has a default: the recompute op's traced launches (launching/traced.py) name
    every one.) STORE_E (with STORE_Z; the exp-scaled backward, fused/blocks.py): the tile goes to
    z in z's dtype as e = exp(z - R) with R = max(M, m_sh - E_HEADROOM), M = ref[row] a per-row
    reference (the target logit plus a lead), and R to zoff[row, tile]: e <= e^E_HEADROOM, and
    R = M in every tile of a row whose max stays under M + E_HEADROOM, so such a row's dlogits
    are one per-row scale of its stored e (no separate pass; kernels.fused_block's block comment).
    The split plan (S splits of cols_per_split columns, split_plan.fwd_split_plan) is fixed by the
    shape and the device, never by N or the valid rows, and a row's statistics come from its
    own tiles in one fixed order: a row's values do not depend on the batch around it."""
    n_valid = _valid_rows(count_ptr, out_row0, N, HAS_COUNT)
    pid_n, split = _swizzle(n_blocks, n_splits, GROUP_N)
    if pid_n * BLOCK_N >= n_valid:
        return
    x_src, w_src = _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA, BLOCK_N,
                             BLOCK_V, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_valid
    ids = _col_ids(tl.load(ids_ptr + out_row0 + rows, mask=row_mask, other=-1))
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    ref = m   # read only with STORE_E
    if STORE_E:
        ref = tl.load(ref_ptr + rows, mask=row_mask, other=0.0)
    # The first tile of each split has a valid column, so m is finite after it; tiles past V
    # (only in the last split, under BLOCK_V * splits columns in all) are fully masked.
    for i in tl.range(0, cols_per_split, BLOCK_V, flatten=True):
        col0 = split * cols_per_split + i
        cols = col0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z, _, a = _logits_tile(x_src, w_src, b_ptr, pid_n * BLOCK_N, col0, rows, cols, row_mask,
                               col_mask, H, stride_x, stride_w, inv_temp, cap_pre, cap_post,
                               HAS_BIAS, HAS_CAP, ROUND, x_ptr.dtype.element_ty, DOT_PREC, USE_TMA,
                               BLOCK_N, BLOCK_V, BLOCK_K)
        if STORE_Z and ROUND:   # the rounded logit a itself, exact in z's dtype (RDTYPE,
            # fused_cuda._z_view), stored before the statistics so a's registers free at once
            tl.store(z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :],
                     a.to(z_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
        # columns past V to -inf by an add (0 or -inf a column), which ptxas fuses with the
        # logit scale's multiply into one FFMA: a select an element otherwise (their z is 0:
        # W's rows past V load as 0)
        z = z + tl.where(col_mask, 0.0, float("-inf"))[None, :]
        m, s, t, zt, m_sh, d, e = _tile_stats(z, cols, ids, m, s, t, zt, WITH_ENTROPY)
        if STORE_Z and not ROUND:
            zmask = row_mask[:, None] & col_mask[None, :]
            val, r_t = _tile_out(d, e, m_sh, ref, STORE_E, E_HEADROOM)
            tl.store(z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :],
                     val.to(z_ptr.dtype.element_ty), mask=zmask)
            # (a tile wholly past V, in the last split, has no slot: its index is n_ztiles).
            # col0 broadcast before the compare, not row_mask & (col0 < V): Triton 3.9's
            # interpreter makes that an integer mask, which its store refuses (the same SASS)
            tl.store(zoff_ptr + rows.to(tl.int64) * n_ztiles + col0 // BLOCK_V, r_t,
                     mask=row_mask & (tl.full((BLOCK_N,), col0, tl.int32) < V))
    out = split.to(tl.int64) * out_n + out_row0 + rows
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(t_ptr + out, t, mask=row_mask)
    tl.store(zt_ptr + out, zt, mask=row_mask)


@triton.jit
def _dz_tile(z, y, cols, ids, lse, coef, g_lp, gent_ptr, ent_ptr, rows, row_mask, inv_temp,
             HAS_CAP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """dL/da [BLOCK_N, BLOCK_V] of logits z (y = tanh(a s / c) with a cap) for per-row lse,
    coef = g_lp - g_lse, g_lp and target ids, and (WITH_ENTROPY) g_ent and entropy loaded at
    `rows` (cpu.dlogits' formula):
    (g_lp * onehot - p * (coef + g_ent * (log p + H))) * s / T, times (1 - y^2) with a cap,
    formed as p * (a + b log p) + onehot * g with the per-row a = -(coef + g_ent H) s / T,
    b = -g_ent s / T, g = g_lp s / T: the row terms and the scale folded into three numbers a
    row, so an element costs a multiply-add less (two with entropy)."""
    logp = z - lse[:, None]
    p = _exp(logp)
    scale = tl.cast(inv_temp, tl.float32)   # d/da of z = a s / T; a cap's (1 - y^2) below
    if WITH_ENTROPY:
        g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        a = -(coef + g_ent * ent) * scale
        b = -g_ent * scale
        # p log p -> 0 as p -> 0: log p clamped to -128, so p = 0 at a banned token (log p =
        # -inf) gives 0, not 0 * -inf. Exact: p is 0 below e^-103.3 (under fp32's least
        # denormal), and b * 128 stays finite for any |b| < 2e36
        dz = p * (a[:, None] + b[:, None] * tl.maximum(logp, -128.0))
    else:
        dz = p * (-coef * scale)[:, None]
    dz = tl.where(cols[None, :] == _col_ids(ids)[:, None], dz + (g_lp * scale)[:, None], dz)
    if HAS_CAP:
        dz = dz * (1.0 - y * y)
    return dz


@writes("ws_ptr", dbp_ptr="NEED_DB")
@triton.jit(do_not_specialize_on_alignment=VARYING_PTRS)
def _dlogits_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, glse_ptr,
                    ws_ptr, dbp_ptr, count_ptr, N, V, H, x_row_first, row_first, n_rows, v_first,
                    stride_x, stride_w, stride_ws, inv_temp, cap_pre, cap_post, n_blocks, n_vtiles,
                    n_programs, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
                    ROUND: tl.constexpr, WITH_ENTROPY: tl.constexpr, NEED_DB: tl.constexpr,
                    HAS_COUNT: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_N: tl.constexpr):
    """Rows x_row_first + [0, n_rows) of X (N rows in all; the [N] vectors at row_first + the
    same offsets), columns v_first + [0, stride_ws): ws[r, c] = dz[row_first + r, v_first + c]
    (_dz_tile); with NEED_DB, dbp[pid_n, c] = its sum over row block pid_n's rows. HAS_COUNT:
    rows past clamp(count - row_first, 0, n_rows) are padding (compacted last): their row
    blocks are not visited, so ws keeps stale values there that the GEMM steps never read, and
    dbp keeps its rows there as the launcher made them (zeros: the launchers allocate dbp
    zeroed once a row group, and a group's chunks visit the same row blocks).
    A persistent grid of n_programs (one a SM; launchers: recompute/dense.py, recompute/rows.py): each walks
    the tiles of the n_blocks x n_vtiles grid's row blocks with a valid row, tile_id = pid,
    pid + n_programs, ..., through one flattened (tile, K step) loop, so Triton's pipeliner
    issues the next tile's operand loads while this tile's epilogue (exp, the dz formula, the
    ws store) runs. With one program a tile (before 2026-11-27) that epilogue and the next
    program's pipeline fill were exposed (the 128 x 256 fp32 tile keeps one program a SM):
    H100, qwen3-8b bench, recompute mode: 14.1 -> 12.9 ms of dlogits a step
    (bench/results/recompute_dlogits_h100.txt). A tile's values do not depend on which
    program computes it."""
    n_valid = _valid_rows(count_ptr, row_first, n_rows, HAS_COUNT)
    n_vb = tl.cdiv(n_valid, BLOCK_N)                      # row blocks with a valid row
    if tl.program_id(0) >= n_vb * n_vtiles:
        # no tile (a row group past the valid rows): exit before making the tensor maps, which
        # took an empty launch 4 us against 1.5 for the GEMM steps' (H100, qwen3-8b recompute
        # step at 39% valid: 81 such launches a step)
        return
    x_src, w_src = _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA, BLOCK_N,
                             BLOCK_V, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), n_vb * n_vtiles, n_programs, flatten=True):
        pid_n, pid_v = _swizzle_id(tile_id, n_vb, n_vtiles, GROUP_N)
        local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)     # column inside the chunk
        cols = v_first + local
        col_mask = (local < stride_ws) & (cols < V)
        local_rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # row inside the group
        rows = row_first + local_rows
        row_mask = local_rows < n_valid
        z, y, _ = _logits_tile(x_src, w_src, b_ptr, x_row_first + pid_n * BLOCK_N,
                               v_first + pid_v * BLOCK_V, x_row_first + local_rows, cols,
                               row_mask, col_mask, H, stride_x, stride_w, inv_temp, cap_pre,
                               cap_post, HAS_BIAS, HAS_CAP, ROUND, x_ptr.dtype.element_ty,
                               DOT_PREC, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K)
        ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        coef = g_lp - tl.load(glse_ptr + rows, mask=row_mask, other=0.0)
        dz = _dz_tile(z, y, cols, ids, lse, coef, g_lp, gent_ptr, ent_ptr, rows, row_mask,
                      inv_temp, HAS_CAP, WITH_ENTROPY)
        mask = row_mask[:, None] & col_mask[None, :]
        dz = tl.where(mask, dz, 0.0)                      # padded rows/cols may hold inf/nan
        ws_ptrs = ws_ptr + local_rows.to(tl.int64)[:, None] * stride_ws + local[None, :]
        tl.store(ws_ptrs, dz.to(ws_ptr.dtype.element_ty), mask=mask)
        if NEED_DB:   # round_logits: d_bias sums the rounded dlogits, as dX / dW use them (TRL's)
            if ROUND:
                dz = dz.to(ws_ptr.dtype.element_ty).to(tl.float32)
            tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_ws + local, tl.sum(dz, 0),
                     mask=col_mask)
