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

from compiled_grpo.logprobs import TokenLogprobs, _prepare


def reference_token_logprobs(hidden: Tensor, weight: Tensor, token_ids: Tensor, bias: Optional[Tensor] = None, *,
                             mask: Optional[Tensor] = None, temperature: float = 1.0, fp32_lm_head: bool = False,
                             with_entropy: bool = False, cu_seqlens: Optional[Tensor] = None) -> TokenLogprobs:
    """Same contract as :func:`compiled_grpo.token_logprobs`; ``fp32_lm_head`` is implied (upcast)."""
    ids, valid = _prepare(hidden, weight, token_ids, bias, mask, temperature, cu_seqlens)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(dtype) @ weight.to(dtype).T  # [..., V]
    if bias is not None:
        logits = logits + bias.to(dtype)
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    logprobs = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [...]
    lse = torch.logsumexp(logits, dim=-1)  # [...]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # [...]
    if mask is not None:
        logprobs = torch.where(valid, logprobs, 0)
        entropy = None if entropy is None else torch.where(valid, entropy, 0)
        lse = torch.where(valid, lse, 0)
    return TokenLogprobs(logprobs, entropy, lse)


def reference_grpo_loss(*args, **kwargs):
    """:func:`compiled_grpo.grpo_loss` with log-probs from materialized logits (same signature)."""
    from compiled_grpo.api import _grpo_loss

    return _grpo_loss(reference_token_logprobs, *args, **kwargs)
