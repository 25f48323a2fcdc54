"""GRPOConfig: every knob of the GRPO loss family, validated once at construction.

The config is a frozen (hashable) dataclass, so ``torch.compile`` guards on its field values
and a step function closes over it without recompiling. Defaults follow Liger-Kernel 0.8.5
``LigerFusedLinearGRPOLoss`` / TRL 1.16 ``GRPOConfig`` except where noted:

- ``beta`` defaults to 0.0 (TRL) rather than Liger's 0.04.
- ``use_bias_correction_kl`` defaults to False (Liger; TRL defaults to True).
- ``log_ratio_clamp``, ``kl_input_clamp``, ``kl_output_clamp`` are numerical guards that neither
  Liger nor TRL apply (after NeMo-RL's ``calculate_kl`` and verl). Set all three to None to get
  Liger/TRL's exact numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from compiled_grpo._checks import LM_HEAD_DTYPES
from compiled_grpo._registry import METRIC_LEVELS, registered_metrics
from lowerings.linear_logprobs.fused.plan import WORKSPACE_MIB

GRADIENT_MODES = ("auto", "fused", "recompute")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class GRPOConfig:
    """Options of :func:`compiled_grpo.grpo_loss`; see the loss table in docs/losses-and-metrics.md for the formulas.

    ``metrics`` is ``"none" | "basic" | "with_entropy"``, the name of a metric registered with
    :func:`compiled_grpo.metric`, or a tuple mixing one level and registered names, e.g.
    ``("basic", "my_metric")``. It is stored normalized as a tuple of names.

    ``logit_scale`` and ``final_logit_softcapping`` are the model's logit transform under the
    HF config names (Cohere / Granite-style scaled heads; Gemma 2/3's cap): logits
    z = (hidden @ weight.T + bias) * logit_scale, then cap * tanh(z / cap), then / temperature,
    the order HF applies them and TRL divides by its temperature after.

    The lm_head's precision (docs/losses-and-metrics.md, "lm_head precision"), one of three:
    default: 16-bit operands multiplied with fp32 accumulation, the logits kept in fp32 (the
    closest to the float64 reference); ``fp32_lm_head`` (TRL's ``cast_lm_head_to_fp32``,
    Fast-LLM's name): hidden, weight and bias cast to fp32 first (fp32-accurate products,
    3xTF32 on CUDA; grads come back in the inputs' dtypes), as vLLM's ``bf16_last_layer_fp32``
    samples; ``round_logits``:
    the logits rounded to the operands' 16-bit dtype before the softmax statistics and the
    logits gradient rounded before the dX / dW GEMMs, as TRL 1.16's head computes under its
    default bf16 autocast and as vLLM / SGLang sample in bf16 (the TRL drop-in sets it under
    autocast). ``round_logits`` does nothing with fp32 operands (so ``fp32_lm_head`` wins).
    ``lm_head_dtype`` (None: the inputs' own): the dtype hidden, weight and bias are multiplied in,
    the grads accumulated in fp32 and returned in the inputs' dtypes: fp32 hidden states and
    lm_head under bf16 autocast, as TRL's head runs them (``torch.bfloat16``; ignored with
    ``fp32_lm_head``).

    ``gradient_mode`` picks how grpo_loss gets its gradient (compiled_grpo/fused.py):
    ``"fused"`` forms the loss's gradient while each row block's logits exist (logits computed
    once, 6NHV FLOPs; a workspace of one block's [R, V] logits, ``fused_workspace_mib``, default
    640 MiB, R = 2048 rows at V = 151936 bf16, plus up to 48 MiB of fp32 partials for the dX
    step's split over V on CUDA; on CPU the budget covers the fp32 workspace and the body's
    tiles: docs/gradient-modes.md, "What each mode holds"); ``"recompute"`` is the composable op of
    token_logprobs (8NHV, logits recomputed in the backward, ~60 MiB on CUDA); ``"auto"`` (default) is
    "fused" on CUDA whenever a gradient is wanted and fused is exact (tensor-parallel heads too,
    but not ``vocab_start``'s uneven shards; GSPO only on padded inputs with a whole sequence per
    block), else
    "recompute" (always on CPU, whose chunked recompute body needs far less memory). In fused mode
    only ``loss`` carries a gradient: per_token_loss, logprobs and entropy come back detached.
    ``fused_scaled_backward`` (True): where it is exact (CUDA, bf16 / fp32 operands, no
    ``entropy_coef``, no softcap, no bias gradient, no tensor-parallel head, no
    ``round_logits``) the fused mode keeps
    each block's logits as e = exp(z - R) and applies the per-token gradient as a per-row scale
    of dX's rows and of X's rows before the dW GEMM, with no pass over the [R, V] logits between
    the GEMMs (H100, qwen3-8b: ~5% faster a step); dW then takes one more bf16 rounding (the
    scaled X rows: relative dW error 3.4e-3 against 3.0e-3). False keeps the in-place dlogits
    pass (dW error as the recompute mode's).

    TRL 1.16 options under TRL's names and defaults (formulas in compiled_grpo/loss.py and the
    the loss table in docs/losses-and-metrics.md): ``loss_type="vespo"`` with ``vespo_k_pos`` 2.0, ``vespo_lambda_pos`` 3.0,
    ``vespo_k_neg`` 3.0, ``vespo_lambda_neg`` 2.0; ``off_policy_mask_threshold`` (None: off);
    ``top_entropy_quantile`` (1.0: every token); ``vllm_importance_sampling_correction`` (True),
    ``vllm_importance_sampling_mode`` ("sequence_mask"), ``vllm_importance_sampling_clip_min``
    (None), ``vllm_importance_sampling_clip_max`` (3.0), which act only when grpo_loss gets the
    sampler's log-probs (``sampling_per_token_logps``), as TRL's act only with vLLM.
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    temperature: float = 1.0
    logit_scale: float = 1.0
    final_logit_softcapping: Optional[float] = None
    log_ratio_clamp: Optional[float] = 20.0
    kl_input_clamp: Optional[float] = 20.0
    kl_output_clamp: Optional[float] = 10.0
    max_completion_length: Optional[int] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: Optional[float] = None
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    entropy_coef: float = 0.0
    fp32_lm_head: bool = False
    round_logits: bool = False
    lm_head_dtype: Optional[torch.dtype] = None
    grad_divisor: Optional[float] = None
    metrics: Union[str, tuple] = "none"
    gradient_mode: str = "auto"
    fused_workspace_mib: float = WORKSPACE_MIB
    fused_scaled_backward: bool = True

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"GRPOConfig.{field}={getattr(self, field)!r}: {why}")

        for field, choices in (("loss_type", LOSS_TYPES), ("importance_sampling_level", IS_LEVELS),
                               ("kl_estimator", KL_ESTIMATORS), ("gradient_mode", GRADIENT_MODES),
                               ("vllm_importance_sampling_mode", VLLM_IS_MODES)):
            if getattr(self, field) not in choices:
                bad(field, f"must be one of {choices}")
        for field in ("epsilon_low", "epsilon_high", "beta", "entropy_coef"):
            if not _is_real(getattr(self, field)) or getattr(self, field) < 0:
                bad(field, "must be a finite number >= 0")
        if self.epsilon_low >= 1:
            bad("epsilon_low", "must be < 1 (the lower clip bound 1 - epsilon_low must stay > 0)")
        for field in ("temperature", "logit_scale", "sapo_temperature_pos", "sapo_temperature_neg",
                      "fused_workspace_mib"):
            if not _is_real(getattr(self, field)) or getattr(self, field) <= 0:
                bad(field, "must be a finite number > 0")
        for field in ("delta", "log_ratio_clamp", "kl_input_clamp", "kl_output_clamp", "grad_divisor",
                      "final_logit_softcapping"):
            v = getattr(self, field)
            if v is not None and (not _is_real(v) or v <= 0):
                bad(field, "must be None or a finite number > 0")
        for field in ("vespo_k_pos", "vespo_k_neg", "off_policy_mask_threshold"):
            v = getattr(self, field)  # any sign: a mean KL estimate (and so its threshold) may be < 0
            if not (v is None and field == "off_policy_mask_threshold") and not _is_real(v):
                bad(field, "must be a finite number" + (" or None" if field == "off_policy_mask_threshold" else ""))
        for field in ("vespo_lambda_pos", "vespo_lambda_neg"):
            if not _is_real(getattr(self, field)) or getattr(self, field) < 0:
                bad(field, "must be a finite number >= 0 (TRL clamps it to >= 1e-4)")
        from compiled_grpo.logprobs import check_model_scaling   # logits' scale factors in fp32 range
        check_model_scaling(self.logit_scale, self.final_logit_softcapping, self.temperature)
        q = self.top_entropy_quantile
        if not _is_real(q) or not 0.0 <= q <= 1.0:
            bad("top_entropy_quantile", "must be a number in [0, 1] (1.0 keeps every token)")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for field, v in (("vllm_importance_sampling_clip_min", lo), ("vllm_importance_sampling_clip_max", hi)):
            if v is not None and (not _is_real(v) or v < 0):
                bad(field, "must be None or a finite number >= 0")
        if lo is not None and hi is not None and lo >= hi:
            bad("vllm_importance_sampling_clip_min", f"must be < vllm_importance_sampling_clip_max={hi} (as TRL)")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                and lo is None and hi is None):
            bad("vllm_importance_sampling_clip_max", "a *_truncate vllm_importance_sampling_mode needs "
                "vllm_importance_sampling_clip_min or _clip_max set (as TRL)")
        for field in ("use_bias_correction_kl", "fp32_lm_head", "round_logits", "vllm_importance_sampling_correction",
                      "fused_scaled_backward"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a bool")
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            bad("lm_head_dtype", "must be None, torch.bfloat16, torch.float16 or torch.float32")
        m = self.max_completion_length
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m <= 0):
            bad("max_completion_length", "must be None or a positive int")
        if self.loss_type == "dr_grpo" and m is None:
            bad("max_completion_length", "loss_type='dr_grpo' normalizes by B * max_completion_length; set it")
        object.__setattr__(self, "metrics", _normalize_metrics(self.metrics))

    @property
    def metrics_level(self) -> str:
        """The built-in metric level requested: 'none', 'basic' or 'with_entropy'."""
        levels = [m for m in self.metrics if m in METRIC_LEVELS]
        return levels[0] if levels else "none"

    @property
    def custom_metrics(self) -> tuple:
        """Names of registered metrics requested, in request order."""
        return tuple(m for m in self.metrics if m not in METRIC_LEVELS)



