"""The bench's own DAPO loss math ("TRL-style user code", deliberately not compiled_grpo's) and the
step helpers that bench/providers.py and bench/peers.py share.

Legend: B sequences, T tokens, H hidden, V vocab, N = B*T.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Optional

import torch

from bench.shapes import StepInputs, cap_logits


@dataclasses.dataclass(frozen=True)
class Params:
    """The loss configuration every provider is given: DAPO with a k3 KL term to the reference;
    importance_sampling_level "sequence" (`--gspo`): GSPO's sequence-level ratio (TRL 1.16
    importance_sampling_level="sequence") with the same clip, KL and DAPO normalizer."""
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    importance_sampling_level: str = "token"


def naive_logprobs(hidden, weight, token_ids, temperature: float, softcap: Optional[float] = None):
    """Per-token log-probs the way RL trainers write it: full logits, log_softmax, gather.

    Holds [B, T, V] bf16 logits, their fp32 copy and the fp32 log_softmax (and as many again in
    backward): 10 bytes per logit forward, the memory the fused providers avoid.
    """
    return _naive_logprobs_of(hidden @ weight.T, token_ids, temperature, softcap)  # [B, T, V] bf16 logits


def _naive_logprobs_of(logits, token_ids, temperature: float, softcap: Optional[float]):
    logits = cap_logits(logits.float(), softcap) / temperature  # [B, T, V] fp32 (HF: cap, then T)
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B, T]


def dapo_per_token(logp, old_logp, ref_logp, advantages, p: Params, log_weight=None):
    """TRL 1.16 `_compute_loss`, loss_type="dapo", token-level IS, k3 KL; no clamps.

    coef = exp(logp - old); loss_t = -min(coef*A, clip(coef, 1-eps_low, 1+eps_high)*A)
                                     + beta * (exp(ref - logp) - (ref - logp) - 1)
    log_weight (sequence level, sequence_log_weight): coef = exp(log_weight) instead.
    """
    coef_1 = torch.exp(logp - old_logp if log_weight is None else log_weight)  # [B, T] or [B, 1]
    coef_2 = torch.clamp(coef_1, 1 - p.epsilon_low, 1 + p.epsilon_high)  # [B, T]
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [B, 1] or per token [B, T]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)  # [B, T]
    if p.beta != 0.0:
        d = ref_logp - logp  # [B, T]
        per_token = per_token + p.beta * (torch.exp(d) - d - 1)
    return per_token


def sequence_log_weight(logp, old_logp, mask, seq=None, num_seq: int = 0):
    """TRL 1.16 GSPO: log w_i = sum_t m (logp - old) / max(sum_t m, 1) per sequence: over the rows
    of [B, T] ([B, 1]), or over the sequence ids seq [N] of compacted tokens [1, N] (index_add:
    the bench's user code, not compiled_grpo's), broadcast back to them ([1, N])."""
    log_ratio = torch.where(mask > 0, logp - old_logp, 0)
    if seq is None:
        return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    total = log_ratio.new_zeros(num_seq).index_add(0, seq, log_ratio[0])           # [S]
    count = log_ratio.new_zeros(num_seq).index_add(0, seq, mask[0].to(log_ratio.dtype))
    return (total / count.clamp(min=1.0)).index_select(0, seq)[None]               # [1, N]


def dapo_loss(logp, old_logp, ref_logp, advantages, mask, p: Params, seq=None, num_seq: int = 0):
    """DAPO normalizer: sum over all completion tokens / their count (one process)."""
    log_weight = (sequence_log_weight(logp, old_logp, mask, seq, num_seq)
                  if p.importance_sampling_level == "sequence" else None)
    per_token = dapo_per_token(logp, old_logp, ref_logp, advantages, p, log_weight)  # [B, T]
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def naive_loss(hidden, weight, token_ids, advantages, mask, old_logp, ref_logp, p: Params,
               softcap: Optional[float] = None):
    logp = naive_logprobs(hidden, weight, token_ids, p.temperature, softcap)  # [B, T] fp32
    return dapo_loss(logp, old_logp, ref_logp, advantages, mask, p)


def naive_loss_with_logit_metrics(hidden, weight, token_ids, advantages, mask, old_logp, ref_logp,
                                  p: Params, softcap: Optional[float] = None):
    """naive_loss, and the masked means of each token's least and greatest raw logit, as
    trainers log them (under no_grad): (loss, max metric, min metric)."""
    logits = hidden @ weight.T  # [B, T, V] bf16
    with torch.no_grad():
        kept, count = mask > 0, mask.sum().clamp(min=1.0)
        top = torch.where(kept, logits.amax(-1).float(), 0.0).sum() / count
        low = torch.where(kept, logits.amin(-1).float(), 0.0).sum() / count
    logp = _naive_logprobs_of(logits, token_ids, p.temperature, softcap)
    return dapo_loss(logp, old_logp, ref_logp, advantages, mask, p), top, low


def _import(name: str):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # ImportError, or a package that fails at import on this machine
        return None, f"{name} not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def _resetting() -> contextlib.AbstractContextManager:
    """Fresh Dynamo state around a provider: each compiles its own static-shape graph, as a fresh
    process would, and no recompile-limit or dynamic-shape decision leaks across shapes."""
    @contextlib.contextmanager
    def cm():
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()
    return cm()


def _args(x: StepInputs):
    """The padded [B, T] argument list. A packed batch is one sequence [1, N] of its tokens with
    per-token advantages: the same DAPO loss (per-token terms, one normalizer over all tokens), so
    the per-token providers (naive, CCE) run on exactly the packed tokens."""
    if not x.packed:
        return (x.hidden, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs)
    return (x.hidden.unsqueeze(0), x.weight, x.token_ids[None], x.token_advantages[None], x.mask[None],
            x.old_logprobs[None], x.ref_logprobs[None])


@dataclasses.dataclass
class _Valid:
    """The valid tokens, compacted outside the op: rows (None: all rows are valid, packed input)
    indexes the flattened [B*T] positions; the per-token tensors are already compacted [N_valid]
    (no grad flows to them). hidden(x) gathers the differentiable rows inside the step, so the
    backward's scatter of dX into [B, T, H] is part of the timed work."""
    rows: Optional[torch.Tensor]  # [N_valid] int64
    token_ids: torch.Tensor  # [N_valid]
    advantages: torch.Tensor  # [N_valid] fp32
    old_logprobs: torch.Tensor  # [N_valid]
    ref_logprobs: torch.Tensor  # [N_valid]
    ones: torch.Tensor  # [N_valid] fp32, the all-valid mask
    seq: torch.Tensor  # [N_valid] int64, each token's sequence (the GSPO sums)
    num_seq: int  # S

    def hidden(self, x: StepInputs) -> torch.Tensor:  # [N_valid, H]
        h = x.hidden.view(-1, x.hidden.shape[-1])
        return h if self.rows is None else h.index_select(0, self.rows)


