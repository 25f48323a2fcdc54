"""CUDA bodies of the fused-gradient block steps (fused/schedule.py): Triton kernels launched directly
(the steps are opaque custom ops; tests call these functions on CPU tensors under
TRITON_INTERPRET=1).

Legend: R' rows of the block (its valid ones first, n of them: counts[b] on the device), H
hidden, V vocab, Vp = ws's row stride (V rounded up to 64: TMA-legal).

  block_forward    _gather_rows_kernel  xg[:n] = X[perm[r0 : r0 + n]]
                   (scaled) _target_ref_kernel  ref[:n] = M, the rows' target logits + E_LEAD
                   _fwd_kernel (STORE_Z) statistics of xg's n rows over the fixed vocab
                                        splits (split_plan.fwd_split_plan: batch invariance),
                                        and d = z - running max into
                                        ws (fp16 view) with the max per 256-column tile in zoff;
                                        scaled (STORE_E): e = exp(z - R) in ws's dtype, R per tile
                   _combine_kernel      the splits' statistics -> (logprobs, entropy, lse);
                                        scaled: R* (the row's reference) -> ref[R' : R' + n],
                                        ws <- e' (rare rows re-referenced, target entries)
  block_backward   _fused_dlogits_kernel ws[:n] <- dlogits (in place, input dtype), or, scaled:
                   _exp_prep_kernel     c -> ref[2R' : 2R' + n], xg[:n] *= c
                   _dw_step_persistent_kernel  dW (+)= ws[:n].T @ xg[:n]   (K loop stops at
                                        n; one program per SM walks the dW tiles; launched
                                        storing and adding, the device picks which works)
                   _dx_split_kernel     dX[perm[r0 + i]] = ws[i] @ W (scaled: times c[i]) for i < n
                                        (rows past n exit),
                                        the K = V loop split S ways when the grid is small
                   _dx_split_reduce_kernel  (S > 1) the splits' fp32 partials summed into dX
                   (sm_90: the dW step is kernels.dw_gluon._dw_step_ws_kernel, same contract;
                   dw_steps.launch picks, for the recompute path's groups too)

Every kernel stops at n, so a block's cost is that of its valid rows (2 + 4 = 6 n H V FLOPs).
Every launch goes through precompile.capturable (and so fast_launch: the compiled launcher after
a key's first launch); precompile_eager hands an eager call's kernels to launching/precompile.py's workers
before its first block (a trace does it from the steps' fakes).
"""
from typing import Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs import tuning as _tune
from lowerings.linear_logprobs.recompute import dense as _dense
from lowerings.linear_logprobs.recompute import plan as _plan
from lowerings.linear_logprobs.recompute.dense import cdiv, next_power_of_2
from lowerings.linear_logprobs.device import grid_sms
from lowerings.linear_logprobs.recompute import rows as _rows
from lowerings.linear_logprobs.recompute import dw_steps as _dws
from lowerings.linear_logprobs.kernels.combine import _combine_kernel
from lowerings.linear_logprobs.kernels.logits import _fwd_kernel
from lowerings.linear_logprobs.kernels.fused_block import (_dx_split_kernel, _exp_prep_kernel,
                                                           _fused_dlogits_kernel, _target_ref_kernel)
from lowerings.linear_logprobs.kernels.splits import _dx_split_reduce_kernel
from lowerings.linear_logprobs.launching import precompile as _precompile
from lowerings.linear_logprobs.launching.precompile import capturable

# the kernels as launched below: their own launch, unless launching/precompile.py is capturing it
(_combine_kernel, _fwd_kernel, _dx_split_kernel, _dx_split_reduce_kernel, _exp_prep_kernel,
 _fused_dlogits_kernel, _target_ref_kernel) = map(
    capturable, (_combine_kernel, _fwd_kernel, _dx_split_kernel, _dx_split_reduce_kernel,
                 _exp_prep_kernel, _fused_dlogits_kernel, _target_ref_kernel))