# help(GRPOConfig) lists each choice field's valid values, from the tuples __post_init__ checks
GRPOConfig.__doc__ += "\n    Valid values (checked at construction, ValueError naming the field):\n\n" + "".join(
    f"    - ``{name}``: {', '.join(repr(c) for c in choices)}\n"
    for name, choices in (("loss_type", LOSS_TYPES), ("importance_sampling_level", IS_LEVELS),
                          ("kl_estimator", KL_ESTIMATORS), ("gradient_mode", GRADIENT_MODES),
                          ("vllm_importance_sampling_mode", VLLM_IS_MODES)))

def _normalize_metrics(metrics) -> tuple:
    names = (metrics,) if isinstance(metrics, str) else metrics
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"GRPOConfig.metrics={metrics!r}: must be a str or a tuple of str")
    levels = [n for n in names if n in METRIC_LEVELS]
    if len(levels) > 1:
        raise ValueError(f"GRPOConfig.metrics={metrics!r}: at most one of {METRIC_LEVELS}")
    unknown = [n for n in names if n not in METRIC_LEVELS and n not in registered_metrics()]
    if unknown:
        raise ValueError(f"GRPOConfig.metrics={metrics!r}: unknown metric name(s) {unknown}; the levels are "
                         f"{METRIC_LEVELS} and registered metrics are {sorted(registered_metrics())}")
    return tuple(n for n in names if n != "none")