def compact(x: StepInputs) -> _Valid:
    """hidden[mask], ids[mask], ... with the index computed once here (one host sync, outside the
    timed step: how TRL's trainer and padding-free pipelines hand tokens to a fused head)."""
    if x.packed:
        pos = torch.arange(x.token_ids.shape[0], device=x.cu_seqlens.device)
        seq = torch.searchsorted(x.cu_seqlens.long(), pos, right=True) - 1         # [N]
        return _Valid(None, x.token_ids, x.token_advantages, x.old_logprobs, x.ref_logprobs, x.mask,
                      seq, x.cu_seqlens.shape[0] - 1)
    rows = x.mask.reshape(-1).nonzero().squeeze(1)  # [N_valid]
    adv = x.advantages[:, None].expand_as(x.mask).reshape(-1)
    return _Valid(rows, x.token_ids.reshape(-1)[rows], adv[rows], x.old_logprobs.reshape(-1)[rows],
                  x.ref_logprobs.reshape(-1)[rows], torch.ones_like(rows, dtype=torch.float32),
                  rows // x.mask.shape[1], x.mask.shape[0])


def _valid_dapo(logp: torch.Tensor, v: _Valid, p: Params) -> torch.Tensor:
    """The bench's DAPO math (dapo_loss) on compacted per-token log-probs [N_valid]."""
    return dapo_loss(logp[None], v.old_logprobs[None], v.ref_logprobs[None], v.advantages[None], v.ones[None], p,
                     v.seq, v.num_seq)
