"""``trl.GRPOConfig`` -> ``compiled_grpo.GRPOConfig`` for the TRL 1.16 drop-in (integrations/trl.py):
the options it implements, the checks that refuse the rest with a message naming the option, and
the model's logit scalings as TRL 1.16 reads them. Reads the config's fields only (no TRL
internals), so it imports without trl.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

import compiled_grpo as cg
from compiled_grpo.config import LOSS_TYPES

if TYPE_CHECKING:
    import trl

SUPPORTED_LOSS_TYPES = LOSS_TYPES   # every loss type of GRPOConfig (compiled_grpo.config)


def _unsupported(option: str, value, why: str, fix: str) -> ValueError:
    return ValueError(f"compiled_grpo.integrations.trl.GRPOTrainer does not support {option}={value!r}: {why}. "
                      f"{fix}, or use trl.GRPOTrainer.")


def check_supported(args: trl.GRPOConfig) -> None:
    """Raise ValueError naming the first ``trl.GRPOConfig`` option this trainer does not implement."""
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        raise _unsupported("GRPOConfig.loss_type", args.loss_type, "compiled_grpo has no such loss",
                           f"Pick one of {SUPPORTED_LOSS_TYPES}")
    if args.use_adaptive_entropy:
        raise _unsupported("GRPOConfig.use_adaptive_entropy", True, "only a static entropy_coef is implemented",
                           "Set a fixed entropy_coef")
    if args.loss_type == "vespo" and args.use_vllm and args.vllm_importance_sampling_correction:
        lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        if (lo is not None and lo > 1.0) or (hi is not None and hi < 1.0):
            # TRL's ratio is clip(1) != 1 at padded positions and its get_gamma_weights sums log(ratio) over
            # all T positions; compiled_grpo sums over the valid tokens only (equal whenever 1 is in range).
            raise _unsupported("GRPOConfig.vllm_importance_sampling_clip_min/_clip_max", (lo, hi),
                               "with loss_type='vespo', TRL's importance-sampling ratio of a padded position is "
                               "then not 1 and enters its gamma weight; compiled_grpo reads valid tokens only",
                               "Use bounds with clip_min <= 1 <= clip_max")


def check_supported_world(args: trl.GRPOConfig, num_processes: int) -> None:
    """Options whose TRL numbers need data from every data-parallel rank inside the loss."""
    if args.top_entropy_quantile < 1.0 and num_processes > 1:
        raise _unsupported("GRPOConfig.top_entropy_quantile", args.top_entropy_quantile,
                           f"with {num_processes} processes TRL takes the entropy quantile over every rank's tokens "
                           "(a gather inside the loss); compiled_grpo takes it over this rank's micro-batch",
                           "Leave it 1.0 for multi-process training")


def lm_head_scalings(model_config) -> tuple[float, Optional[float], str]:
    """(logit_scale, final_logit_softcapping, name of the scale's config attribute): TRL 1.16's lookup
    (``trl.trainer.utils.add_fused_lm_head``): logits = cap * tanh(scale * (h @ W.T + b) / cap)."""
    text = model_config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text, name, None) is not None:
            return float(getattr(text, name)), softcap, name
    if getattr(text, "logits_scaling", None) is not None:  # Granite/MiniCPM3 divide, HyperCLOVA X multiplies
        s = text.logits_scaling
        return float(s if text.model_type == "hyperclovax" else 1 / s), softcap, "logits_scaling"
    return 1.0, softcap, "logit_scale"


def _scaling_kwargs(params, logit_scale: float, softcap: Optional[float], where: str, source: str) -> dict:
    """The scaling kwargs for a compiled_grpo callable/config with parameter names ``params``; a model
    that needs a scaling the installed compiled_grpo lacks is an error, never a silent mismatch."""
    kw = {}
    for name, value, default, attr in (("logit_scale", logit_scale, 1.0, source),
                                       ("final_logit_softcapping", softcap, None, "final_logit_softcapping")):
        if name in params:
            kw[name] = value
        elif value != default:
            raise ValueError(f"the model's config sets {attr}={value!r}, which TRL applies to the logits, but this "
                             f"compiled_grpo has no {where}.{name}; upgrade compiled_grpo or use trl.GRPOTrainer")
    return kw


def grpo_config_from_trl(args: trl.GRPOConfig, *, logit_scale: float = 1.0,
                         final_logit_softcapping: Optional[float] = None) -> cg.GRPOConfig:
    """``trl.GRPOConfig`` -> ``compiled_grpo.GRPOConfig`` with TRL 1.16's numbers: guards off (TRL
    clamps nothing), k3 KL, ``metrics="with_entropy"`` (TRL logs the entropy every step).

    ``vllm_importance_sampling_correction`` is always False here: TRL forms the train/inference
    weight itself (``inputs["importance_sampling_ratio"]``) and the trainer passes that tensor as
    ``grpo_loss(sampling_ratio=...)``; the sampler's log-probs go to ``grpo_loss`` only for the
    off-policy mask, which reads them with or without the correction (as TRL)."""
    check_supported(args)
    fields = {f.name for f in dataclasses.fields(cg.GRPOConfig)}
    return cg.GRPOConfig(
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        delta=args.delta, beta=args.beta, kl_estimator="k3", use_bias_correction_kl=args.use_bias_correction_kl,
        temperature=args.temperature, log_ratio_clamp=None, kl_input_clamp=None, kl_output_clamp=None,
        max_completion_length=args.max_completion_length, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        vllm_importance_sampling_correction=False, entropy_coef=args.entropy_coef,
        fp32_lm_head=args.cast_lm_head_to_fp32, metrics="with_entropy",
        # TRL's head under autocast (bf16 / fp16 mixed precision) multiplies the fp32 hidden states
        # and lm_head in the autocast dtype, rounds its logits tiles and their gradient to it and
        # returns fp32-accumulated grads; cast_lm_head_to_fp32 multiplies in fp32 instead
        round_logits=bool(args.bf16 or args.fp16) and not args.cast_lm_head_to_fp32,
        lm_head_dtype=(None if args.cast_lm_head_to_fp32 else torch.bfloat16 if args.bf16
                       else torch.float16 if args.fp16 else None),
        **_scaling_kwargs(fields, logit_scale, final_logit_softcapping, "GRPOConfig", "logit_scale"))
