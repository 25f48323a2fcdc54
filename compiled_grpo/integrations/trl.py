"""TRL 1.16 ``GRPOTrainer`` with compiled_grpo's log-probs and loss: switching is changing one import.

    from compiled_grpo.integrations.trl import GRPOTrainer      # was: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=trl.GRPOConfig(...), train_dataset=...)

Shape legend: B completions of a micro-batch, P prompt positions, T completion positions, H hidden
size, V vocab size.

What changes, and nothing else (generation, rewards, advantages, batching, the optimizer, the
logged reward/completion metrics stay TRL's code):

- ``_get_per_token_logps_and_entropies`` (old log-probs when ``num_iterations > 1`` or generation
  runs ahead of the optimizer, reference log-probs when ``beta > 0``): the backbone's last hidden
  states [B, T, H] at the positions that predict the completion and the lm_head weight [V, H] go to
  ``compiled_grpo.token_logprobs``; no [B, T, V] logits exist.
- ``_compute_loss``: the policy log-probs, entropy and the whole loss come from one
  ``compiled_grpo.grpo_loss`` call, with ``trl.GRPOConfig`` mapped by :func:`grpo_config_from_trl`
  (numerical guards off, so the numbers are TRL's). The metrics TRL 1.16 logs there are logged
  under the same names with TRL's definitions (``kl``, ``entropy``, ``clip_ratio/low_mean``,
  ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``,
  ``clip_ratio/high_max``, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss`` and
  ``entropy_coef`` with an entropy bonus); ``loss`` and ``grad_norm`` are logged by
  ``transformers.Trainer`` as before.

Supported (``trl.GRPOConfig`` fields): ``loss_type`` grpo, bnpo, dr_grpo (``max_completion_length``),
dapo, cispo, sapo (``sapo_temperature_pos/neg``), luspo, vespo (``vespo_k_pos``, ``vespo_lambda_pos``,
``vespo_k_neg``, ``vespo_lambda_neg``); ``off_policy_mask_threshold`` (measured against TRL's
``sampling_per_token_logps`` when present, i.e. with vLLM, else the old log-probs, as TRL);
``top_entropy_quantile`` (the entropy bonus then averages over the kept tokens, as TRL);
``epsilon``, ``epsilon_high``, ``delta``,
``beta`` with ``use_bias_correction_kl``, ``importance_sampling_level`` token or sequence (GSPO),
``temperature``, ``num_iterations``, ``steps_per_generation``, gradient accumulation, a static
``entropy_coef``, ``cast_lm_head_to_fp32`` (``fp32_lm_head``), tool masks, mixed precision (TRL's
default ``bf16=True``: the lm_head GEMM runs in the autocast dtype and its logits and their
gradient are rounded to it, as TRL's head does: ``round_logits``; tests/test_trl_integration.py
compares every logged number step by step under bf16 and in float32). The
model's logit scale and final-logit softcapping are read from its config as TRL does
(``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, ``logits_scaling``,
``final_logit_softcapping``) and passed to compiled_grpo's ``logit_scale`` /
``final_logit_softcapping``; with a compiled_grpo that lacks them, such a model raises ``ValueError``.

Not supported, ``ValueError`` at construction naming the option: ``use_adaptive_entropy``,
``top_entropy_quantile < 1`` with more than one process (TRL takes the quantile over every rank's
entropies, gathered inside its loss; compiled_grpo over the local micro-batch), ``loss_type="vespo"``
with vLLM importance sampling and ``vllm_importance_sampling_clip_min > 1`` or ``_clip_max < 1``
(TRL's ratio is then not 1 at padded positions and its gamma weight sums their logs; compiled_grpo
reads valid tokens only), MoE router aux loss (``router_aux_loss_coef`` on a model with
``output_router_logits``), vision-language models, DeepSpeed ZeRO-3 (the op recomputes logits from
the weight in its backward, outside the ZeRO-3 gather). Tested end to end against stock TRL:
one process (CPU, in CI) and accelerate's multi-process data parallel on 2 processes (gloo on CPU
in CI; NCCL on 2 GPUs, bf16 and fp32: tests/trl_multiprocess.py), every logged metric step by step.
Written for but not tested end to end: FSDP2 (the lm_head weight is gathered with ``full_tensor``
as TRL does), PEFT without an lm_head adapter, vLLM generation with ``vllm_importance_sampling_correction``:
TRL forms the weight at generation (``inputs["importance_sampling_ratio"]``) and the trainer passes
it to ``grpo_loss`` as ``sampling_ratio`` (a factor of the policy term; vespo: its log enters phi),
with compiled_grpo's own ``vllm_importance_sampling_correction`` off so it is applied once;
``inputs["sampling_per_token_logps"]`` goes to ``grpo_loss`` only for ``off_policy_mask_threshold``.
The loss on such inputs is tested against TRL's ``_compute_loss`` (tests/test_trl_integration.py).

Compiling the loss: ``GRPOTrainer(..., compile_loss=True)`` (an argument TRL does not have) wraps
``compiled_grpo.grpo_loss`` in ``torch.compile(fullgraph=True)`` with the completion length marked
dynamic; a dict is passed to ``torch.compile`` (e.g. ``{"backend": "aot_eager"}``). The backbone
is compiled by TRL/transformers' own ``torch_compile=True`` as usual.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch
import trl
from accelerate.utils import is_peft_model
from trl.trainer.utils import nanmax, nanmin

import compiled_grpo as cg
# the trl.GRPOConfig -> GRPOConfig translation and its checks (public names, re-exported)
from compiled_grpo.integrations.trl_config import (SUPPORTED_LOSS_TYPES, _scaling_kwargs,  # noqa: F401
                                                   _unsupported, check_supported, check_supported_world,
                                                   grpo_config_from_trl, lm_head_scalings)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None

TRL_SERIES = "1.16"
if not trl.__version__.startswith(TRL_SERIES + "."):
    raise ImportError(f"compiled_grpo.integrations.trl overrides private methods of TRL {TRL_SERIES}.x's GRPOTrainer; "
                      f"found trl {trl.__version__}. Install the pinned release: pip install -e \".[trl]\"")

_ITEMS_NORMALIZED = ("dapo", "cispo", "vespo")  # divided by num_items_in_batch, not by the accumulation steps
_HIDDEN_FLAG = "compiled_grpo_hidden_states"  # forward kwarg that returns the backbone's last hidden state
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def add_hidden_states_forward(model) -> None:
    """Patch ``model.forward`` so that ``model(..., compiled_grpo_hidden_states=True)`` returns the
    backbone's last hidden state [B, P + T, H] instead of logits (TRL's ``add_fused_lm_head`` pattern:
    the call still goes through DDP/PEFT wrappers; without the flag the forward is unchanged)."""
    previous = model.forward

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def forward(self, *args, **kwargs):
        if not kwargs.pop(_HIDDEN_FLAG, False):
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs).last_hidden_state

    model.forward = types.MethodType(forward, model)


def _global_masked_mean(reduce, x, mask) -> float:
    """TRL 1.16 ``_compute_loss.global_masked_mean``: a [B, 1] tensor is one value per sequence."""
    if x.shape[1] == 1:
        local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
    else:
        local_sum, local_count = (x * mask).sum(), mask.sum().float()
    totals = reduce(torch.stack([local_sum, local_count]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _masked_seq_mean(x, mask):
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)  # [B]; NaN for empty rows (TRL)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` (TRL 1.16) with compiled_grpo computing the log-probs and the loss.

    Same arguments as ``trl.GRPOTrainer`` plus keyword-only ``compile_loss`` (False, True, or a dict
    of ``torch.compile`` kwargs). See the module docstring for what is and is not supported; an
    unsupported option raises ``ValueError`` here, before any training.
    ``self.compiled_grpo_config`` is the ``compiled_grpo.GRPOConfig`` the loss runs with.
    """

    def __init__(self, model, reward_funcs=None, args=None, *rest, compile_loss=False, **kwargs):
        if args is not None:
            check_supported(args)  # fail before loading the model
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_model_supported()
        scale, softcap, source = lm_head_scalings(self.model.config)
        params = inspect.signature(cg.token_logprobs).parameters  # first: its error names the model's attribute
        self._logprob_kwargs = _scaling_kwargs(params, scale, softcap, "token_logprobs", source)
        self.compiled_grpo_config = grpo_config_from_trl(self.args, logit_scale=scale, final_logit_softcapping=softcap)
        self._grpo_loss = cg.grpo_loss
        self._compiled = bool(compile_loss)
        if compile_loss:
            opts = {"fullgraph": True, **(compile_loss if isinstance(compile_loss, dict) else {})}
            self._grpo_loss = torch.compile(cg.grpo_loss, **opts)
        # The same objects TRL gave its fused head to (before accelerate wraps them).
        add_hidden_states_forward(self.model.get_base_model() if is_peft_model(self.model) else self.model)
        if self.ref_model is not None:
            add_hidden_states_forward(self.accelerator.unwrap_model(self.ref_model))

    def _check_model_supported(self) -> None:
        check_supported_world(self.args, self.accelerator.num_processes)
        if self.aux_loss_enabled:
            raise _unsupported("router_aux_loss_coef", self.router_aux_loss_coef,
                               "the MoE load-balancing loss is not implemented",
                               "Set GRPOConfig.router_aux_loss_coef=0.0")
        if self.model.config.get_text_config() is not self.model.config:
            raise _unsupported("model", type(self.model).__name__, "vision-language models are not supported",
                               "Train a text-only causal LM")
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
        if is_deepspeed_zero3_enabled():
            raise _unsupported("DeepSpeed ZeRO stage", 3, "the op recomputes logits from the lm_head weight in its "
                               "backward, outside ZeRO-3's parameter gather", "Use ZeRO-1/2, DDP or FSDP")

    # -- hidden states and lm_head ------------------------------------------------------------------------------

    def _hidden_and_head(self, model, input_ids, attention_mask, logits_to_keep: int):
        """Hidden states [B, T, H] whose next token is a completion token, and the lm_head (weight, bias)
        in their own dtypes: the op multiplies them in GRPOConfig.lm_head_dtype (the autocast dtype,
        as TRL's head) and returns their grads in their dtypes, accumulated in fp32 (as TRL's)."""
        with self.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, **{_HIDDEN_FLAG: True})  # [B, P+T, H]
            device_type = hidden.device.type
            autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        hidden = hidden[:, -logits_to_keep - 1:-1]  # [B, T, H]: position t - 1 predicts completion token t
        unwrapped = self.accelerator.unwrap_model(model)
        if is_peft_model(unwrapped):
            unwrapped = unwrapped.get_base_model()
        head = unwrapped.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if DTensor is not None and isinstance(weight, DTensor):  # FSDP2 shards: gather once, as TRL does
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        hidden = hidden.to(weight.device)  # device_map may end the backbone elsewhere
        cfg = self.compiled_grpo_config
        if cfg.lm_head_dtype is not None and autocast_dtype != cfg.lm_head_dtype:
            raise RuntimeError(f"compiled_grpo: the trainer's autocast dtype is {autocast_dtype}, but the loss was "
                               f"configured for lm_head_dtype={cfg.lm_head_dtype} (from bf16 / fp16 at construction)")
        return hidden, weight, bias

    @staticmethod
    def _refuse_multimodal(kwargs: dict) -> None:
        given = [k for k, v in kwargs.items() if v is not None]
        if given:
            raise ValueError(f"compiled_grpo.integrations.trl.GRPOTrainer is text-only; got multimodal inputs {given}")

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's signature and outputs (log-probs [B, T], entropies [B, T] or None, aux None), both 0 at
        padded completion positions, from ``compiled_grpo.token_logprobs`` in chunks of ``batch_size``."""
        self._refuse_multimodal(multimodal)
        if compute_aux_loss:
            raise _unsupported("router_aux_loss_coef", self.router_aux_loss_coef, "no MoE aux loss", "Set it to 0.0")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            hidden, weight, bias = self._hidden_and_head(model, ids, am, logits_to_keep)
            with torch.autocast(hidden.device.type, enabled=False):
                tok = cg.token_logprobs(hidden, weight, ids[:, -logits_to_keep:], bias, mask=am[:, -logits_to_keep:],
                                        temperature=self.temperature,
                                        fp32_lm_head=self.compiled_grpo_config.fp32_lm_head,
                                        round_logits=self.compiled_grpo_config.round_logits,
                                        lm_head_dtype=self.compiled_grpo_config.lm_head_dtype,
                                        with_entropy=compute_entropy, **self._logprob_kwargs)
            logps.append(tok.logprobs)  # [b, T] fp32
            entropies.append(tok.entropy)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    # -- the loss -----------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        """TRL 1.16 ``_compute_loss`` as one ``compiled_grpo.grpo_loss`` call.

        TRL's normalizers, reproduced: the loss types divided by B or by tokens are divided by the
        gradient accumulation steps in training; dapo/cispo/vespo divide by ``num_items_in_batch`` (which
        spans the generation batch) * accumulation steps / ``steps_per_generation``: here
        ``grpo_loss(num_items_in_batch=items / steps_per_generation) / accumulation_steps``, which also
        scales the entropy bonus by 1 / accumulation_steps as TRL does.
        """
        self._refuse_multimodal({k: inputs.get(k) for k in _MULTIMODAL})
        cfg, mode = self.compiled_grpo_config, "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]  # [B, T]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)  # [B, P+T]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [B, T]
        hidden, weight, bias = self._hidden_and_head(model, input_ids, attention_mask, completion_ids.size(1))
        advantages = inputs["advantages"]  # [B] or [B, T]
        old = inputs.get("old_per_token_logps")  # None: on-policy, old = sg(logp)
        ref = inputs.get("ref_per_token_logps") if cfg.beta != 0.0 else None
        sampling_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            # TRL's train/inference weight, formed from the old and the sampler's log-probs at generation;
            # cfg.vllm_importance_sampling_correction is False, so grpo_loss forms no second one. It multiplies
            # the policy term (vespo: its log enters phi instead, as TRL's get_gamma_weights).
            sampling_ratio = inputs["importance_sampling_ratio"]  # [B, T] or [B, 1]
        # The off-policy mask's reference: the sampler's log-probs when TRL has them (vLLM), else the old
        # log-probs (grpo_loss's default, TRL's inputs.get("sampling_per_token_logps", old_per_token_logps)).
        sampling_logps = inputs.get("sampling_per_token_logps") if cfg.off_policy_mask_threshold is not None else None
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        items = None
        if cfg.loss_type in _ITEMS_NORMALIZED:
            items = inputs["num_items_in_batch"].float().clamp(min=1.0)
            if mode == "train":
                items = items / self.args.steps_per_generation
        if self._compiled:
            for t in (hidden, completion_ids, mask, old, ref, sampling_ratio, sampling_logps):
                if t is not None and t.size(1) > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 1)  # T varies batch to batch
        with torch.autocast(hidden.device.type, enabled=False):
            out = self._grpo_loss(hidden, weight, completion_ids, advantages, mask, old, ref, bias=bias,
                                  sampling_ratio=sampling_ratio, sampling_per_token_logps=sampling_logps,
                                  num_items_in_batch=items, config=cfg)
        loss = out.loss / accumulation
        self._log_trl_metrics(mode, mask, out, old, ref, advantages, accumulation, sampling_ratio)
        return loss

    @torch.no_grad()
    def _log_trl_metrics(self, mode, mask, out, old, ref, advantages, accumulation, sampling_ratio=None) -> None:
        """The metrics TRL 1.16 ``_compute_loss`` logs, same names, same definitions and reductions, on
        detached [B, T] tensors; ratio and KL from compiled_grpo's own functions with TRL's (absent) guards."""
        cfg, metrics, reduce = self.compiled_grpo_config, self._metrics[mode], self.accelerator.reduce
        logp, entropy, valid = out.logprobs, out.entropy, mask.bool()  # [B, T]
        mask = mask.to(logp.dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)  # [B, 1]
        rho = cg.importance_ratio(logp, logp if old is None else old.to(logp.dtype), valid,
                                  level=cfg.importance_sampling_level, log_ratio_clamp=None)
        coef = rho.ratio  # [B, T] or [B, 1]
        if self._entropy_bonus_enabled:
            bonus_mask = mask  # TRL: the bonus averages over the tokens the policy term keeps
            if cfg.top_entropy_quantile < 1.0:
                keep = cg.high_entropy_mask(entropy, valid, top_quantile=cfg.top_entropy_quantile)  # [B, T]
                bonus_mask = mask * keep.to(mask.dtype)
            mean_entropy = (entropy * bonus_mask).sum() / bonus_mask.sum().clamp(min=1.0)
            items_scale = accumulation if cfg.loss_type in _ITEMS_NORMALIZED else 1
            policy_loss = (out.loss.detach() + cfg.entropy_coef * mean_entropy) / items_scale
            metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if cfg.beta != 0.0:
            kl = cg.kl_penalty(logp, ref.to(logp.dtype), valid, estimator="k3", input_clamp=None,
                               output_clamp=None).kl  # [B, T]
            if cfg.use_bias_correction_kl:
                kl = kl * coef
            metrics["kl"].append(_global_masked_mean(reduce, kl, mask))
        metrics["entropy"].append(_global_masked_mean(reduce, entropy, mask))
        if cfg.loss_type == "vespo":  # TRL's phi_seq: [B, 1] (one per sequence) with [B] advantages
            phi = cg.vespo_weight(rho.log_ratio, valid, advantages, sampling_ratio, cfg)
            metrics["vespo/phi_seq_mean"].append(_global_masked_mean(reduce, phi, mask))
        elif cfg.loss_type == "cispo":
            clipped = (coef > cfg.epsilon_high) & (advantages > 0)
            metrics["cispo_clip_ratio"].append(_global_masked_mean(reduce, clipped.float(), mask))
        elif cfg.loss_type != "sapo":
            capped = coef if cfg.delta is None else coef.clamp(max=cfg.delta)  # TRL tests the delta-capped ratio
            low = ((capped < 1 - cfg.epsilon_low) & (advantages < 0)).float()
            high = ((capped > 1 + cfg.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(_global_masked_mean(reduce, low, mask))
            metrics["clip_ratio/high_mean"].append(_global_masked_mean(reduce, high, mask))
            metrics["clip_ratio/region_mean"].append(_global_masked_mean(reduce, torch.maximum(low, high), mask))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(_masked_seq_mean(low, mask))).item())
            metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(_masked_seq_mean(high, mask))).item())
