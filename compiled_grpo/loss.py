"""The GRPO loss family as pure PyTorch functions on [B, T] per-token tensors: the one definition.

Shape legend: B sequences, T completion positions, N = B*T tokens. ``mask`` is a bool [B, T].
Packed (padding-free) inputs: S sequences laid end to end in N tokens, every per-token tensor [N]
and a :class:`Segments` passed as ``segments=`` to the functions that reduce or broadcast per
sequence (``importance_ratio`` at sequence level, ``advantage_stats``, ``aggregate``); the others
are elementwise and take [N] as they take [B, T]. Without ``segments`` the padded code runs
unchanged.
Notation: p = log pi_theta(y_t) (``logprobs``), q = old log-prob, r = reference log-prob,
rho = exp(p - q), A = advantage, m = mask, L_i = sum_t m_{i,t}.

Every fast path (eager, compiled, benchmark peers built on this package) calls these functions;
``reference.py`` calls them too, with log-probs from materialized logits. Numerical guards
select *before* ``exp`` (``torch.where``), so an inf/NaN at a masked position never becomes
``inf * 0 = NaN`` in the loss or the gradient (OpenRLHF PR #1335, TRL #3015).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from compiled_grpo.segments import Segments, segments_from_cu_seqlens  # noqa: F401 (public names)


def _clamp(x: Tensor, bound: Optional[float]) -> Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * m) / max(sum(m), 1) over valid tokens, with masked entries selected away."""
    m = mask.to(x.dtype)
    return torch.where(mask, x, 0).sum() / m.sum().clamp(min=1.0)


class ImportanceRatio(NamedTuple):
    log_ratio: Tensor   # [B, T] p - q (clamped), 0 at masked positions
    log_weight: Tensor  # [B, T] token level, [B, 1] sequence level (GSPO); packed: [N] both
    ratio: Tensor       # exp(log_weight), same shape as log_weight


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, level: str = "token",
                     log_ratio_clamp: Optional[float] = 20.0,
                     segments: Optional[Segments] = None) -> ImportanceRatio:
    """rho = exp(clamp(p - q)); GSPO: rho_i = exp(clamp(sum_t m (p - q) / max(L_i, 1))).

    Equals TRL 1.16 / Liger 0.8.5 ``coef_1`` when ``log_ratio_clamp`` is None. The clamp (verl,
    NeMo-RL: +-20) applies to the token log-ratio and to the sequence log-weight. Packed
    (``segments``): the sums run over each segment and the sequence weight is broadcast back to
    its tokens, so ``log_weight`` is [N] at either level.
    """
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0)  # [B, T]
    if level == "token":
        log_ratio = _clamp(log_ratio, log_ratio_clamp)
        log_weight = log_ratio  # [B, T]
    elif segments is not None:
        lengths = segments.sum(mask.to(log_ratio.dtype)).clamp(min=1.0)  # [S]
        log_weight = _clamp(segments.sum(log_ratio) / lengths, log_ratio_clamp)  # [S]
        log_weight = segments.broadcast(log_weight)  # [N]
        log_ratio = _clamp(log_ratio, log_ratio_clamp)
    else:
        lengths = mask.sum(-1, keepdim=True).to(log_ratio.dtype).clamp(min=1.0)  # [B, 1]
        log_weight = _clamp(log_ratio.sum(-1, keepdim=True) / lengths, log_ratio_clamp)  # [B, 1]
        log_ratio = _clamp(log_ratio, log_ratio_clamp)
    return ImportanceRatio(log_ratio, log_weight, torch.exp(log_weight))


class KLPenalty(NamedTuple):
    kl: Tensor  # [B, T] per-token KL(pi_theta || pi_ref) estimate, 0 at masked positions


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, estimator: str = "k3",
               input_clamp: Optional[float] = 20.0, output_clamp: Optional[float] = 10.0) -> KLPenalty:
    """Schulman's estimators with d = clamp(r - p, +-input_clamp) (NeMo-RL ``calculate_kl``):

    k1 = -d,  k2 = d**2 / 2,  k3 = exp(d) - d - 1 (TRL/Liger's only estimator),
    then clamp(kl, +-output_clamp). With both clamps None, k3 equals Liger's ``k3_loss_fn``.
    """
    d = _clamp(torch.where(mask, ref_logprobs - logprobs, 0), input_clamp)  # [B, T]
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(d) - d - 1.0
    return KLPenalty(_clamp(kl, output_clamp))


