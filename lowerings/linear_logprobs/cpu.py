"""Pure-PyTorch body of `compiled_grpo::linear_logprobs` for every non-CUDA device.

Legend: N tokens (dynamic under torch.compile), H hidden size, V vocab size (static), C vocab
chunk (CHUNK_V).

The same math as the Triton kernels, written as a Python loop over vocab chunks so that no
[N, V] tensor ever exists: the forward keeps an online (max, sum-exp, sum exp*z) per row, the
backward recomputes each chunk's logits. The loop runs over V, never over N: a Python `range`
over a SymInt would specialize N under dynamic shapes, while V is a parameter's size and static.

Precision: operands are upcast before the GEMM (float64 stays float64 for gradcheck, everything
else computes in float32). bf16/fp16 products are exact in float32, so this equals an fp32
GEMM over the upcast inputs, i.e. `fp32_lm_head=True`, whatever the flag says.
"""
from typing import Optional

import torch
from torch import Tensor

# Vocab columns per chunk: N * CHUNK_V * 4 bytes of logits live at once (64 MiB at N=4096).
# Tests lower it to exercise the multi-chunk path on tiny shapes.
CHUNK_V = 4096


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float64 if either operand is (a mixed-dtype head computes in the promoted type, as on
    CUDA), float32 otherwise."""
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _chunk_logits(x: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int,
                  temperature: float, transposed: bool = False, logit_scale: float = 1.0,
                  softcap: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(z, y) in x's (upcast) dtype, [N, C] each: a = (x @ W[v0:v1].T + b[v0:v1]) * logit_scale,
    y = tanh(a / softcap) and z = softcap * y / T (HF's order), or y = None and z = a / T
    without a softcap. The backward's chain rule takes (1 - y^2) * logit_scale from y.

    The backward asks for `transposed` (W_c @ x.T, then .T): the same values from a different
    mm, so that under torch.compile, where both op bodies land in one joint graph, CSE cannot
    merge the backward's recompute with the forward's GEMM and make the forward save every
    [N, C] chunk (N*V floats in all)."""
    w = weight[v0:v1].to(x.dtype)                                          # [C, H]
    z = (w @ x.T).T if transposed else x @ w.T                             # [N, C]
    if bias is not None:
        z = z + bias[v0:v1].to(x.dtype)
    if logit_scale != 1.0:
        z = z * logit_scale
    y = None if softcap is None else torch.tanh(z / softcap)
    return (z if y is None else softcap * y) / temperature, y


def forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
            temperature: float, with_entropy: bool, logit_scale: float = 1.0,
            softcap: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), each [N] float32 (float64 for float64 inputs).
    Logits as in _chunk_logits (logit_scale, then softcap, then temperature).

    entropy is zeros when with_entropy is False (the work is skipped)."""
    cd = _compute_dtype(hidden, weight)
    x = hidden.to(cd)                                                      # [N, H]
    n, v = hidden.shape[0], weight.shape[0]
    m = x.new_full((n,), float("-inf"))        # running max                 [N]
    s = x.new_zeros(n)                         # sum exp(z - m)              [N]
    t = x.new_zeros(n)                         # sum exp(z - m) * z          [N]
    zt = x.new_zeros(n)                        # target logit                [N]
    for v0 in range(0, v, CHUNK_V):
        v1 = min(v0 + CHUNK_V, v)
        z, _ = _chunk_logits(x, weight, bias, v0, v1, temperature, False, logit_scale,
                             softcap)                                      # [N, C]
        m_new = torch.maximum(m, z.amax(-1))                               # [N]
        # -inf logits (a banned token): a row whose columns so far are all -inf has m_new = -inf;
        # shifting by finfo.min there keeps exp(-inf - -inf) = NaN out of alpha and e
        m_sh = m_new.clamp(min=torch.finfo(cd).min)                        # [N]
        alpha = torch.exp(m - m_sh)            # exp(-inf) = 0 on the first chunk
        e = torch.exp(z - m_sh[:, None])                                   # [N, C]
        s = s * alpha + e.sum(-1)
        if with_entropy:                       # 0 * log 0 = 0: e = 0 where z = -inf
            t = t * alpha + torch.where(e > 0, e * z, 0).sum(-1)
        hit = (ids >= v0) & (ids < v1)                                     # [N]
        col = (ids - v0).clamp(0, v1 - v0 - 1)                             # [N]
        zt = zt + torch.where(hit, z.gather(1, col[:, None])[:, 0], 0.0)
        m = m_new
    lse = m + torch.log(s)                                                 # [N]
    ent = lse - t / s if with_entropy else torch.zeros_like(lse)           # [N]
    return zt - lse, ent, lse


def backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
             entropy: Tensor, g_lp: Tensor, g_ent: Tensor, g_lse: Tensor, temperature: float,
             with_entropy: bool, need_x: bool, need_w: bool, need_b: bool,
             logit_scale: float = 1.0, softcap: Optional[float] = None
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(dX [N, H], dW [V, H], db [V]) in the inputs' dtypes; [0]-shaped when not needed.

    dlogits = (g_lp * (onehot - p) + g_lse * p - g_ent * p * (log p + H)) / T, i.e.
    g_lp * onehot - p * (g_lp - g_lse + g_ent * (z - lse + H)), over T; then times
    (1 - tanh^2) with a softcap and times logit_scale (the chain rule back to x @ W.T + b)."""
    cd = _compute_dtype(hidden, weight)
    x = hidden.to(cd)                                                      # [N, H]
    v = weight.shape[0]
    lse_, a = lse.to(cd), (g_lp - g_lse).to(cd)                            # [N]
    g_lp_, g_ent_ = g_lp.to(cd), g_ent.to(cd)
    ent_ = entropy.to(cd)
    dx = x.new_zeros(x.shape) if need_x else None                          # [N, H] fp32 acc
    dw, db = [], []
    for v0 in range(0, v, CHUNK_V):
        v1 = min(v0 + CHUNK_V, v)
        z, y = _chunk_logits(x, weight, bias, v0, v1, temperature, True, logit_scale,
                             softcap)                                      # [N, C]
        logp = z - lse_[:, None]                                           # [N, C]
        p = torch.exp(logp)
        coef = a[:, None]
        if with_entropy:                       # p log p -> 0 as p -> 0: no -inf * 0 at banned tokens
            coef = coef + g_ent_[:, None] * (torch.where(p > 0, logp, 0) + ent_[:, None])
        onehot = torch.arange(v0, v1, device=ids.device)[None, :] == ids[:, None]
        dz = (torch.where(onehot, g_lp_[:, None], 0.0) - p * coef) / temperature
        if y is not None:
            dz = dz * (1 - y * y)
        if logit_scale != 1.0:
            dz = dz * logit_scale
        if need_x:   # an inf weight entry makes its logit +-inf and dz 0 there: count 0 * inf as 0
            w = weight[v0:v1].to(cd)                                       # [C, H]
            dx = dx + dz @ torch.where(torch.isinf(w), 0, w)               # [N, H]
        if need_w:
            dw.append((dz.T @ x).to(weight.dtype))                         # [C, H]
        if need_b:
            db.append(dz.sum(0).to(bias.dtype))                            # [C]
    # a fresh [0] tensor for each grad not needed: a custom op's outputs must not alias
    return (dx.to(hidden.dtype) if need_x else hidden.new_empty(0),
            torch.cat(dw) if need_w else weight.new_empty(0),
            torch.cat(db) if need_b else hidden.new_empty(0))
