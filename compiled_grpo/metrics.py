"""Detached GRPO metrics from the per-token statistics the loss already has (no second softmax).

Names follow Fast-LLM PR #494 (``metrics: none | basic | with_entropy``) plus TRL's clip ratios.
All means are token-weighted over valid tokens: sum(x * m) / max(sum(m), 1).

A note for pipeline / micro-batch accumulation: ``*_sum`` fields and ``num_tokens`` add across
partial batches, and a mean recombines as sum(mean_k * num_tokens_k) / sum(num_tokens_k). The
extrema ``max_advantage`` / ``min_advantage`` do not: summing (or averaging) partial maxima over
pipeline ranks gives a meaningless number, and a rank holding no valid token must not contribute
a 0. They are reduced with all_reduce(MAX) / all_reduce(MIN), and an empty partial batch reports
the identity of that reduction (-inf for max, +inf for min) so it drops out.

User metrics: ``@compiled_grpo.metric("name")`` registers ``fn(stats: TokenStats) -> Tensor``; it
runs only when ``"name"`` is in ``GRPOConfig.metrics``, and its detached value appears in
``GRPOMetrics.custom["name"]``.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import torch
from torch import Tensor

from compiled_grpo._registry import METRIC_LEVELS, get_metric, register_metric, registered_metrics  # noqa: F401
from compiled_grpo.loss import AdvantageStats, masked_mean


class TokenStats(NamedTuple):
    """Detached per-token statistics shared by the built-in and the user metrics. [B, T] unless noted
    ([N] for packed inputs, whatever the caller's [1, N] shape)."""

    logprobs: Tensor
    old_logprobs: Tensor          # 0 at masked positions
    log_ratio: Tensor             # clamped p - q, 0 at masked positions
    ratio: Tensor                 # exp(log_ratio)
    coef: Tensor                  # the importance weight the clip rule saw (sequence-level: broadcast)
    advantages: AdvantageStats    # .advantages broadcastable to [B, T]; .mean/.max/.min over valid tokens
    mask: Tensor                  # bool
    per_token_loss: Tensor        # 0 at masked positions
    is_low_clipped: Tensor        # bool
    is_high_clipped: Tensor       # bool
    kl_ref: Optional[Tensor]      # per-token KL to the reference, None when beta == 0
    entropy: Optional[Tensor]     # None unless entropy was computed (with_entropy or entropy_coef > 0)
    epsilon_low: float
    epsilon_high: float


class GRPOMetrics(NamedTuple):
    """0-dim detached tensors; None where not requested (kl_ref needs beta > 0)."""

    old_logprobs: Optional[Tensor] = None
    ratio_new_old: Optional[Tensor] = None
    ratio_new_old_sum: Optional[Tensor] = None
    ratio_new_old_squared_sum: Optional[Tensor] = None
    kl_new_old: Optional[Tensor] = None
    clipped_ratio_fraction: Optional[Tensor] = None
    clip_ratio_low: Optional[Tensor] = None
    clip_ratio_high: Optional[Tensor] = None
    clip_ratio: Optional[Tensor] = None
    advantage: Optional[Tensor] = None
    max_advantage: Optional[Tensor] = None
    min_advantage: Optional[Tensor] = None
    num_tokens: Optional[Tensor] = None
    kl_ref: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    # TRL 1.16's logs for its options (its names, "/" -> "_"): with sampling_per_token_logps,
    # sampling/importance_sampling_ratio/{min,mean,max} (valid tokens in token_* modes, every
    # sequence in sequence_* modes; 0 when empty) and sampling/sampling_logp_difference/{mean,max}
    # (|old - sampling| over valid tokens the sampler scored); vespo/phi_seq_mean for vespo.
    importance_sampling_ratio_min: Optional[Tensor] = None
    importance_sampling_ratio_mean: Optional[Tensor] = None
    importance_sampling_ratio_max: Optional[Tensor] = None
    sampling_logp_difference_mean: Optional[Tensor] = None
    sampling_logp_difference_max: Optional[Tensor] = None
    vespo_phi_seq_mean: Optional[Tensor] = None
    custom: Dict[str, Tensor] = {}


def metric(name: str):
    """Register ``fn(stats: TokenStats) -> Tensor`` as a metric requestable by ``name``."""
    if not isinstance(name, str) or not name or name in METRIC_LEVELS or name in GRPOMetrics._fields:
        raise ValueError(f"metric name {name!r} must be a non-empty str and not a built-in metric or level")

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"@metric({name!r}) must decorate a callable, got {type(fn).__name__}")
        register_metric(name, fn)
        return fn

    return register


