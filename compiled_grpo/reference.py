"""The eager reference: materializes [.., V] logits in float32 (float64 for float64 inputs).

It defines what every faster path computes: ``reference_token_logprobs`` upcasts hidden and
weight before the GEMM (so a bf16 input's reference is its exact fp32 value), and
``reference_grpo_loss`` runs the one loss definition (``compiled_grpo.api``) on those log-probs.
Use it for tests and small shapes only: it holds B*T*V floats.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_grpo.logprobs import TokenLogprobs, _prepare, check_model_scaling


def reference_token_logprobs(hidden: Tensor, weight: Tensor, token_ids: Tensor, bias: Optional[Tensor] = None, *,
                             mask: Optional[Tensor] = None, temperature: float = 1.0, fp32_lm_head: bool = False,
                             with_entropy: bool = False, cu_seqlens: Optional[Tensor] = None,
                             logit_scale: float = 1.0, final_logit_softcapping: Optional[float] = None,
                             round_logits: bool = False, lm_head_dtype: Optional[torch.dtype] = None
                             ) -> TokenLogprobs:
    """Same contract as :func:`compiled_grpo.token_logprobs`; ``fp32_lm_head`` is implied (upcast)
    unless ``round_logits``: then the GEMM's output (and the bias sum) is rounded to the operands'
    16-bit dtype, whose autograd cast also rounds the logits gradient to it."""
    ids, valid = _prepare(hidden, weight, token_ids, bias, mask, temperature, cu_seqlens)
    if lm_head_dtype is not None and not fp32_lm_head:
        # the operands' values rounded to it, their grads not (the op returns fp32-accumulated
        # grads in the inputs' dtypes): a straight-through rounding
        def st(t):
            return None if t is None else t + (t.to(lm_head_dtype).to(t.dtype) - t).detach()
        hidden, weight, bias = st(hidden), st(weight), st(bias)
    check_model_scaling(logit_scale, final_logit_softcapping)
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    w = weight.to(dtype)  # [V, H]
    # An inf weight entry makes its logits +-inf (a banned token when -inf) and their dlogits 0:
    # d hidden = dlogits @ W then counts 0 * inf as 0 (the inf part of W is seen by value only).
    # (A host check, as this eager reference may sync; no copy of W without an inf entry.)
    if bool(torch.isinf(w).any()):
        w_fin = torch.where(torch.isinf(w), 0, w)
        logits = hidden.to(dtype) @ w_fin.T + hidden.detach().to(dtype) @ (w - w_fin).T  # [..., V]
    else:
        logits = hidden.to(dtype) @ w.T  # [..., V]
    rd = lm_head_dtype if lm_head_dtype is not None and not fp32_lm_head else \
        torch.promote_types(hidden.dtype, weight.dtype)
    rd = rd if round_logits and rd in (torch.bfloat16, torch.float16) else None
    if rd is not None:
        logits = logits.to(rd).to(dtype)
    if bias is not None:
        b = bias.to(dtype)
        if rd is not None:   # its value rounded (TRL adds a bf16 bias); db summed unrounded
            b = b + (b.to(rd).to(dtype) - b).detach()
        logits = logits + b
        if rd is not None:
            logits = logits.to(rd).to(dtype)
    logits = logits * logit_scale  # HF's order: scale, softcap, then TRL's temperature
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    logprobs = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [...]
    lse = torch.logsumexp(logits, dim=-1)  # [...]
    entropy = None
    if with_entropy:  # 0 * log 0 = 0 at banned (-inf) tokens, in the value and in the gradient
        logp_fin = torch.where(logp_all == -torch.inf, 0, logp_all)  # [..., V]
        entropy = -(logp_all.exp() * logp_fin).sum(-1)  # [...]
    if mask is not None:
        logprobs = torch.where(valid, logprobs, 0)
        entropy = None if entropy is None else torch.where(valid, entropy, 0)
        lse = torch.where(valid, lse, 0)
    return TokenLogprobs(logprobs, entropy, lse)


def reference_grpo_loss(*args, **kwargs):
    """:func:`compiled_grpo.grpo_loss` with log-probs from materialized logits (same signature)."""
    from compiled_grpo.api import _grpo_loss

    return _grpo_loss(reference_token_logprobs, *args, **kwargs)
