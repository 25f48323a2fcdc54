"""The per-token GRPO loss of a config: the one composition of loss.py's functions, used by
grpo_loss (api.py) on the whole batch and by the fused-gradient mode (fused_grads.py) per row
block, so the two cannot differ and neither calls back into the other.

Legend: B sequences, T positions (packed inputs: [N] with Segments).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compiled_grpo.loss import (LOSS_RULES, importance_ratio, kl_penalty, off_policy_mask, policy_objective,
                                sampling_importance_weight, vespo_weight)


class PerTokenLoss(NamedTuple):
    per_token: Tensor   # [B, T], 0 at masked positions: policy term * sampling_ratio + beta * KL
    old: Tensor         # [B, T] old log-probs (sg(p) on-policy)
    rho: object         # ImportanceRatio
    pol: object         # PolicyObjective
    kl: Optional[Tensor]
    is_weight: Optional[Tensor]  # the train/inference weight applied (sampling_ratio or from the sampler's log-probs)
    gamma: Optional[Tensor]      # vespo's phi [B, T], else None


def sampling_weight(old, sampling_logprobs, valid, cfg, segments=None) -> Tensor:
    """sampling_importance_weight of ``cfg``'s vLLM IS options: [B, T] token_*, [B, 1] sequence_*."""
    return sampling_importance_weight(old, sampling_logprobs.to(old.dtype), valid,
                                      mode=cfg.vllm_importance_sampling_mode,
                                      clip_min=cfg.vllm_importance_sampling_clip_min,
                                      clip_max=cfg.vllm_importance_sampling_clip_max, segments=segments)


def per_token_loss(logp, old_logprobs, valid, advantages, sampling_ratio, ref_logprobs, cfg,
                   segments=None, sampling_logprobs=None, entropy_keep=None) -> PerTokenLoss:
    """The per-token loss of ``cfg`` from the log-probs (the one composition of loss.py's
    functions; the fused path differentiates it per row block, compiled_grpo/fused.py).
    ``advantages``: advantage_stats(...).advantages (broadcast, 0 at masked positions).
    ``sampling_logprobs``: the sampler's log-probs; the IS weight is formed from them here only
    when ``sampling_ratio`` is None (grpo_loss forms it once beforehand when old log-probs are
    given: it depends on inputs only). ``entropy_keep``: high_entropy_mask(...) or None."""
    dtype = logp.dtype
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)  # [B, T]
    if sampling_ratio is None and sampling_logprobs is not None and cfg.vllm_importance_sampling_correction:
        sampling_ratio = sampling_weight(old, sampling_logprobs, valid, cfg, segments)  # [B, T] or [B, 1]
    rho = importance_ratio(logp, old, valid, level=cfg.importance_sampling_level,
                           log_ratio_clamp=cfg.log_ratio_clamp, segments=segments)
    gamma, factor = None, sampling_ratio
    if LOSS_RULES[cfg.loss_type].gamma_weighted:  # VESPO: the IS weight goes into phi, not a factor
        gamma = vespo_weight(rho.log_ratio, valid, advantages, sampling_ratio, cfg, segments=segments)  # [B, T]
        factor = None
    pol = policy_objective(rho.ratio if gamma is None else gamma, advantages, logp, cfg)
    per_token = pol.per_token_loss  # [B, T] or [B, 1]
    keep = entropy_keep  # bool [B, T] or None
    if cfg.off_policy_mask_threshold is not None:
        seq_keep = off_policy_mask(logp, old if sampling_logprobs is None else sampling_logprobs.to(dtype), advantages,
                                   valid, threshold=cfg.off_policy_mask_threshold, segments=segments)  # [B, T]
        keep = seq_keep if keep is None else keep & seq_keep
    if keep is not None:  # TRL multiplies by the 0/1 mask; a select is the same on finite values
        per_token = torch.where(keep, per_token, 0)  # [B, T]
    if factor is not None:
        per_token = per_token * torch.where(valid, factor.to(dtype), 0)  # [B, T]
    kl = None
    if cfg.beta != 0.0:
        kl = kl_penalty(logp, ref_logprobs.to(dtype), valid, estimator=cfg.kl_estimator,
                        input_clamp=cfg.kl_input_clamp, output_clamp=cfg.kl_output_clamp).kl  # [B, T]
        if cfg.use_bias_correction_kl:  # DeepSeek-V3.2: KL * rho (un-delta'd ratio, as TRL/Liger)
            kl = kl * rho.ratio
        per_token = per_token + cfg.beta * kl
    per_token = torch.where(valid, per_token, 0)  # [B, T]
    return PerTokenLoss(per_token, old, rho, pol, kl, sampling_ratio, gamma)