# ... and the two dW steps, which dw_steps.launch picks between (by id: a JITFunction's hash
# reads its source and dependencies)
_DW_KERNELS = {id(k): capturable(k) for k in (_dws._dw_step_persistent_kernel,
                                              _dws._dw_step_ws_kernel)}


def _dw_capturable(kernel) -> capturable:
    return _DW_KERNELS[id(kernel)]

# The in-place dlogits pass: an elementwise [BLOCK_N, BLOCK_V] tile a program, (BLOCK_N,
# BLOCK_V, num_warps), set by tuning runs (bench.kernels.fused --sweep). d_bias
# partial sums are [cdiv(R, BLOCK_N), V] fp32 (only with a bias). H100, qwen3-8b, 39% valid
# (bench.kernels.fused --sweep dlogits): 1.73 ms a step at (32, 256, 8), 2.00 at (32, 256, 4).
DLOGITS_TILE = (32, 256, 8)
# The dX step's most splits over V (kernels.splits._dx_splits picks S <= DX_SPLITS on the
# device from the block's valid rows, for a grid of few programs: a block's short tail, or few
# H blocks); 1 turns splitting off. The fp32 partials take at most DX_SPLIT_MIB
# (DX_SPLIT_BYTES): 48 MiB holds gemma2-2b's 1280-row blocks in 4 splits.
DX_SPLITS = 8
DX_SPLIT_BYTES = 48 << 20
REDUCE_TILE = (32, 256, 4)   # the partials' sum: (BLOCK_R, BLOCK_H, num_warps)
# The exp-scaled backward (kernels.fused_block's block comment): taken where it is exact (no softcap,
# no entropy gradient, no d_bias, no vocab shards; fused.exp_scaled) unless
# GRPOConfig.fused_scaled_backward is False. E_LEAD: M = target logit + E_LEAD;
# E_HEADROOM: the largest stored e is e^E_HEADROOM (bf16 / fp32 range: |log| < 88 both ways).
E_LEAD, E_HEADROOM = 16.0, 32.0
REF_TILE = (16, 256, 4)      # the target logits' dot products: (BLOCK_R, BLOCK_H, num_warps)
PREP_TILE = (32, 512, 4)     # c and X's scaling: (BLOCK_R, BLOCK_H, num_warps)
# (scaled) the combine grid's column shares: the re-referenced rows' tiles are split this many
# ways (one program a row block walking them all: H200, every row re-referenced, 7.65 ms a
# qwen3-8b step; 16 shares: 2.60 ms; docs/performance.md), none of fewer than COMBINE_MIN_TILES tiles (V =
# 151936: 16 shares; the interpreter tests' few-tile rows: one, unless they patch it)
COMBINE_SHARES, COMBINE_MIN_TILES = 16, 32