class AdvantageStats(NamedTuple):
    advantages: Tensor  # [B, T], 0 at masked positions
    mean: Tensor        # 0-dim, over valid tokens
    max: Tensor         # 0-dim, -inf when no token is valid
    min: Tensor         # 0-dim, +inf when no token is valid


def advantage_stats(advantages: Tensor, mask: Tensor, *, segments: Optional[Segments] = None) -> AdvantageStats:
    """Broadcastable advantages plus masked mean/max/min (detached) over valid tokens.

    [B] advantages are broadcast over T (TRL's ``unsqueeze(1)``), then selected to 0 at masked
    positions, so a NaN advantage of a fully masked sequence (a zero-variance group) never enters
    the per-token loss (the masked selections downstream keep it out of the gradient too; see
    test_guards). Empty max/min are -inf/+inf, the
    identities of max/min, so per-rank values combine with all_reduce(MAX/MIN); never sum them.

    Packed (``segments``): advantages are [S] (one per sequence, broadcast to its tokens) or [N];
    a 1-D tensor of length S is read per sequence (when S == N both readings agree unless a
    sequence is empty).
    """
    if segments is not None:
        adv = segments.broadcast(advantages) if advantages.shape[0] == segments.num_sequences else advantages  # [N]
    else:
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = torch.where(mask, adv, 0)  # [B, T]
    full = adv.detach()  # [B, T]
    mean = masked_mean(full, mask)
    if full.numel() == 0:  # an empty batch: amax() of no element raises; a size check, no guard (0 is static)
        return AdvantageStats(adv, mean, full.new_full((), -torch.inf), full.new_full((), torch.inf))
    amax = torch.where(mask, full, -torch.inf).amax()
    amin = torch.where(mask, full, torch.inf).amin()
    return AdvantageStats(adv, mean, amax, amin)


class PolicyObjective(NamedTuple):
    per_token_loss: Tensor   # [B, T] or [B, 1] (sequence-level IS with [B] advantages)
    is_low_clipped: Tensor   # bool, broadcastable to [B, T]: the lower clip bound is active
    is_high_clipped: Tensor  # bool, broadcastable to [B, T]: the upper clip bound is active


def _ppo_clip(ratio, adv, logprobs, cfg) -> PolicyObjective:
    """-min(min(rho, delta) * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) (PPO; INTELLECT-2 delta)."""
    lo, hi = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
    capped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    loss = -torch.min(capped * adv, ratio.clamp(lo, hi) * adv)
    return PolicyObjective(loss, (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0))


def _cispo(ratio, adv, logprobs, cfg) -> PolicyObjective:
    """-sg(min(rho, eps_high)) * A * p: eps_high is an absolute cap (TRL/Liger form, e.g. 5.0)."""
    loss = -ratio.clamp(max=cfg.epsilon_high).detach() * adv * logprobs
    return PolicyObjective(loss, torch.zeros_like(ratio, dtype=torch.bool), (ratio > cfg.epsilon_high) & (adv > 0))


def _sapo(ratio, adv, logprobs, cfg) -> PolicyObjective:
    """-(4 / tau) * sigmoid(tau * (rho - 1)) * A, tau = tau_pos if A > 0 else tau_neg (SAPO)."""
    pos = adv > 0
    gate_pos = torch.sigmoid(cfg.sapo_temperature_pos * (ratio - 1)) * 4 / cfg.sapo_temperature_pos
    gate_neg = torch.sigmoid(cfg.sapo_temperature_neg * (ratio - 1)) * 4 / cfg.sapo_temperature_neg
    loss = -torch.where(pos, gate_pos, gate_neg) * adv
    none = torch.zeros_like(loss, dtype=torch.bool)
    return PolicyObjective(loss, none, none)


def _vespo(phi, adv, logprobs, cfg) -> PolicyObjective:
    """-phi * A * p with phi = vespo_weight(...) (detached): the gradient is -phi * A * grad p (VESPO).

    TRL 1.16 ``per_token_loss = -phi_seq * advantages * per_token_logps``; nothing is clipped."""
    loss = -phi * adv * logprobs
    none = torch.zeros_like(loss, dtype=torch.bool)
    return PolicyObjective(loss, none, none)


