"""verl 0.9's actor loss settings as a ``cg.GRPOConfig`` (no verl import: a mapping of names).

verl's actor loss (verl/workers/utils/losses.py ``ppo_loss``, verl/trainer/ppo/core_algos.py) is

    loss = agg(pg_loss_mode(old, logp, A), mask, loss_agg_mode)
           - entropy_coeff * agg(entropy, loss_agg_mode) + kl_loss_coef * agg(kl_penalty(logp, ref, kl_loss_type))

``grpo_config(actor)`` returns the GRPOConfig whose ``grpo_loss`` is that loss, in value and
gradient (tests/test_verl.py compares them in float64 with verl's own functions):

  policy_loss.loss_mode  vanilla  PPO clip with verl's dual clip: ``delta = clip_ratio_c`` (for
                                  A < 0 both cap the loss at -A c; needs 1 + clip_ratio_high < c)
                         gspo     ``importance_sampling_level="sequence"`` (verl's GSPO-token:
                                  the same value and gradient), ``log_ratio_clamp = 10`` (verl
                                  clamps the log-weight at 10 from above only)
                         sapo     ``loss_type="sapo"``, tau_pos / tau_neg (verl aggregates it
                                  seq-mean-token-mean whatever loss_agg_mode says)
                         cispo    ``loss_type="cispo"``, ``epsilon_high = 1 + clip_ratio_high``
                                  (a cap), while ``clip_ratio_low >= 1`` (no lower clip)
  loss_agg_mode          token-mean               ``dapo`` (pass verl's ``batch_num_tokens`` as
                                                  ``num_items_in_batch`` under data parallelism)
                         seq-mean-token-mean      ``grpo``
                         seq-mean-token-sum       ``luspo``
                         seq-mean-token-sum-norm  ``dr_grpo``, ``max_completion_length =
                                                  loss_scale_factor`` or the response length
  kl_loss_type           k1 / kl, k2 / mse (no clamps), k3 / low_var_kl (verl's clamps: the
                         log-ratio at +-20, the estimate at +-10) -> ``kl_estimator``, ``beta =
                         kl_loss_coef`` when ``use_kl_loss``
  entropy_coeff          ``entropy_coef`` (compiled_grpo's bonus is a token mean: token-mean only)

The sequence means count the sequences with a valid token (verl) where compiled_grpo counts every
sequence (TRL): equal whenever no sequence is fully masked. verl's seq-mean-token-mean divides by
L + 1e-8, compiled_grpo by max(L, 1): 1e-8 / L relative.

Not mapped (ValueError naming the setting and why): the loss modes dppo_tv, dppo_kl, gpg,
clip_cov, kl_cov, geo_mean, dro, bypass_mode and the other registered ones (objectives
compiled_grpo does not have); ``token-sum`` (no normalizer of that form); verl's straight-through
KL (``k3+``, ``low_var_kl+``: the k2 gradient under the k3 value) and ``abs``; ``cispo`` with a
lower clip; sapo with a KL or entropy term aggregated otherwise than seq-mean-token-mean.
"""
from __future__ import annotations

from typing import Any, Optional

import compiled_grpo as cg

LOSS_MODES = ("vanilla", "gspo", "sapo", "cispo")
AGG_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "luspo",
                  "seq-mean-token-sum-norm": "dr_grpo"}
KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def _get(cfg: Any, name: str, default=None):
    """A field of verl's ActorConfig (a dataclass), an omegaconf DictConfig or a dict."""
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def grpo_config(actor: Any, *, response_length: Optional[int] = None, **overrides) -> cg.GRPOConfig:
    """cg.GRPOConfig of verl's ``actor_rollout_ref.actor`` settings (ActorConfig, DictConfig or
    dict; module docstring). ``response_length``: the mask's T, which seq-mean-token-sum-norm
    divides by when ``loss_scale_factor`` is None. ``overrides``: other GRPOConfig fields
    (``metrics``, ``gradient_mode``, ...)."""
    policy = _get(actor, "policy_loss", None)
    mode = _get(policy, "loss_mode", "vanilla") if policy is not None else "vanilla"
    agg = _get(actor, "loss_agg_mode", "token-mean")
    clip = _get(actor, "clip_ratio", 0.2)
    low = _get(actor, "clip_ratio_low", None)
    high = _get(actor, "clip_ratio_high", None)
    low, high = clip if low is None else low, clip if high is None else high
    if mode not in LOSS_MODES:
        raise ValueError(f"policy_loss.loss_mode={mode!r}: compiled_grpo maps {LOSS_MODES}; "
                         f"{mode} is an objective it does not have")
    if agg not in AGG_LOSS_TYPES:
        raise ValueError(f"loss_agg_mode={agg!r}: compiled_grpo maps {tuple(AGG_LOSS_TYPES)} "
                         f"(token-sum has no normalizer of that form here)")
    kw: dict = dict(loss_type=AGG_LOSS_TYPES[agg], epsilon_low=float(low), epsilon_high=float(high),
                    log_ratio_clamp=20.0)
    if agg == "seq-mean-token-sum-norm":
        scale = _get(actor, "loss_scale_factor", None) or response_length
        if scale is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' without loss_scale_factor divides by "
                             "the response length: pass response_length=")
        kw["max_completion_length"] = int(scale)
    if mode == "vanilla":
        c = float(_get(actor, "clip_ratio_c", 3.0))
        if not 1 + high < c:
            raise ValueError(f"clip_ratio_c={c} must exceed 1 + clip_ratio_high = {1 + high} for verl's "
                             f"dual clip to equal compiled_grpo's delta")
        kw["delta"] = c
    elif mode == "gspo":
        kw.update(importance_sampling_level="sequence", log_ratio_clamp=10.0)
    elif mode == "cispo":
        if agg != "token-mean" or low < 1:
            raise ValueError(f"loss_mode='cispo' maps with loss_agg_mode='token-mean' and no lower clip "
                             f"(clip_ratio_low >= 1), got {agg!r} and {low}")
        kw.update(loss_type="cispo", epsilon_low=0.2, epsilon_high=1.0 + high)   # epsilon_low: unused
    entropy_coeff = float(_get(actor, "entropy_coeff", 0.0) or 0.0)
    use_kl = bool(_get(actor, "use_kl_loss", False))
    if mode == "sapo":
        if agg != "seq-mean-token-mean" and (use_kl or entropy_coeff):
            raise ValueError(f"loss_mode='sapo' aggregates its policy term seq-mean-token-mean in verl; "
                             f"its KL / entropy terms follow loss_agg_mode={agg!r}: not one aggregation")
        kw.update(loss_type="sapo", sapo_temperature_pos=float(_get(actor, "tau_pos", 1.0)),
                  sapo_temperature_neg=float(_get(actor, "tau_neg", 1.05)))
    if entropy_coeff:
        if agg != "token-mean":
            raise ValueError(f"entropy_coeff with loss_agg_mode={agg!r}: compiled_grpo's entropy bonus is a "
                             f"token mean")
        kw["entropy_coef"] = entropy_coeff
    if use_kl:
        kl_type = _get(actor, "kl_loss_type", "low_var_kl")
        if kl_type not in KL_ESTIMATORS:
            raise ValueError(f"kl_loss_type={kl_type!r}: compiled_grpo maps {tuple(KL_ESTIMATORS)} "
                             f"(not abs, nor the straight-through '+' forms)")
        est = KL_ESTIMATORS[kl_type]
        clamps = (20.0, 10.0) if est == "k3" else (None, None)
        kw.update(beta=float(_get(actor, "kl_loss_coef", 0.001)), kl_estimator=est,
                  kl_input_clamp=clamps[0], kl_output_clamp=clamps[1])
    kw.update(overrides)
    return cg.GRPOConfig(**kw)
