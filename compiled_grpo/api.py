"""grpo_loss: the GRPO loss family from hidden states and the lm_head weight, logits never stored.

Shape legend: B sequences, T completion positions, H hidden size, V vocab size.

Composition order (Liger 0.8.5 ``ppo_loss_fn`` / TRL 1.16 ``_compute_loss``)::

    p          = token_logprobs(hidden, weight, ids)                 # [B, T]  fused op
    sr         = sampling_importance_weight(old, s)                  # from sampling_per_token_logps s
    rho        = importance_ratio(p, old)                            # [B, T] or [B, 1] (GSPO)
    l          = policy_objective(rho, A, p)                         # clip rule of loss_type
                 (vespo: policy_objective(vespo_weight(rho, sr), A, p), sr not multiplied again)
    l          = where(off_policy_mask(p, s or old, A), l, 0)        # off_policy_mask_threshold
    l          = where(high_entropy_mask(entropy), l, 0)             # top_entropy_quantile < 1
    l          = l * sr                                              # train/inference IS weights
    l          = l + beta * kl_penalty(p, ref) [* rho if use_bias_correction_kl]
    loss       = aggregate(l, mask)                                  # normalizer of loss_type
    loss       = loss - entropy_coef * masked_mean(entropy, m & entropy mask)   # TRL's entropy bonus

That is TRL 1.16 ``_compute_loss``'s order (the masks and the IS weight are factors of the policy
term only, never of the KL or the normalizer's token count).

Packed inputs (``cu_seqlens``): the same functions on flat [N] tensors, with a ``Segments``
(each token's sequence id) handed to the three that reduce or broadcast per sequence.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compiled_grpo._checks import FLOAT_DTYPES, check_cu_seqlens, check_shape, check_tensor, mask_to_bool
from compiled_grpo import distributed as _tp
from compiled_grpo import fused as _fused
from compiled_grpo.config import GRPOConfig
from compiled_grpo.logprobs import check_packed_hidden, token_logprobs
from compiled_grpo.loss import (advantage_stats, aggregate, high_entropy_mask, masked_mean, sampling_importance_weight,
                                segments_from_cu_seqlens)
from compiled_grpo.metrics import GRPOMetrics, TokenStats, compute_metrics, option_metrics
from compiled_grpo.objective import PerTokenLoss, per_token_loss, sampling_weight  # noqa: F401 (public names)

_DEFAULT = GRPOConfig()


class GRPOOutput(NamedTuple):
    """Per-token fields take token_ids' shape: [B, T] padded, [N] or [1, N] packed. In the fused
    gradient mode (GRPOConfig.gradient_mode, default "auto" on CUDA) only ``loss`` is
    differentiable; per_token_loss and entropy are then detached too."""

    loss: Tensor                     # 0-dim
    per_token_loss: Tensor           # [B, T], 0 at masked positions (differentiable in recompute mode)
    logprobs: Tensor                 # [B, T] detached, 0 at masked positions
    entropy: Optional[Tensor]        # [B, T], 0 at masked positions; None unless computed (as per_token_loss)
    metrics: Optional[GRPOMetrics]   # None when config.metrics is "none"


def grpo_loss(hidden: Tensor, weight: Tensor, token_ids: Tensor, advantages: Tensor, mask: Tensor,
              old_logprobs: Optional[Tensor] = None, ref_logprobs: Optional[Tensor] = None, *,
              bias: Optional[Tensor] = None, sampling_ratio: Optional[Tensor] = None,
              sampling_per_token_logps: Optional[Tensor] = None,
              num_items_in_batch=None, cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
              config: GRPOConfig = _DEFAULT, tp_group=None, vocab_start: Optional[int] = None) -> GRPOOutput:
    """GRPO-family loss of ``config.loss_type`` (docs/losses-and-metrics.md: the loss table).

    hidden [B, T, H] bf16/fp16/fp32(/fp64), weight [V, H], token_ids [B, T] int64, advantages [B] or
    [B, T], mask [B, T] bool or 0/1, old/ref log-probs [B, T], bias [V], sampling_ratio [B, T] or
    [B, 1], num_items_in_batch: int or 0-dim tensor (dapo/cispo normalizer across micro-batches).
    ``old_logprobs=None`` means on-policy (old = sg(p), ratio exactly 1). Entropy is computed (in
    the same pass as the log-probs) when ``entropy_coef > 0`` or ``metrics`` asks for it.
    Hidden states at masked positions must be finite (true of any model); inf/NaN in old/ref
    log-probs, advantages or sampling_ratio at masked positions never reach the loss or grads.

    ``sampling_per_token_logps`` [B, T] (packed: [N], like old_logprobs) are the sampler's (vLLM's)
    log-probs of the completion, TRL's ``sampling_per_token_logps``. With
    ``config.vllm_importance_sampling_correction`` (default True, TRL's) they give the
    train/inference weight from the OLD log-probs, exp(old - sampling) per token or per sequence,
    truncated or masked to [clip_min, clip_max] (``vllm_importance_sampling_mode``; old = sg(p)
    when old_logprobs is None), which multiplies the policy term exactly as a ``sampling_ratio``
    would (TRL computes its ``importance_sampling_ratio`` so and multiplies by it). So the two are
    alternatives: passing both with the correction on would apply the weight twice and raises a
    ValueError naming ``sampling_per_token_logps``. They are also what ``off_policy_mask_threshold``
    measures the drift against (old log-probs when absent), as in TRL, with or without correction.

    Packed (padding-free) inputs: ``cu_seqlens`` [S + 1] int32/int64, cumulative offsets with 0
    first and N last (flash-attn varlen / HF convention); sequence i is tokens cu_seqlens[i] :
    cu_seqlens[i + 1]. Then hidden [N, H], token_ids / mask / old / ref / sampling_ratio [N],
    advantages [S] (one per sequence; a length-S tensor is always read so) or [N]; or HF's packed
    batch: hidden [1, N, H], per-token tensors [1, N], advantages [S] or [1, N]. Per-token outputs
    take token_ids' shape. Every loss type, IS level, KL, normalizer and metric gives the value of
    the padded [S, T] layout of the same sequences (B = S, empty sequences included; L_i = the
    segment's valid tokens; dr_grpo's divisor S * max_completion_length), up to summation order.
    ``max_seqlen`` (int, flash-attn's name): a bound on the sequences' lengths, checked (ValueError
    in eager CPU code, a device assert elsewhere). Only the fused mode of the losses that couple a
    sequence's tokens (GSPO, vespo, the off-policy mask: fused.sequence_coupled) reads it, to cut
    the batch into blocks of whole sequences; without it they recompute. Pass a fixed bound such as
    the generation's max completion length, not each batch's longest: inside torch.compile a
    new value recompiles.

    Gradient: ``config.gradient_mode`` "fused" forms it while each row block's logits exist
    (6NHV FLOPs, a [R, V] workspace of ``fused_workspace_mib``; compiled_grpo/fused.py),
    "recompute" recomputes the logits in the backward (8NHV, ~64 MiB), "auto" picks fused on
    CUDA when it is exact. Fused: only ``loss`` is differentiable (no retain_graph re-backward).

    Vocab-parallel TP: ``tp_group`` / ``vocab_start`` go to token_logprobs (weight and bias are this
    rank's vocab shard, or a Shard(0) DTensor; compiled_grpo/distributed.py). Every other input is
    the same on every rank, and so are all outputs; grads: full d_hidden, this rank's dW/db shard.
    """
    logprob_fn = token_logprobs
    if tp_group is not None or vocab_start is not None:
        logprob_fn = functools.partial(token_logprobs, tp_group=tp_group, vocab_start=vocab_start)
    return _grpo_loss(logprob_fn, hidden, weight, token_ids, advantages, mask, old_logprobs, ref_logprobs,
                      bias=bias, sampling_ratio=sampling_ratio, sampling_per_token_logps=sampling_per_token_logps,
                      num_items_in_batch=num_items_in_batch, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                      config=config, fusable=True, tp_group=tp_group, vocab_start=vocab_start)


def _check_packed(hidden, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio, cu_seqlens,
                  sampling_logprobs=None, max_seqlen=None) -> None:
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_packed_hidden(hidden)
    tok, dev = tuple(hidden.shape[:-1]), hidden.device  # (N,) or (1, N)
    what = "[N]" if len(tok) == 1 else "[1, N]"
    check_cu_seqlens(cu_seqlens, tok[-1], dev, max_seqlen)
    check_tensor("mask", mask, ndims=(len(tok),), device=dev)
    check_shape("mask", mask, tok, what)
    check_tensor("advantages", advantages, ndims=(1, len(tok)), dtypes=FLOAT_DTYPES, device=dev)
    seqs = (cu_seqlens.shape[0] - 1,)
    if tuple(advantages.shape) != seqs and tuple(advantages.shape) != tok:
        raise ValueError(f"advantages must have shape [S] = {seqs} (one per sequence of cu_seqlens) or {what} = "
                         f"{tok}, got {tuple(advantages.shape)}")
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("sampling_ratio", sampling_ratio),
                    ("sampling_per_token_logps", sampling_logprobs)):
        if x is not None:
            check_tensor(name, x, dtypes=FLOAT_DTYPES, device=dev)
            check_shape(name, x, tok, what)


def _check_padded(hidden, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio, sampling_logprobs=None) -> None:
    check_tensor("hidden", hidden, ndims=(3,), dtypes=FLOAT_DTYPES)
    bt, dev = tuple(hidden.shape[:2]), hidden.device
    check_tensor("mask", mask, ndims=(2,), device=dev)
    check_shape("mask", mask, bt, "[B, T]")
    check_tensor("advantages", advantages, ndims=(1, 2), dtypes=FLOAT_DTYPES, device=dev)
    check_shape("advantages", advantages, bt[: advantages.dim()], "[B] or [B, T]")
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("sampling_per_token_logps", sampling_logprobs)):
        if x is not None:
            check_tensor(name, x, ndims=(2,), dtypes=FLOAT_DTYPES, device=dev)
            check_shape(name, x, bt, "[B, T]")
    if sampling_ratio is not None:
        check_tensor("sampling_ratio", sampling_ratio, ndims=(2,), dtypes=FLOAT_DTYPES, device=dev)
        if tuple(sampling_ratio.shape) not in (bt, (bt[0], 1)):
            raise ValueError(f"sampling_ratio must have shape [B, T] = {bt} or [B, 1], got {tuple(sampling_ratio.shape)}")


def _check_sampling(sampling_ratio, sampling_logprobs, config, mask, packed: bool) -> None:
    """The train/inference weight comes from one of sampling_ratio / sampling_per_token_logps."""
    correct = sampling_logprobs is not None and config.vllm_importance_sampling_correction
    if correct and sampling_ratio is not None:
        raise ValueError("sampling_per_token_logps with config.vllm_importance_sampling_correction=True computes the "
                         "train/inference weight that sampling_ratio also is: passing both would apply it twice; "
                         "pass one, or set vllm_importance_sampling_correction=False to use sampling_per_token_logps "
                         "only for off_policy_mask_threshold")
    if config.loss_type != "vespo":
        return
    if correct and config.vllm_importance_sampling_mode.startswith("sequence"):
        raise ValueError(f"GRPOConfig.vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r}: "
                         "loss_type='vespo' needs 'token_truncate' or 'token_mask' (as TRL)")
    if sampling_ratio is not None and not packed and sampling_ratio.shape[-1] == 1 and mask.shape[-1] != 1:
        raise ValueError("sampling_ratio of shape [B, 1]: loss_type='vespo' reads token-level ratios [B, T] (it sums "
                         "their logs over each sequence, as TRL's token_* modes)")


def _check_inputs(hidden, token_ids, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio,
                  num_items_in_batch, config, cu_seqlens=None, sampling_logprobs=None, max_seqlen=None) -> None:
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a compiled_grpo.GRPOConfig, got {type(config).__name__}")
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen bounds the sequences of cu_seqlens (packed inputs); padded [B, T] "
                             "inputs have T: pass cu_seqlens too, or leave max_seqlen None")
        _check_padded(hidden, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio, sampling_logprobs)
    else:
        _check_packed(hidden, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio, cu_seqlens,
                      sampling_logprobs, max_seqlen)
    _check_sampling(sampling_ratio, sampling_logprobs, config, mask, cu_seqlens is not None)
    if config.beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when config.beta={config.beta} > 0 (the KL penalty needs "
                         "the reference policy's log-probs; compute them with token_logprobs under no_grad)")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.dim() != 0:
                raise ValueError(f"num_items_in_batch must be an int or a 0-dim tensor, got shape "
                                 f"{tuple(num_items_in_batch.shape)}")
        elif not isinstance(num_items_in_batch, int) or isinstance(num_items_in_batch, bool) or num_items_in_batch < 0:
            raise ValueError(f"num_items_in_batch must be an int >= 0 or a 0-dim tensor, got {num_items_in_batch!r}")


def _logprob_dtype(hidden, weight) -> torch.dtype:
    """The dtype of the op's log-probs: float64 for float64 operands, float32 otherwise."""
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _option_metrics(terms: PerTokenLoss, samp, valid, cfg, segments) -> dict:
    """option_metrics at TRL's granularity: the IS weight per sequence in sequence_* modes, phi per sequence."""
    is_weight = None
    if samp is not None and cfg.vllm_importance_sampling_correction:
        is_weight = terms.is_weight  # [B, T] token_*, [B, 1] sequence_*
        if segments is not None and cfg.vllm_importance_sampling_mode.startswith("sequence"):
            is_weight = sampling_importance_weight(  # [S]
                terms.old, samp.to(terms.old.dtype), valid, mode=cfg.vllm_importance_sampling_mode,
                clip_min=cfg.vllm_importance_sampling_clip_min, clip_max=cfg.vllm_importance_sampling_clip_max,
                segments=segments, per_sequence=True)
    phi_seq = None
    if terms.gamma is not None:  # phi is one value over a sequence's valid tokens; 1 (w = 1) for an empty one
        m = valid.to(terms.gamma.dtype)
        sums = (segments.sum(terms.gamma * m), segments.sum(m)) if segments is not None else \
            ((terms.gamma * m).sum(-1), m.sum(-1))  # [S] / [B]
        phi_seq = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1.0), 1.0)
    return option_metrics(valid, terms.old, None if samp is None else samp.to(terms.old.dtype), is_weight, phi_seq)


def _grpo_loss(logprob_fn, hidden, weight, token_ids, advantages, mask, old_logprobs=None, ref_logprobs=None, *,
               bias=None, sampling_ratio=None, sampling_per_token_logps=None, num_items_in_batch=None,
               cu_seqlens=None, max_seqlen=None, config: GRPOConfig = _DEFAULT, fusable: bool = False, tp_group=None,
               vocab_start=None) -> GRPOOutput:
    """The loss of grpo_loss with log-probs from ``logprob_fn``. ``fusable``: logprob_fn is
    grpo_loss's token_logprobs (or its TP partial over ``tp_group`` / ``vocab_start``), which the
    fused-gradient mode may stand in for; reference_grpo_loss's materializing logprob_fn is not."""
    cfg = config
    samp = sampling_per_token_logps
    _check_inputs(hidden, token_ids, advantages, mask, old_logprobs, ref_logprobs, sampling_ratio,
                  num_items_in_batch, cfg, cu_seqlens, samp, max_seqlen)
    segments, out_shape = None, None
    if cu_seqlens is not None:  # packed: flatten HF's [1, N] to [N]; per-token outputs go back to token_ids' shape
        out_shape = token_ids.shape
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        token_ids, mask, old_logprobs, ref_logprobs, sampling_ratio, samp = map(
            flat, (token_ids, mask, old_logprobs, ref_logprobs, sampling_ratio, samp))  # [N]
        advantages = flat(advantages)  # [S] or [N]
        segments = segments_from_cu_seqlens(cu_seqlens, hidden.shape[0])
    valid = mask_to_bool(mask)  # [B, T]; a mask other than 0/1 is rejected (docs/errors-and-edge-cases.md)
    top_entropy = cfg.top_entropy_quantile < 1.0
    want_entropy = cfg.entropy_coef > 0 or cfg.metrics_level == "with_entropy" or top_entropy
    dtype = _logprob_dtype(hidden, weight)
    adv = advantage_stats(advantages.to(dtype), valid, segments=segments)
    if samp is not None and old_logprobs is not None and cfg.vllm_importance_sampling_correction:
        # inputs only: formed once here, so the fused row blocks need no whole sequence for it
        sampling_ratio = sampling_weight(old_logprobs.to(dtype), samp, valid, cfg, segments)  # [B, T] or [B, 1]
    fused = None
    shard = None
    if fusable and cfg.gradient_mode != "recompute" and (
            tp_group is not None or vocab_start is not None or _tp.is_dtensor(weight)):
        shard = _tp.vocab_shard(weight, bias, tp_group, vocab_start)
    if fusable and _fused.use_fused(hidden, weight, bias, cfg, segments, shard, old_logprobs=old_logprobs,
                                    sampling_logprobs=samp, max_seqlen=max_seqlen):
        fused = _fused.fused_logprobs(hidden, weight, token_ids, bias, valid, adv.advantages, old_logprobs,
                                      ref_logprobs, sampling_ratio, num_items_in_batch, segments, cfg,
                                      want_entropy, dtype, sampling_logprobs=samp,
                                      shard=shard, max_seqlen=max_seqlen)
        tok = fused.tok
    else:
        tok = logprob_fn(hidden, weight, token_ids, bias, mask=valid, temperature=cfg.temperature,
                         fp32_lm_head=cfg.fp32_lm_head, with_entropy=want_entropy, logit_scale=cfg.logit_scale,
                         final_logit_softcapping=cfg.final_logit_softcapping, round_logits=cfg.round_logits,
                         lm_head_dtype=cfg.lm_head_dtype)
    logp = tok.logprobs  # [B, T] fp32 (fp64 for fp64 inputs)
    entropy = tok.entropy  # [B, T] or None, 0 at masked positions
    # a threshold over the whole batch's current entropies: never in fused mode (fused.why_not_fused)
    keep = high_entropy_mask(entropy, valid, top_quantile=cfg.top_entropy_quantile) if top_entropy else None
    terms = per_token_loss(logp, old_logprobs, valid, adv.advantages, sampling_ratio, ref_logprobs, cfg, segments,
                           sampling_logprobs=samp, entropy_keep=keep)
    per_token, old, rho, pol, kl = terms[:5]
    loss = aggregate(per_token, valid, cfg, num_items_in_batch, segments=segments).loss
    if cfg.entropy_coef > 0:  # TRL: the bonus acts on the tokens the policy term keeps
        loss = loss - cfg.entropy_coef * masked_mean(entropy, valid if keep is None else valid & keep)
    if fused is not None:  # the value above; the gradient computed with the logits (fused.py)
        loss = fused.attach(loss)
    metrics = None
    if cfg.metrics:
        d = lambda x: None if x is None else x.detach()  # noqa: E731
        stats = TokenStats(
            logprobs=logp.detach(), old_logprobs=torch.where(valid, old, 0).detach(),
            log_ratio=rho.log_ratio.detach(), ratio=torch.exp(rho.log_ratio).detach(),
            coef=rho.ratio.detach().expand(valid.shape), advantages=adv, mask=valid,
            per_token_loss=per_token.detach(), is_low_clipped=pol.is_low_clipped.expand(valid.shape),
            is_high_clipped=pol.is_high_clipped.expand(valid.shape), kl_ref=d(kl), entropy=d(entropy),
            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high)
        extra = _option_metrics(terms, samp, valid, cfg, segments) if cfg.metrics_level != "none" else None
        metrics = compute_metrics(stats, cfg.metrics_level, cfg.custom_metrics, extra, segments=segments,
                                  per_sequence=cfg.importance_sampling_level == "sequence")
    logp = logp.detach()
    if out_shape is not None and len(out_shape) == 2:  # HF's packed batch [1, N]
        per_token, logp = per_token.reshape(out_shape), logp.reshape(out_shape)
        entropy = None if entropy is None else entropy.reshape(out_shape)
    return GRPOOutput(loss, per_token, logp, entropy, metrics)