def combine_shares(n_ztiles: int) -> int:
    """The combine grid's second dimension for rows of n_ztiles tiles (COMBINE_SHARES)."""
    return max(1, min(COMBINE_SHARES, n_ztiles // COMBINE_MIN_TILES))


def dx_split_rows(rows, h: int, itemsize: int) -> int:
    """Rows of the dX partials buffer [P, H] fp32 for blocks of `rows` rows (maybe symbolic) of
    `itemsize`-byte operands: DX_SPLIT_BYTES' worth, no more than DX_SPLITS blocks' worth (rows
    padded to the dX step's BLOCK_M, as _dx_splits pads them); 0 without splitting."""
    if DX_SPLITS <= 1:
        return 0
    bm = _tune.step_tiles(itemsize)[0][0]
    return min(DX_SPLIT_BYTES // (4 * h), DX_SPLITS * (cdiv(rows, bm) * bm))


def _z_view(ws: Tensor, rounds: bool = False) -> Tensor:
    """The stored logits' dtype view of ws: fp16 for 16-bit operands (11 significant bits for
    d = z - max; bf16 keeps 8), ws itself for fp32; with rounds (round_logits: the forward
    stores the rounded logit, a value of the operands' dtype that ws has) ws itself."""
    return ws.view(torch.float16) if ws.element_size() == 2 and not rounds else ws


def block_forward(hidden: Tensor, weight: Tensor, ids_p: Tensor, bias: Optional[Tensor],
                  perm: Tensor, counts: Tensor, ws: Tensor, zoff: Tensor, xg: Tensor, b: int,
                  r0: int, rows: int, temperature: float, with_entropy: bool,
                  logit_scale: float, softcap: Optional[float], ref: Tensor,
                  scaled: bool, round_logits: bool = False,
                  exact_tf32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    x, w, prec = _dense._prepare(hidden, weight)   # no copies: fused/schedule.py cast them once
    lprec = _tune.logits_precision(prec, exact_tf32)
    bn, bv, bk, warps, stages = _tune.tiles(x, lprec)
    rounds = _dense.rounds(x, round_logits)
    if rows == 0:
        return tuple(x.new_zeros(0, dtype=torch.float32) for _ in range(3))
    tma = _dense._use_tma(x, w)
    v, h = w.shape
    count = counts.narrow(0, b, 1)
    perm_b, ids_b = perm.narrow(0, r0, rows), ids_p.narrow(0, r0, rows)
    _rows._gather(capturable, x, perm_b, count, 0, rows, xg)
    splits, cols = _plan.fwd_split_plan(v, h, x.element_size(), bn, bv, x.device)  # invariant
    m, s, t, zt = (x.new_empty((splits, rows), dtype=torch.float32) for _ in range(4))  # [S, R']
    n_blocks = cdiv(rows, bn)
    scal = _dense._scalars(temperature, logit_scale, softcap)
    if scaled:   # ref[:R'] = M, the target logit + E_LEAD (kernels.fused_block's block comment)
        rr, rh, rwarps = REF_TILE
        _target_ref_kernel[(cdiv(rows, rr),)](
            xg, w, bias if bias is not None else x, ids_b, count, ref, rows, v, h, xg.stride(0),
            w.stride(0), scal[0], E_LEAD, HAS_BIAS=bias is not None, BLOCK_R=rr, BLOCK_H=rh,
            num_warps=rwarps)
    _fwd_kernel[(n_blocks * splits,)](
        xg, w, bias if bias is not None else x, ids_b, m, s, t, zt, count, rows, v, h,
        xg.stride(0), w.stride(0), *scal, cols, n_blocks, splits, 0, rows,
        ws if scaled else _z_view(ws, rounds), zoff, ws.stride(0), zoff.stride(0),
        HAS_BIAS=bias is not None, HAS_CAP=softcap is not None,
        ROUND=rounds, WITH_ENTROPY=with_entropy,
        HAS_COUNT=True, STORE_Z=True, DOT_PREC=lprec, USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv,
        BLOCK_K=bk, GROUP_N=_tune.GROUP_N, ref_ptr=ref,
        STORE_E=scaled, E_HEADROOM=E_HEADROOM, num_warps=warps, num_stages=stages)
    # the splits' statistics -> the block's outputs, 0 past count: the merge every CUDA path
    # shares (cuda.combine), plus the exp-scaled backward's re-referencing when scaled
    lp, ent, lse = (x.new_empty(rows, dtype=torch.float32) for _ in range(3))  # [R']
    cr, cwarps = _tune.COMBINE_TILE
    shares = combine_shares(zoff.stride(0)) if scaled else 1
    _combine_kernel[(cdiv(rows, cr), shares)](
        m, s, t, zt, count, lp, ent, lse, rows, splits, WITH_ENTROPY=with_entropy,
        HAS_COUNT=True, BLOCK_R=cr, BLOCK_S=next_power_of_2(splits), ref_ptr=ref, ws_ptr=ws,
        zoff_ptr=zoff, ids_ptr=ids_b, V=v, stride_ws=ws.stride(0), n_ztiles=zoff.stride(0),
        STORE_E=scaled, E_HEADROOM=E_HEADROOM, TILE_V=bv, num_warps=cwarps)
    return lp, ent, lse


def block_backward(weight: Tensor, ids_p: Tensor, perm: Tensor, counts: Tensor, ws: Tensor,
                   zoff: Tensor, xg: Tensor, lse: Tensor, ent: Tensor, g_lp: Tensor,
                   g_ent: Tensor, dx: Tensor, dxp: Tensor, dw: Tensor, db: Tensor, b: int, r0: int,
                   rows: int, temperature: float, with_entropy: bool, logit_scale: float,
                   softcap: Optional[float], need_x: bool, need_w: bool, need_b: bool,
                   ref: Tensor, scaled: bool, round_logits: bool = False,
                   exact_tf32: bool = False) -> None:
    # exact_tf32: W and X hold bf16 values in fp32 (fused/schedule.py): the dX / dW GEMMs in two TF32
    # products (tuning.gradient_precision), dW's in 3xTF32 where X's rows are scaled (not bf16)
    # round_logits: the forward stored the rounded logits themselves (exact in ws's 16-bit dtype),
    # the dlogits pass recomputes z from them as the forward did, and the dlogits go into ws in
    # that dtype before the dX / dW GEMMs (the logits gradient rounded, as TRL's head)
    if rows == 0:
        if need_w and b == counts.shape[0] - 1:   # the first block run (fused/schedule.py: last to first)
            dw.zero_()
        return
    v, h = weight.shape
    w = weight                       # in ws's dtype already: fused/schedule.py casts the operands once
    tma = _dense._use_tma(xg, w)
    prec = _tune.dot_precision(ws.dtype)
    count = counts.narrow(0, b, 1)
    inv_temp, cap_pre, cap_post = _dense._scalars(temperature, logit_scale, softcap)
    rounds = _dense.rounds(w, round_logits)
    ids_b = ids_p.narrow(0, r0, rows)
    if scaled:   # ws holds e' already (block_forward): c, and X's rows times c for the dW step
        assert not need_b and softcap is None
        pr, ph, pwarps = PREP_TILE
        _exp_prep_kernel[(cdiv(rows, pr), cdiv(h, ph))](
            xg, lse, g_lp, ref, count, rows, h, xg.stride(0), inv_temp, BLOCK_R=pr, BLOCK_H=ph,
            num_warps=pwarps)
        dbp = zoff
    else:
        en, ev, ewarps = DLOGITS_TILE
        n_rb = cdiv(rows, en)
        dbp = ws.new_empty((n_rb, v), dtype=torch.float32) if need_b else zoff   # [R'/BN, V]
        _fused_dlogits_kernel[(n_rb, cdiv(v, ev))](
            _z_view(ws, rounds), ws, zoff, ids_b, lse, ent, g_lp, g_ent, dbp, count, rows, v,
            ws.stride(0), zoff.stride(0), inv_temp, cap_pre, cap_post, HAS_CAP=softcap is not None,
            ROUND=rounds, WITH_ENTROPY=with_entropy, NEED_DB=need_b, TILE_V=_tune.TILES[1],
            BLOCK_N=en, BLOCK_V=ev, num_warps=ewarps)
    gemm_tiles = _tune.step_tiles(ws.element_size())[0]
    # an fp32 dW of 16-bit operands (lm_head_dtype): the fp32 epilogue tile needs the 4-byte
    # tiles (the 2-byte ones with an fp32 dW tile overflow shared memory: 272 KiB, H200)
    dw_tiles = _tune.step_tiles(max(ws.element_size(), dw.element_size()))[1]
    if need_w:
        # The blocks run last to first (fused/schedule.py). Whether dW already holds a sum is read on the
        # device from the counts of the blocks after b, which ran before it: the step is
        # launched storing and adding, and one of the two works (kernels.dw._dw_skips; the
        # other's programs exit at once). The first block with valid rows stores.
        g = counts.shape[0]
        for acc in (False, True):
            _dws.launch(_dw_capturable, ws, xg, dw, counts.narrow(0, b, g - b), 0, rows,
                        0, v, h, dw_tiles, _tune.gradient_precision(prec, exact_tf32 and not scaled),
                        tma, grid_sms(ws.device), _rows.GROUP_M, acc,
                        on_device=True, n_later=g - 1 - b, final=int(b == 0))
    if need_x:
        gm, gh, gk, gwarps, gstages = gemm_tiles
        n_mblocks, n_hblocks = cdiv(rows, gm), cdiv(h, gh)
        perm_b, sms, s_max = perm.narrow(0, r0, rows), grid_sms(ws.device), max(1, DX_SPLITS)
        split = (n_hblocks, sms, dxp.shape[0])   # what both kernels derive S from
        c = ref.narrow(0, 2 * rows, rows)   # [R'] the rows' dlogits scale (read only if scaled)
        _dx_split_kernel[(n_mblocks * n_hblocks * s_max,)](
            ws, w, dxp, dx, perm_b, count, rows, v, h, ws.stride(0), w.stride(0), dx.stride(0),
            *split, S_MAX=s_max, DOT_PREC=_tune.gradient_precision(prec, exact_tf32), USE_TMA=tma,
            BLOCK_M=gm, BLOCK_H=gh, BLOCK_K=gk,
            GROUP_M=_rows.GROUP_M, scale_ptr=c, ROW_SCALE=scaled, num_warps=gwarps,
            num_stages=gstages)
        if s_max > 1:
            rr, rh, rwarps = REDUCE_TILE
            _dx_split_reduce_kernel[(cdiv(rows, rr), cdiv(h, rh))](
                dxp, dx, perm_b, count, 0, rows, h, dx.stride(0), *split, S_MAX=s_max, BLOCK_M=gm,
                BLOCK_R=rr, BLOCK_H=rh, scale_ptr=c, ROW_SCALE=scaled, num_warps=rwarps)
    if need_b:
        db.add_(dbp.sum(0))


_EAGER_SEEN: set = set()   # the eager calls' launch configurations precompiled already


def precompile_eager(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, dx, dxp, dw, db,
                     blocks, r, ref, scaled, scal, need_x, need_w, need_b,
                     exact_tf32: bool = False) -> None:
    """An eager call's kernels, compiled by the precompile workers in parallel before the first
    block runs (a trace hands them over from the steps' fake implementations instead): one
    block's launches, captured, specialize as every block's do. Once a launch configuration:
    what the launches specialize on (the buffers' dtypes, strides and 16-byte alignment, R, the
    step's flags), not N or G, so a trainer whose batches change length every step captures
    once (the capture costs host time a small policy's eager step cannot spare)."""
    if _precompile.WORKERS <= 0:
        return

    def spec(t):
        if t is None:
            return None
        return t.dtype, t.stride(), t.storage_offset() * t.element_size() % 16

    key = (hidden.device, r, dxp.shape[0], scaled, need_x, need_w, need_b, exact_tf32,
           tuple(map(spec, (hidden, weight, bias, ws, xg, dx, dxp, dw, db))),
           tuple(sorted((k, v if isinstance(v, bool) or v is None else 0)
                        for k, v in scal.items())))
    if key in _EAGER_SEEN:
        return
    _EAGER_SEEN.add(key)
    b, vec = blocks - 1, lambda: hidden.new_empty(r, dtype=torch.float32)   # [R] stand-ins

    def launches():   # host code only: no kernel runs inside precompile's capture
        block_forward(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, b, b * r, r, ref=ref,
                      scaled=scaled, exact_tf32=exact_tf32, **scal)
        # a d_bias stand-in: the step's host code adds its (here unwritten) partial sums to db
        block_backward(weight, ids_p, perm, counts, ws, zoff, xg, vec(), vec(), vec(), vec(), dx,
                       dxp, dw, torch.empty_like(db), b, b * r, r, need_x=need_x, need_w=need_w,
                       need_b=need_b, ref=ref, scaled=scaled, exact_tf32=exact_tf32, **scal)

    _precompile.precompile(launches)
