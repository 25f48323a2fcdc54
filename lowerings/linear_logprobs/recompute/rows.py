"""The row-masked CUDA path of `compiled_grpo::linear_logprobs`: padding costs nothing, no host sync.

Legend: N tokens (dynamic), H hidden, V vocab (static), R rows of a row group, C vocab columns
of a backward chunk, n the valid rows (a device scalar, never read on the host).

Real RL batches are 30-60% padding (completion lengths vary). With `row_mask` [N] bool the op
orders the rows valid-first on the device (a stable sort of ~row_mask: perm [N], original order
kept inside each class) and counts them (count [1] int32), then runs recompute/dense.py's row-group
schedule over the permuted rows, every kernel reading count and stopping at it:

  per group g (rows [g R, (g + 1) R) of the permuted order, n_g = clamp(count - g R, 0, R)):
    _gather_rows_kernel   xg[:n_g] = X[perm[g R : g R + n_g]]          one [R, H] buffer
    forward: _fwd_kernel on xg; row blocks past n_g exit           2 n_g H V FLOPs
    backward, per vocab chunk:
      _dlogits_kernel on xg -> ws[:n_g, :C]                            2 n_g H C
      dW step (dw_steps)  dW[c] (+)= ws[:n_g].T @ xg[:n_g]  (K loop stops at n_g)   2 n_g H C
                       (sm_90: the Gluon kernel, one rounding a group; else the Triton
                       persistent kernel, whose TMA reduce-add rounds twice)
      _dx_step_kernel  acc[:n_g] (+)= ws[:n_g] @ W[c]    (row blocks past n_g exit) 2 n_g H C
                       (last chunk: dX[perm[...]] = acc, scattered back in dX's dtype; where
                       n_g leaves programs idle, each tile's columns are split over them,
                       the fused path's rule, and _dx_split_reduce_kernel adds the partials
                       in a fixed order after the last chunk: DX_SPLITS)

so the FLOPs are those of the valid rows plus less than one row block per group. The dense
path's cuBLAS steps cannot stop at a device count, hence the two Triton GEMM steps (TMA operand
loads on sm_90+, whose zero fill past n_g does the masking). Padded rows get logprobs, entropy
and lse 0, dX rows 0, and add nothing to dW and d_bias; their incoming grads are ignored.

R and C come from split_plan.rows_plan on CUDA: the three grids of a (group, chunk) step in whole
waves where the budget allows (R = 1024 rows at H = 4096 on 132 SMs: one wave of dX tiles).
Memory: acc [R, H] fp32 + xg [R, H] in the input dtype + ws [R, C] within ROWS_BYTES (60 MiB),
perm and the permuted [N] vectors.
H100, qwen3-8b bench (39% valid), the recompute mode's step (bench/results/recompute_plan_h100_*):
1.85x of the valid floor at R = 1536, C = 6656 with one dW program a tile; 1.65x at R = 1024,
C = 16896 with the persistent dW step, 58 MiB; 54.7-55.3 against 55.5-55.8 ms with the persistent
dlogits grid and the dX step's bulk reduce-add (recompute_dlogits_h100.txt).
"""
from typing import Callable, Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs import tuning as _tune
from lowerings.linear_logprobs.recompute import dense as _dense
from lowerings.linear_logprobs.recompute import dw_steps as _dws
from lowerings.linear_logprobs.recompute import plan as _split
from lowerings.linear_logprobs.recompute.dense import cdiv, size_hint
from lowerings.linear_logprobs.device import cuda_sms, grid_sms
from lowerings.linear_logprobs.fused.order import valid_rows_first
from lowerings.linear_logprobs.kernels.logits import _dlogits_kernel, _fwd_kernel
from lowerings.linear_logprobs.kernels.rows import _dx_step_kernel, _gather_rows_kernel
from lowerings.linear_logprobs.kernels.splits import _dx_split_reduce_kernel

# The dlogits workspace [R, C] of this path. H100, qwen3-8b shape, 67% valid (bench.kernels.rows
# --sweep): 16 MiB (C = 4096) 102.1 ms, 24 MiB 97.6 ms, 32 MiB 97.7 ms, peaks within 5 MiB.
WS_BYTES = 24 << 20


GROUP_M = 8       # row (or vocab) blocks a program group shares in L2 (see kernels.tiles._swizzle)
GATHER_ROWS, GATHER_H = 16, 256