def _world_size() -> int:
    # TRL and Liger divide num_items_in_batch by the process count: DDP averages the gradients.
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# The normalizers (aggregate's divisor): f(mask [B, T] or [N], B (S packed; a SymInt under
# dynamic shapes: multiplied, never float()ed), one (a 0-dim 1 of the loss dtype), config,
# num_items_in_batch) -> a 0-dim divisor.
def _batch_divisor(mask, batch, one, config, num_items_in_batch):
    return one * batch                                              # B


def _dr_grpo_divisor(mask, batch, one, config, num_items_in_batch):
    return one * (batch * config.max_completion_length)            # B * max_completion_length


def _tokens_divisor(mask, batch, one, config, num_items_in_batch):
    return mask.sum().to(one.dtype).clamp(min=1.0)                  # max(local sum m, 1)


def _items_divisor(mask, batch, one, config, num_items_in_batch):
    """max(num_items_in_batch / world_size, 1); the local token count without it."""
    if num_items_in_batch is None:
        return _tokens_divisor(mask, batch, one, config, None)
    if isinstance(num_items_in_batch, torch.Tensor):
        items = num_items_in_batch.to(dtype=one.dtype, device=mask.device)
    else:  # an int: multiply (stays a SymInt once Dynamo makes it dynamic; as_tensor would guard)
        items = one * num_items_in_batch
    return (items / _world_size()).clamp(min=1.0)


class LossType(NamedTuple):
    """A loss type is a clip rule plus a normalizer, picked once from the frozen config."""

    clip_rule: Callable[..., PolicyObjective]
    per_sequence_mean: bool   # divide each sequence's token sum by max(L_i, 1) first (grpo, sapo)
    divisor: Callable[..., Tensor]   # one of the _*_divisor functions above
    gamma_weighted: bool = False  # the clip rule gets vespo_weight(...) instead of rho (vespo)


# the rule of every GRPOConfig.loss_type (config.LOSS_TYPES names them; a test checks they agree)
LOSS_RULES = {
    "grpo": LossType(_ppo_clip, True, _batch_divisor),
    "bnpo": LossType(_ppo_clip, False, _tokens_divisor),
    "dr_grpo": LossType(_ppo_clip, False, _dr_grpo_divisor),
    "dapo": LossType(_ppo_clip, False, _items_divisor),
    "cispo": LossType(_cispo, False, _items_divisor),
    "sapo": LossType(_sapo, True, _batch_divisor),
    "luspo": LossType(_ppo_clip, False, _batch_divisor),
    "vespo": LossType(_vespo, False, _items_divisor, gamma_weighted=True),
}


def policy_objective(ratio: Tensor, advantages: Tensor, logprobs: Tensor, config) -> PolicyObjective:
    """The per-token policy term of ``config.loss_type`` (before the sampling ratio and KL)."""
    return LOSS_RULES[config.loss_type].clip_rule(ratio, advantages, logprobs, config)


def _sequence_sum(x: Tensor, segments: Optional[Segments]) -> Tensor:
    """Per-sequence sum of a masked per-token x, broadcastable back: [B, T] -> [B, 1]; packed [N] -> [N]."""
    if segments is not None:
        return segments.broadcast(segments.sum(x))  # [N]
    return x.sum(-1, keepdim=True)  # [B, 1]