def _masked_extrema_mean(x: Tensor, mask: Tensor):
    """(min, mean, max) of x over mask, each 0 when the mask is empty (TRL's convention here)."""
    n = mask.sum()
    lo = torch.where(mask, x, torch.inf).amin() if x.numel() else x.new_zeros(())
    hi = torch.where(mask, x, -torch.inf).amax() if x.numel() else x.new_zeros(())
    return (torch.where(n > 0, lo, 0.0), masked_mean(x, mask), torch.where(n > 0, hi, 0.0))


def option_metrics(mask: Tensor, old: Tensor, sampling_logprobs: Optional[Tensor], is_weight: Optional[Tensor],
                   phi_seq: Optional[Tensor]) -> dict:
    """TRL 1.16's metrics of its loss options (detached): see GRPOMetrics. ``is_weight``: the vLLM
    IS weight, [B, T] / [N] per token, or per sequence ([B, 1] / [S]); ``phi_seq``: vespo's weight
    per sequence ([B, 1] / [S])."""
    out = {}
    if sampling_logprobs is not None:
        delta = (old - sampling_logprobs).abs().detach()  # [B, T]
        scored = mask & ~torch.isnan(delta)
        _, out["sampling_logp_difference_mean"], out["sampling_logp_difference_max"] = \
            _masked_extrema_mean(torch.where(scored, delta, 0), scored)
    if is_weight is not None:
        w = is_weight.detach()
        per_seq = w.shape != mask.shape
        keys = ("importance_sampling_ratio_min", "importance_sampling_ratio_mean", "importance_sampling_ratio_max")
        out.update(zip(keys, _masked_extrema_mean(w, torch.ones_like(w, dtype=torch.bool) if per_seq else mask)))
    if phi_seq is not None:
        out["vespo_phi_seq_mean"] = phi_seq.detach().mean() if phi_seq.numel() else phi_seq.new_zeros(())
    return out


def sequence_flag_mean(flag: Tensor, mask: Tensor, segments=None, dtype=torch.float32) -> Tensor:
    """TRL 1.16's clip ratios under sequence-level IS: one flag per sequence (set if its valid
    tokens are), averaged over all sequences, empty ones included (TRL's global_masked_mean of a
    [B, 1] tensor); 0 with no sequence. flag, mask [B, T] (packed: [N] with segments)."""
    hit = (flag & mask).to(torch.float32)   # exact counts to 2^24 sequences
    per_seq = hit.sum(-1) if segments is None else segments.sum(hit)            # [S]
    return (per_seq > 0).to(dtype).sum() / max(per_seq.numel(), 1)


def compute_metrics(stats: TokenStats, level: str, custom_names: tuple, extra: Optional[dict] = None,
                    segments=None, per_sequence: bool = False) -> GRPOMetrics:
    """Built-in metrics for ``level`` ('basic' or 'with_entropy') plus the requested custom ones;
    ``extra``: option_metrics(...), reported with the basic level. ``per_sequence`` (sequence-level
    importance sampling): the clip ratios count sequences, as TRL's do (sequence_flag_mean)."""
    out = {}
    m = stats.mask
    if level in ("basic", "with_entropy"):
        dtype = stats.ratio.dtype

        def clip_mean(flag):
            if per_sequence:
                return sequence_flag_mean(flag, m, segments, dtype)
            return masked_mean(flag.to(dtype), m)
        ratio = torch.where(m, stats.ratio, 0)  # [B, T]
        coef = stats.coef
        outside = (coef < 1 - stats.epsilon_low) | (coef > 1 + stats.epsilon_high)  # [B, T]
        adv = stats.advantages
        out.update(
            old_logprobs=masked_mean(stats.old_logprobs, m),
            ratio_new_old=masked_mean(ratio, m),
            ratio_new_old_sum=ratio.sum(),
            ratio_new_old_squared_sum=(ratio * ratio).sum(),
            # k3 between old and current policy: rho - log(rho) - 1 (Fast-LLM ``kl_new_old``)
            kl_new_old=masked_mean(stats.ratio - stats.log_ratio - 1, m),
            clipped_ratio_fraction=masked_mean(outside.to(dtype), m),
            clip_ratio_low=clip_mean(stats.is_low_clipped),
            clip_ratio_high=clip_mean(stats.is_high_clipped),
            clip_ratio=clip_mean(stats.is_low_clipped | stats.is_high_clipped),
            advantage=adv.mean,
            max_advantage=adv.max,
            min_advantage=adv.min,
            num_tokens=m.sum().to(dtype),
        )
        if stats.kl_ref is not None:
            out["kl_ref"] = masked_mean(stats.kl_ref, m)
        if level == "with_entropy":
            out["entropy"] = masked_mean(stats.entropy, m)
        out.update(extra or {})
    custom = {name: get_metric(name)(stats).detach() for name in custom_names}
    return GRPOMetrics(**out, custom=custom)