def _gather(wrap, x: Tensor, perm: Tensor, count: Tensor, r0, rows, xg: Tensor) -> None:
    h = x.shape[1]
    wrap(_gather_rows_kernel)[(cdiv(rows, GATHER_ROWS), cdiv(h, GATHER_H))](
        x, perm, count, xg, r0, rows, h, x.stride(0), xg.stride(0), BLOCK_R=GATHER_ROWS,
        BLOCK_H=GATHER_H)


# On CUDA the row groups and vocab chunks follow split_plan.rows_plan: the group's fp32 dX
# accumulator [R, H], its gathered hidden rows xg [R, H] and the dlogits workspace [R, C] within
# ROWS_BYTES, which keeps the recompute mode within 64 MiB beyond the gradients (H100, qwen3-8b
# bench, 39% valid: R = 1024, C = 16896, 57 MiB).
ROWS_BYTES = 60 << 20
# The dX step hands its fp32 tile to the TMA unit (a bulk store, then bulk reduce-adds into acc)
# on every chunk but a group's last, where operands take TMA (kernels.rows._dx_step_kernel).
DX_ACC_TMA = True
# The dX step of a group whose valid rows leave programs idle (the partial group at the end of
# the valid rows) splits each tile's vocab columns over them in at most DX_SPLITS ways (the
# fused path's rule, kernels.splits._dx_splits, over the group's row slots), and
# _dx_split_reduce_kernel adds the partials in a fixed order after the group's last chunk
# (kernels.rows._dx_step_kernel); 1 turns splitting off. H100, qwen3-8b, 39% valid: that
# group's dX took 1.80 ms, a full group's time, on 48 of its 128 programs; 1.02 in 2 splits.
DX_SPLITS = 8
# Off CUDA (the interpreter tests, fake-target traces on a CPU machine: no SM count to plan for)
# the budget rule of the dense backward: a 24 MiB accumulator (R = 1536 at H = 4096) and a
# WS_BYTES workspace, C at most tuning.CHUNK_V.
ROWS_DX_GROUP_BYTES = 24 << 20


def _plan(n, h: int, v: int, itemsize: int, device: torch.device) -> tuple[int, object, int]:
    """(G, R, C): G row groups of R rows (R a whole number of row tiles; symbolic with N) and
    vocab chunks of C columns. Past tuning.MAX_ROW_GROUPS groups R grows with N (memory too), and
    C grows past tuning.MAX_STEPS (group, chunk) steps, as the dense backward's: both bound the
    unrolled loops of a compiled graph."""
    bn = max(_tune.TILES[0], _tune.step_tiles(itemsize)[0][0])   # whole row tiles of both grids
    sms = cuda_sms(device)
    if not sms:   # the dense backward's budget rule
        groups = _dense._row_groups(n, h, min(_tune.DX_GROUP_BYTES, ROWS_DX_GROUP_BYTES))
        r = cdiv(cdiv(n, groups), bn) * bn
        return groups, r, _dense._chunk_cols(v, r, groups, itemsize, _tune.TILES[1], WS_BYTES)
    r_plan, c = _split.rows_plan(v, h, itemsize, sms, ROWS_BYTES, True)
    groups = min(_tune.MAX_ROW_GROUPS, max(1, cdiv(size_hint(n), r_plan)))
    r = cdiv(cdiv(n, groups), bn) * bn
    if size_hint(r) != r_plan:   # fewer rows than the plan's, or past MAX_ROW_GROUPS: C for R
        c = _split.rows_chunk(size_hint(r), v, h, itemsize, sms,
                              ROWS_BYTES - size_hint(r) * h * (4 + itemsize))
    return groups, r, _dense.bound_cols(c, v, groups, _tune.TILES[1])


def _unpermute(perm: Tensor, row_mask: Tensor, v: Tensor) -> Tensor:
    """[N] values in permuted order -> original order, 0 at padded rows (whose permuted slots
    were never written)."""
    return torch.where(row_mask, torch.empty_like(v).scatter_(0, perm, v), 0)


def _operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], row_mask: Tensor,
              compute_dtype: Optional[torch.dtype]):
    """What forward and backward share: the operands in their common dtype and dot precision,
    TMA or not, a dense bias, and the valid-first order (perm, count)."""
    x, w, prec = _dense._prepare(hidden, weight, compute_dtype)
    bias = _dense._bias(bias, compute_dtype)
    return (x, w, prec, _dense._use_tma(x, w), bias) + valid_rows_first(row_mask)


def forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], row_mask: Tensor,
            temperature: float, fp32_lm_head: bool, with_entropy: bool,
            wrap: Callable = lambda k: k, logit_scale: float = 1.0,
            softcap: Optional[float] = None, round_logits: bool = False,
            compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), each [N] fp32, 0 at padded rows; entropy 0 unless with_entropy.
    logit_scale / softcap / round_logits / compute_dtype as in cuda.forward."""
    x, w, prec, tma, bias, perm, count = _operands(hidden, weight, bias, row_mask, compute_dtype)
    lprec = _tune.logits_precision(prec, fp32_lm_head)    # the logits' (a bf16 head, upcast)
    bn, bv, bk, warps, stages = _tune.tiles(x, lprec)
    n, h = x.shape
    v = w.shape[0]
    ids_p = ids.index_select(0, perm)                                      # [N] permuted
    groups, r, _ = _plan(n, h, v, x.element_size(), x.device)
    splits, cols = _split.fwd_split_plan(v, h, x.element_size(), bn, bv, x.device)  # invariant
    m, s, t, zt = (x.new_empty((splits, n), dtype=torch.float32) for _ in range(4))  # [S, N]
    xg = x.new_empty((r, h))                                               # [R, H]
    for g in range(groups):
        r0 = torch.sym_min(g * r, n)
        rows = torch.sym_min((g + 1) * r, n) - r0
        _gather(wrap, x, perm, count, r0, rows, xg)
        n_blocks = cdiv(rows, bn)
        wrap(_fwd_kernel)[(n_blocks * splits,)](
            xg, w, bias if bias is not None else x, ids_p, m, s, t, zt, count, rows, v, h,
            xg.stride(0), w.stride(0), *_dense._scalars(temperature, logit_scale, softcap), cols,
            n_blocks, splits, r0, n, m, m, 0, 0, HAS_BIAS=bias is not None, HAS_CAP=softcap is not None,
            ROUND=_dense.rounds(x, round_logits),
            WITH_ENTROPY=with_entropy, HAS_COUNT=True, STORE_Z=False, DOT_PREC=lprec,
            USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=_tune.GROUP_N,
            ref_ptr=m, STORE_E=False, E_HEADROOM=0.0,
            num_warps=warps, num_stages=stages)
    lp, ent, lse = _dense.combine(wrap, m, s, t, zt, ids_p, count, with_entropy)  # [N] permuted
    lp, lse = _unpermute(perm, row_mask, lp), _unpermute(perm, row_mask, lse)
    ent = _unpermute(perm, row_mask, ent) if with_entropy else torch.zeros_like(lse)
    return lp, ent, lse


def backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], row_mask: Tensor,
             lse: Tensor, entropy: Tensor, g_lp: Tensor, g_ent: Tensor, g_lse: Tensor,
             temperature: float, fp32_lm_head: bool, with_entropy: bool, need_x: bool,
             need_w: bool, need_b: bool, wrap: Callable = lambda k: k, logit_scale: float = 1.0,
             softcap: Optional[float] = None, round_logits: bool = False,
             compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dX [N, H], dW [V, H], db [V]) in the inputs' dtypes, from the valid rows only."""
    (gm, gh, gk, gwarps, gstages), dw_tiles = _tune.step_tiles(hidden.element_size())
    b_dtype = None if bias is None else bias.dtype                         # d_bias's dtype
    x, w, prec, tma, bias, perm, count = _operands(hidden, weight, bias, row_mask, compute_dtype)
    lprec = _tune.logits_precision(prec, fp32_lm_head)    # the logits' (a bf16 head, upcast)
    gprec = _tune.gradient_precision(prec, fp32_lm_head)  # dX, dW: W and xg bf16 values
    bn, bv, bk, warps, stages = _tune.tiles(x, lprec)
    n, h = x.shape
    v = w.shape[0]
    # the [N] vectors in permuted order, dense (autograd may hand in stride-0 grads)
    ids, lse, entropy, g_lp, g_ent, g_lse = (
        t.index_select(0, perm) for t in (ids, lse, entropy, g_lp, g_ent, g_lse))
    groups, r, c = _plan(n, h, v, x.element_size(), x.device)
    ws = x.new_empty((r, c))                                               # [R, C]
    xg = x.new_empty((r, h))                                               # [R, H]
    acc = x.new_empty((r, h), dtype=torch.float32) if need_x else None     # [R, H] fp32
    dx = hidden.new_zeros((n, h)) if need_x else None                      # [N, H], padded rows 0
    dw = weight.new_empty(weight.shape) if need_w else None                # [V, H]
    db = [None] * cdiv(v, c)                                        # fp32 [C'] each
    sms = grid_sms(ws.device)                                # the persistent grids' programs
    s_max = max(1, DX_SPLITS) if size_hint(r) > gm else 1  # a group of one row tile never splits
    for g in range(groups):
        r0 = torch.sym_min(g * r, n)
        rows = torch.sym_min((g + 1) * r, n) - r0
        _gather(wrap, x, perm, count, r0, rows, xg)
        n_blocks = cdiv(rows, bn)
        dbp = x.new_zeros((r // bn, c), dtype=torch.float32) if need_b else ws  # [R/BN, C]
        for ci, v0 in enumerate(range(0, v, c)):
            cols = min(c, v - v0)
            n_vtiles = cdiv(cols, bv)
            # a persistent grid (one program a SM walking the valid row blocks' tiles; see the
            # kernel; sms programs whatever N is, so a trace takes no guard on N): H100,
            # qwen3-8b bench, 39% valid: dlogits 14.1 -> 12.9 ms a step
            wrap(_dlogits_kernel)[(sms,)](
                xg, w, bias if bias is not None else x, ids, lse, entropy, g_lp, g_ent, g_lse,
                ws, dbp, count, rows, v, h, 0, r0, rows, v0, xg.stride(0), w.stride(0), c,
                *_dense._scalars(temperature, logit_scale, softcap), n_blocks, n_vtiles, sms,
                HAS_BIAS=bias is not None, HAS_CAP=softcap is not None, ROUND=_dense.rounds(x, round_logits),
                WITH_ENTROPY=with_entropy, NEED_DB=need_b, HAS_COUNT=True, DOT_PREC=lprec,
                USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=_tune.GROUP_N,
                num_warps=warps, num_stages=stages)
            if need_w:
                # a persistent grid (one program a SM walking the chunk's tiles): H100, qwen3-8b
                # bench, 39% valid: dW steps 14.7 against 19.3 ms with one program a tile
                # (bench/results/recompute_plan_h100_7424600.txt); on sm_90 the Gluon step
                # (dw_steps): a group's 1024 rows 2.17 against 2.23 ms, its 271-row tail 1.00
                # against 1.34 ms, one rounding a group (bench/results/recompute_dw_ws_h100.txt)
                _dws.launch(wrap, ws, xg, dw, count, r0, rows, v0, cols, h,
                            dw_tiles, gprec, tma, sms, GROUP_M, g > 0)
            if need_x:
                n_mblocks, n_hblocks = cdiv(rows, gm), cdiv(h, gh)
                wrap(_dx_step_kernel)[(n_mblocks * n_hblocks,)](
                    ws, w, acc, dx, perm, count, r0, rows, v0, cols, v, h, ws.stride(0),
                    w.stride(0), dx.stride(0), n_mblocks, n_hblocks, sms, ACCUMULATE=v0 > 0,
                    STORE=v0 + c >= v, DOT_PREC=gprec, USE_TMA=tma, ACC_TMA=tma and DX_ACC_TMA,
                    S_MAX=s_max, BLOCK_M=gm, BLOCK_H=gh,
                    BLOCK_K=gk, GROUP_M=GROUP_M, num_warps=gwarps, num_stages=gstages)
                if s_max > 1 and v0 + c >= v:   # the split partials' sum, scattered to dX
                    wrap(_dx_split_reduce_kernel)[(cdiv(rows, GATHER_ROWS), cdiv(h, GATHER_H))](
                        acc, dx, perm, count, r0, rows, h, dx.stride(0), n_hblocks, sms,
                        n_mblocks * gm, S_MAX=s_max, BLOCK_M=gm, BLOCK_R=GATHER_ROWS,
                        BLOCK_H=GATHER_H, scale_ptr=acc, ROW_SCALE=False)
            if need_b:
                part = dbp.sum(0).narrow(0, 0, cols)                       # [C'] fp32
                db[ci] = part if db[ci] is None else db[ci] + part
    # a fresh [0] tensor for each grad not needed: a custom op's outputs must not alias
    return (dx if need_x else hidden.new_empty(0), dw if need_w else weight.new_empty(0),
            torch.cat(db).to(b_dtype) if need_b else hidden.new_empty(0))