def sampling_importance_weight(old_logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, *, mode: str,
                               clip_min: Optional[float], clip_max: Optional[float],
                               segments: Optional[Segments] = None, per_sequence: bool = False) -> Tensor:
    """Train/inference importance weight from the sampler's log-probs s (TRL 1.16
    ``GRPOTrainer._generate_and_score_completions``, ``vllm_importance_sampling_correction``)::

        d   = nan_to_num(where(m, q - s, 0), nan=0)     # q: OLD log-probs (not the current p)
        w   = exp(d)                                     # token_*     [B, T]
        w_i = exp(sum_t d)                               # sequence_*  [B, 1] (a sum, not a mean)
        *_truncate: clamp(w, clip_min, clip_max)         *_mask: where(clip_min <= w <= clip_max, w, 0)

    A NaN s (a token the sampler could not score) gives d = 0 (no correction), as TRL. The result
    multiplies the per-token policy term like ``sampling_ratio`` (VESPO folds it into its gamma
    weight instead). Packed (``segments``): the sequence sum runs per segment, w is [N] (``per_sequence``:
    [S], one per sequence, what TRL's metrics read in sequence_* modes).
    """
    d = torch.nan_to_num(torch.where(mask, old_logprobs - sampling_logprobs, 0), nan=0.0)  # [B, T]
    if mode.startswith("sequence"):
        d = segments.sum(d) if per_sequence and segments is not None else _sequence_sum(d, segments)  # [B, 1]
    w = torch.exp(d)
    if mode.endswith("_truncate"):
        return torch.clamp(w, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return torch.where((w < lo) | (w > hi), 0.0, w)


def off_policy_mask(logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                    threshold: float, segments: Optional[Segments] = None) -> Tensor:
    """DeepSeek-V3.2 off-policy sequence masking (eq. 9; TRL 1.16 ``GRPOTrainer.get_off_policy_mask``)::

        kl_i = sum_t m nan_to_num(s - sg(p), nan=0) / max(L_i, 1)    # s: sampler (else old) log-probs
        keep = (A >= 0) | (kl_i <= threshold)                          # bool, broadcast to [B, T]

    A sequence is dropped from the policy term when its advantage is negative and it drifted
    from the sampler by more than ``threshold``. It needs the sequence's *current* log-probs p
    (detached) before any of its tokens' gradients: a sequence-coupled quantity (fused.py).
    """
    kl = torch.nan_to_num(torch.where(mask, sampling_logprobs - logprobs.detach(), 0), nan=0.0)  # [B, T]
    lengths = _sequence_sum(mask.to(kl.dtype), segments).clamp(min=1.0)  # [B, 1] ([N] packed)
    return (advantages >= 0) | (_sequence_sum(kl, segments) / lengths <= threshold)  # [B, T]


def high_entropy_mask(entropy: Tensor, mask: Tensor, *, top_quantile: float) -> Tensor:
    """Keep the top ``top_quantile`` of the batch's valid tokens by entropy ("Beyond the 80/20
    Rule"; TRL 1.16 ``GRPOTrainer.get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)``)::

        thr  = torch.quantile(entropy[m].float(), 1 - top_quantile)   # linear interpolation
        keep = (where(m, entropy.float(), 0) >= thr) & m               # bool [B, T]

    With no host sync and no data-dependent shape: masked entries sort to +inf behind the n
    valid ones, and torch.quantile's own steps (rank = q * (n - 1) in float32, gather below and
    above, lerp) run on the sorted [N] with n a tensor, so the threshold is bit-identical to
    TRL's. No valid token: all False (TRL's early return). TRL gathers the entropies of every
    data-parallel rank first; this is the caller's batch (one process: the same).
    """
    if entropy.numel() == 0:  # a static size (0 specializes under compile)
        return torch.zeros_like(mask)
    flat = torch.where(mask, entropy.detach().float(), torch.inf).reshape(-1)  # [N] fp32, as TRL's .float()
    ranked = flat.sort().values  # [N], the n valid entropies first
    n = mask.sum()
    rank = torch.full((), 1.0 - top_quantile, dtype=torch.float32, device=flat.device) * (n - 1)  # fp32 as ATen
    below = rank.to(torch.int64).clamp(min=0)  # toType(kLong) truncates, as ATen
    above = rank.ceil().to(torch.int64).clamp(min=0)
    lo, hi = ranked.gather(0, below.reshape(1)), ranked.gather(0, above.reshape(1))  # [1]
    thr = torch.lerp(lo, hi, rank - rank.to(torch.int64)).reshape(())  # 0-dim fp32
    # compared in fp32, the dtype thr was formed in: fp64 entropies against their fp32-rounded
    # quantile could drop the quantile's own token (one valid token, q = 0.5: dropped)
    return (torch.where(mask, entropy.detach().float(), 0) >= thr) & mask  # [B, T]


def vespo_weight(log_ratio: Tensor, mask: Tensor, advantages: Tensor, sampling_ratio: Optional[Tensor], config, *,
                 segments: Optional[Segments] = None) -> Tensor:
    """VESPO's gamma weight (TRL 1.16 ``GRPOTrainer.get_gamma_weights``, under no_grad: detached)::

        log w_i = clamp(sum_t m clamp(p - q, +-20) + sum_t m clamp(log sr, log 1e-8, 20), log 1e-8, 20)
        phi     = exp(lam + k log w_i - lam w_i),  (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg)
        phi     = nan_to_num(phi, nan=0, posinf=0, neginf=0)     # phi(1) = 1

    A sequence-level SUM of log-ratios (not GSPO's mean); lam is clamped to >= 1e-4; k and lam
    become default-dtype tensors as in TRL's ``torch.where(adv >= 0, k_pos, k_neg)``. ``log_ratio``
    is importance_ratio(...).log_ratio (0 at masked positions). The train/inference ratio sr
    (token-level, e.g. sampling_importance_weight in a token_* mode) enters in log space instead of
    multiplying the loss; TRL sums its log over all T, which equals the masked sum whenever a
    masked position's ratio is 1 (always, for TRL's own ratios). Returns [B, T] ([N] packed).
    """
    lower = math.log(1e-8)
    log_ratio = log_ratio.detach()
    seq = _sequence_sum(torch.where(mask, log_ratio.clamp(-20.0, 20.0), 0), segments)  # [B, 1]
    if sampling_ratio is not None:
        log_is = torch.where(mask, torch.log(sampling_ratio.detach().to(log_ratio.dtype)).clamp(lower, 20.0), 0)
        seq = seq + _sequence_sum(log_is, segments)
    log_w = seq.clamp(lower, 20.0)  # [B, 1]
    w = torch.exp(log_w)
    nonneg = advantages.detach() >= 0  # [B, T]
    k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
    lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * w  # [B, T]
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class Aggregate(NamedTuple):
    loss: Tensor     # 0-dim, value = numerator / divisor, gradient as if / grad_divisor when set
    divisor: Tensor  # 0-dim, the loss type's own divisor


def aggregate(per_token_loss: Tensor, mask: Tensor, config, num_items_in_batch=None, *,
              segments: Optional[Segments] = None) -> Aggregate:
    """Reduce the masked per-token loss [B, T] the way ``config.loss_type`` does (TRL 1.16):

    grpo, sapo     sum_i [sum_t l m / max(L_i, 1)] / B
    bnpo           sum l m / max(sum m, 1)                (local micro-batch tokens)
    dr_grpo        sum l m / (B * max_completion_length)
    dapo, cispo    sum l m / max(num_items_in_batch / world_size, 1)   (local sum m if None)
    luspo          sum l m / B   (TRL 1.16 ``(l * m).sum(-1).mean()``; Liger 0.8.5 instead divides
                   sum_{i,t} l L_i by B * T without masking l: we follow TRL)

    ``grad_divisor`` (Fast-LLM): the value keeps its divisor, the gradient is that of
    numerator / grad_divisor (value + (num/G - sg(num/G)), which adds exactly 0).

    Packed (``segments``, per_token_loss and mask [N]): B is S, the number of sequences (empty
    ones included, as padded rows with no valid token are), and L_i is a segment's valid tokens,
    so every loss type gives the padded layout's value.
    """
    kind = LOSS_RULES[config.loss_type]
    dtype = per_token_loss.dtype
    masked = torch.where(mask, per_token_loss, 0)  # [B, T]
    if kind.per_sequence_mean and segments is not None:
        lengths = segments.sum(mask.to(dtype)).clamp(min=1.0)  # [S]
        numerator = (segments.sum(masked) / lengths).sum()
    elif kind.per_sequence_mean:
        lengths = mask.sum(-1).to(dtype).clamp(min=1.0)  # [B]
        numerator = (masked.sum(-1) / lengths).sum()
    else:
        numerator = masked.sum()
    one = torch.ones((), dtype=dtype, device=mask.device)
    # B (S packed): a SymInt under dynamic shapes: multiply, never float() it (would specialize)
    batch = mask.shape[0] if segments is None else segments.num_sequences
    if isinstance(batch, int):  # B = 0, an empty batch: 0 / 1, not 0 / 0 (a SymInt B is never 0: 0 specializes)
        batch = max(batch, 1)
    divisor = kind.divisor(mask, batch, one, config, num_items_in_batch)
    loss = numerator / divisor
    if config.grad_divisor is not None:
        scaled = numerator / config.grad_divisor
        loss = loss.detach() + (scaled - scaled.detach())
    return Aggregate(loss, divisor)
