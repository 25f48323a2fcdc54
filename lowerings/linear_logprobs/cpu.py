"""Pure-PyTorch body of `compiled_grpo::linear_logprobs` for every non-CUDA device.

Legend: N tokens (dynamic under torch.compile), H hidden size, V vocab size (static), C vocab
chunk (CHUNK_V), G row groups of R = cdiv(N, G) rows.

The same math as the Triton kernels, written as Python loops over row groups and vocab chunks
so that no [N, V] tensor ever exists: the forward keeps an online (max, sum-exp, sum exp*z) per
row, the backward recomputes each [R, C] tile of logits. The workspace is a few [R, C] tiles,
bounded by WS_BYTES each whatever N. N=4096, H=256, V=65536 fp32 (4 groups of 1024 rows),
grpo_loss (beta 0.04, entropy metrics) forward+backward, peak RSS beyond inputs and grads
(VmHWM): eager 136 MiB, was 524 MiB with [N, C] tiles; compiled 92 MiB, or 236 MiB with that
config, whose compiled forward has a 256 MiB transient the [N, C] body shows too (not the
op's tiles: the op alone compiled peaks at 64 MiB forward). No loop runs over N itself: a Python `range` over a SymInt would specialize it under
dynamic shapes. G is a Python int from N's size hint (as recompute/dense.py's `_row_groups`), each group's
bounds are `torch.sym_min` expressions and its rows a `narrow`, so a graph compiled for dynamic N
serves every N (its workspace then scales as N / G).

Edge cases (docs/errors-and-edge-cases.md): N = 0 gives [0] outputs and zero grads; a -inf logit (a bias
of -inf banning a token, or a weight row whose logit is or overflows to -inf) has p = 0 and
contributes 0 * log 0 = 0 to the entropy and nothing to any gradient.

Batch invariance: a row's log-prob, entropy and lse are bitwise independent of the rows around
it (N, position, groups): the logits come from fixed-shape block products (_rows_mm), every
reduction is per row over the same vocab chunks in the same order, and the op calls the forward
as an opaque custom op (op.py), so torch.compile runs these same eager kernels rather than
regenerating the exp / sum loops.

Precision: operands are upcast before the GEMM (float64 if either operand is float64, for
gradcheck; everything else computes in float32). bf16/fp16 products are exact in float32, so
this equals an fp32 GEMM over the upcast inputs, i.e. `fp32_lm_head=True`, whatever the flag
says. dW and db accumulate over row groups in that dtype and are rounded once.
"""
from typing import Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs.device import size_hint

