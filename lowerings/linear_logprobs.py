"""TEMPORARY placeholder (materializes logits); replaced by the fused op. Contract only."""
from typing import NamedTuple, Optional

import torch


class LinearLogprobs(NamedTuple):
    logprobs: torch.Tensor            # [...] fp32
    entropy: Optional[torch.Tensor]   # [...] fp32 or None
    lse: torch.Tensor                 # [...] fp32


def linear_logprobs(hidden, weight, ids, bias=None, *, temperature=1.0, fp32_lm_head=False,
                    with_entropy=False) -> LinearLogprobs:
    lead = ids.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (h.to(dt) @ weight.to(dt).T) if fp32_lm_head else (h @ weight.T).to(dt)
    if bias is not None:
        logits = logits + bias.to(dt)
    logits = logits / temperature
    lse = logits.logsumexp(-1)
    lp = logits.gather(-1, ids.reshape(-1, 1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        ent = lse - (logits.softmax(-1) * logits).sum(-1)
        ent = ent.view(lead)
    return LinearLogprobs(lp.view(lead), ent, lse.view(lead))