# Vocab columns per chunk. Tests lower it to exercise the multi-chunk path on tiny shapes.
CHUNK_V = 4096
# Bytes of one [R, C] tile (logits, probabilities, dlogits): R = WS_BYTES / (C * 4) rows a group
# (1024 at C=4096, fp32). About five tiles live at once in the backward, so ~80 MiB in all.
WS_BYTES = 16 << 20
# Bound on the groups, i.e. on the unrolled loop bodies of a compiled graph (G * cdiv(V, C)).
MAX_ROW_GROUPS = 64
# The forward's logits GEMM runs as a batch of [ROW_BLOCK, H] @ [H, C] products (rows padded to
# a whole block): the BLAS kernel, and so a row's bits, then depend on the shape alone, not on
# how many rows came with it (a plain mm picks other kernels for a few rows).
ROW_BLOCK = 16


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float64 if either operand is (a mixed-dtype head computes in the promoted type, as on
    CUDA), float32 otherwise."""
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _row_spans(n, v: int, dtype: torch.dtype) -> list:
    """[(r0, rows)] of G groups covering rows [0, N): G from N's size hint so that one [R, C]
    tile fits WS_BYTES; r0 and rows are `sym_min` expressions of a symbolic N (some groups may
    be empty when N is smaller than the hint), plain ints otherwise."""
    c = min(CHUNK_V, v)
    elem = torch.finfo(dtype).bits // 8
    groups = min(MAX_ROW_GROUPS, max(1, -(-size_hint(n) * c * elem // WS_BYTES)))
    if groups == 1:
        return [(0, n)]
    r = (n + groups - 1) // groups
    lo = min if isinstance(n, int) else torch.sym_min
    bounds = [lo(g * r, n) for g in range(groups + 1)]
    return [(bounds[g], bounds[g + 1] - bounds[g]) for g in range(groups)]


def _row_blocks(x: Tensor) -> Tensor:
    """x [R, H] zero-padded to whole ROW_BLOCK-row blocks, [R' / ROW_BLOCK, ROW_BLOCK, H]: made
    once a row group, then multiplied by every vocab chunk (_rows_mm)."""
    r, h = x.shape
    blocks = (r + ROW_BLOCK - 1) // ROW_BLOCK
    return torch.nn.functional.pad(x, (0, 0, 0, blocks * ROW_BLOCK - r)).view(blocks, ROW_BLOCK, h)


def _rows_mm(xb: Tensor, r: int, w: Tensor) -> Tensor:
    """x @ w.T [R, C] for xb = _row_blocks(x), w [C, H], each row from the same fixed-shape
    product: batch invariance of the forward (a row's logits do not depend on R)."""
    blocks, rb, h = xb.shape
    z = torch.bmm(xb, w.T.expand(blocks, h, w.shape[0]))                   # [R'/RB, RB, C]
    return z.view(blocks * rb, w.shape[0]).narrow(0, 0, r)                 # [R, C]


def operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
             compute_dtype: Optional[torch.dtype]) -> tuple:
    """hidden, weight, bias in compute_dtype (the dtype the head multiplies in; None: as they
    are). The body then upcasts them (exact), so a 16-bit compute_dtype makes the products
    those of the rounded operands, as a 16-bit GEMM's; the grads keep the inputs' dtypes."""
    if compute_dtype is None:
        return hidden, weight, bias
    return (hidden.to(compute_dtype), weight.to(compute_dtype),
            None if bias is None else bias.to(compute_dtype))


def round_dtype(hidden: Tensor, weight: Tensor, round_logits: bool) -> Optional[torch.dtype]:
    """The dtype round_logits rounds the GEMM's output (and the logits gradient) to: the
    operands' common dtype when it is 16-bit (bf16 / fp16), else None (nothing to round)."""
    dt = torch.promote_types(hidden.dtype, weight.dtype)
    return dt if round_logits and dt in (torch.bfloat16, torch.float16) else None


def _chunk_logits(x: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int,
                  temperature: float, transposed: bool = False, logit_scale: float = 1.0,
                  softcap: Optional[float] = None, rd: Optional[torch.dtype] = None,
                  xb: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(z, y) in x's (upcast) dtype, [R, C] each: a = (x @ W[v0:v1].T + b[v0:v1]) * logit_scale,
    y = tanh(a / softcap) and z = softcap * y / T (HF's order), or y = None and z = a / T
    without a softcap. The backward's chain rule takes (1 - y^2) * logit_scale from y.
    rd (round_logits): x @ W.T rounded to rd, then rd(that + rd(b)), as the Triton kernels'
    ROUND and TRL's head under autocast (a bf16 GEMM output and a bf16 bias add).

    The backward asks for `transposed` (W_c @ x.T, then .T): the same values from a different
    mm, so that under torch.compile, where both op bodies land in one joint graph, CSE cannot
    merge the backward's recompute with the forward's GEMM and make the forward save every
    [R, C] tile (N*V floats in all). The forward passes xb, x in row blocks (_row_blocks)."""
    w = weight[v0:v1].to(x.dtype)                                          # [C, H]
    if transposed:
        z = (w @ x.T).T                                                    # [R, C]
    else:
        z = _rows_mm(_row_blocks(x) if xb is None else xb, x.shape[0], w)  # [R, C]
    if rd is not None:
        z = z.to(rd).to(x.dtype)
    if bias is not None:
        b = bias[v0:v1]
        z = z + (b.to(rd) if rd is not None else b).to(x.dtype)
        if rd is not None:
            z = z.to(rd).to(x.dtype)
    return scale_logits(z, temperature, logit_scale, softcap)


def scale_logits(a: Tensor, temperature: float, logit_scale: float = 1.0,
                 softcap: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(z, y) of GEMM outputs a (plus bias): a * logit_scale, y = tanh(that / softcap) and
    z = softcap * y / T (HF's order), or y = None and z = a * logit_scale / T. The one
    definition of the scale, cap and temperature on this path (the extrema op's too)."""
    if logit_scale != 1.0:
        a = a * logit_scale
    y = None if softcap is None else torch.tanh(a / softcap)
    return (a if y is None else softcap * y) / temperature, y


def _forward_rows(x: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
                  temperature: float, with_entropy: bool, z_out: Optional[Tensor] = None,
                  **scaling) -> tuple[Tensor, Tensor, Tensor]:
    """(target logit, entropy or zeros, lse) of one row group: x [R, H] upcast, ids [R].
    z_out [R, V]: also keep the logits there (the fused-gradient body, fused/schedule.py)."""
    r, v = x.shape[0], weight.shape[0]
    tiny = torch.finfo(x.dtype).min
    m = x.new_full((r,), float("-inf"))        # running max                 [R]
    s = x.new_zeros(r)                         # sum exp(z - m)              [R]
    t = x.new_zeros(r)                         # sum exp(z - m) * z          [R]
    zt = x.new_zeros(r)                        # target logit                [R]
    xb = _row_blocks(x)                        # padded once, used by every chunk's GEMM
    for v0 in range(0, v, CHUNK_V):
        v1 = min(v0 + CHUNK_V, v)
        z, _ = _chunk_logits(x, weight, bias, v0, v1, temperature, xb=xb, **scaling)  # [R, C]
        if z_out is not None:
            z_out[:, v0:v1].copy_(z)
        m_new = torch.maximum(m, z.amax(-1))                               # [R]
        # -inf logits (a banned token): a row whose columns so far are all -inf has m_new = -inf;
        # shifting by finfo.min there keeps exp(-inf - -inf) = NaN out of alpha and e
        m_sh = m_new.clamp(min=tiny)                                       # [R]
        alpha = torch.exp(m - m_sh)            # exp(-inf) = 0 on the first chunk
        e = torch.exp(z - m_sh[:, None])                                   # [R, C]
        s = s * alpha + e.sum(-1)
        if with_entropy:                       # 0 * log 0 = 0: e = 0 where z = -inf
            t = t * alpha + torch.where(e > 0, e * z, 0).sum(-1)
        hit = (ids >= v0) & (ids < v1)                                     # [R]
        col = (ids - v0).clamp(0, v1 - v0 - 1)                             # [R]
        zt = zt + torch.where(hit, z.gather(1, col[:, None])[:, 0], 0.0)
        m = m_new
    lse = m + torch.log(s)                                                 # [R]
    ent = lse - t / s if with_entropy else torch.zeros_like(lse)           # [R]
    return zt, ent, lse


def forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
            temperature: float, with_entropy: bool, logit_scale: float = 1.0,
            softcap: Optional[float] = None, round_logits: bool = False,
            compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), each [N] float32 (float64 for float64 inputs).
    Logits as in _chunk_logits (logit_scale, then softcap, then temperature).

    entropy is zeros when with_entropy is False (the work is skipped)."""
    hidden, weight, bias = operands(hidden, weight, bias, compute_dtype)
    cd = _compute_dtype(hidden, weight)
    n = hidden.shape[0]
    groups = _row_spans(n, weight.shape[0], cd)
    scaling = dict(logit_scale=logit_scale, softcap=softcap,
                   rd=round_dtype(hidden, weight, round_logits))
    if len(groups) == 1:
        zt, ent, lse = _forward_rows(hidden.to(cd), weight, ids, bias, temperature, with_entropy,
                                     **scaling)
        return zt - lse, ent, lse
    lp, ent, lse = (hidden.new_empty(n, dtype=cd) for _ in range(3))      # [N]
    for r0, rows in groups:
        zt_g, ent_g, lse_g = _forward_rows(hidden.narrow(0, r0, rows).to(cd), weight,
                                           ids.narrow(0, r0, rows), bias, temperature,
                                           with_entropy, **scaling)
        lp.narrow(0, r0, rows).copy_(zt_g - lse_g)
        ent.narrow(0, r0, rows).copy_(ent_g)
        lse.narrow(0, r0, rows).copy_(lse_g)
    return lp, ent, lse


def dlogits(z: Tensor, y: Optional[Tensor], lse: Tensor, ent: Tensor, g_lp: Tensor, g_ent: Tensor,
            g_lse: Tensor, ids: Tensor, cols: Tensor, temperature: float, with_entropy: bool,
            logit_scale: float) -> Tensor:
    """dL/da [R, C] for logits z [R, C] of columns ``cols`` (y = tanh(a s / c) with a softcap,
    else None) and per-row lse, entropy, incoming grads and target ids [R]:
    (g_lp * onehot - p * (g_lp - g_lse + g_ent * (log p + H))) / T, times (1 - y^2) with a
    softcap and times logit_scale. Shared by the recompute backward and the fused path."""
    logp = z - lse[:, None]                                                # [R, C]
    p = torch.exp(logp)
    coef = (g_lp - g_lse)[:, None]
    if with_entropy:                   # p log p -> 0 as p -> 0: no -inf * 0 at banned tokens
        coef = coef + g_ent[:, None] * (torch.where(p > 0, logp, 0) + ent[:, None])
    onehot = cols[None, :] == ids[:, None]                                 # [R, C]
    dz = (torch.where(onehot, g_lp[:, None], 0.0) - p * coef) / temperature
    if y is not None:
        dz = dz * (1 - y * y)
    if logit_scale != 1.0:
        dz = dz * logit_scale
    return dz


def backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
             entropy: Tensor, g_lp: Tensor, g_ent: Tensor, g_lse: Tensor, temperature: float,
             with_entropy: bool, need_x: bool, need_w: bool, need_b: bool,
             logit_scale: float = 1.0, softcap: Optional[float] = None,
             row_mask: Optional[Tensor] = None, round_logits: bool = False,
             compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dX [N, H], dW [V, H], db [V]) in the inputs' dtypes; [0]-shaped when not needed.

    row_mask [N] bool: padded rows (False) have dlogits 0, whatever their hidden state. Their
    saved lse is 0, so exp(z - lse) of a garbage row overflows to inf, and inf times its zero
    incoming grad is NaN: the rule of every body (the CUDA row path skips such rows, the fused
    blocks zero them) is that a padded row's dlogits are never formed into a gradient.

    dlogits = (g_lp * (onehot - p) + g_lse * p - g_ent * p * (log p + H)) / T, i.e.
    g_lp * onehot - p * (g_lp - g_lse + g_ent * (z - lse + H)), over T; then times
    (1 - tanh^2) with a softcap and times logit_scale (the chain rule back to x @ W.T + b).
    Vocab chunks outside, row groups inside: a chunk's dW / db rows are summed over the groups
    in place (in dW itself when it has the compute dtype, else in a [C, H] buffer rounded once)
    and the dX accumulator [N, H] takes each group's rows in place."""
    out_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    hidden, weight, bias = operands(hidden, weight, bias, compute_dtype)
    cd = _compute_dtype(hidden, weight)
    rd = round_dtype(hidden, weight, round_logits)   # the logits and their gradient rounded to it
    n, v = hidden.shape[0], weight.shape[0]
    groups = _row_spans(n, v, cd)
    g_lse_, g_lp_, g_ent_ = g_lse.to(cd), g_lp.to(cd), g_ent.to(cd)        # [N]
    lse_, ent_ = lse.to(cd), entropy.to(cd)                                # [N]
    dx = hidden.new_zeros(hidden.shape, dtype=cd) if need_x else None      # [N, H] acc
    dw = weight.new_empty(weight.shape, dtype=out_dtypes[1]) if need_w else None  # [V, H]
    db = weight.new_zeros(v, dtype=cd) if need_b else None                 # [V]
    for v0 in range(0, v, CHUNK_V):
        v1 = min(v0 + CHUNK_V, v)
        w = weight[v0:v1].to(cd)                                           # [C, H]
        # an inf weight entry makes its logit +-inf and dz 0 there: count 0 * inf as 0 in dX
        w_fin = torch.where(torch.isinf(w), 0, w) if need_x else None
        dw_c = None
        if need_w:                                                         # [C, H]
            dw_c = dw[v0:v1].zero_() if dw.dtype == cd else w.new_zeros(w.shape)
        cols = torch.arange(v0, v1, device=ids.device)                     # [C]
        for r0, rows in groups:
            one = len(groups) == 1
            rs = (lambda t: t) if one else (lambda t: t.narrow(0, r0, rows))  # noqa: E731
            lse_g = rs(lse_)                                               # [R]
            x = rs(hidden).to(cd)                                          # [R, H]
            z, y = _chunk_logits(x, weight, bias, v0, v1, temperature, True, logit_scale,
                                 softcap, rd)                              # [R, C]
            dz = dlogits(z, y, lse_g, rs(ent_), rs(g_lp_), rs(g_ent_), rs(g_lse_), rs(ids),
                         cols, temperature, with_entropy, logit_scale)     # [R, C]
            if rd is not None:   # as the Triton workspace (and TRL's tile): in the 16-bit dtype
                dz = dz.to(rd).to(cd)
            if row_mask is not None:
                dz = torch.where(rs(row_mask)[:, None], dz, 0)
            if need_x:
                rs(dx).addmm_(dz, w_fin)                                   # [R, H]
            if need_w:
                dw_c.addmm_(dz.T, x)                                       # [C, H]
            if need_b:
                db[v0:v1].add_(dz.sum(0))                                  # [C]
        if need_w and dw.dtype != cd:
            dw[v0:v1].copy_(dw_c)
    # a fresh [0] tensor for each grad not needed: a custom op's outputs must not alias
    return (dx.to(out_dtypes[0]) if need_x else hidden.new_empty(0, dtype=out_dtypes[0]),
            dw if need_w else weight.new_empty(0, dtype=out_dtypes[1]),
            db.to(out_dtypes[2]) if need_b else hidden.new_empty(0, dtype=out_dtypes[0]))
