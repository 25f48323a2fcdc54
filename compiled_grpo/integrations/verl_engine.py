"""verl 0.9: an engine whose actor update is verl's loss in grpo_loss's fused-gradient mode.

verl's FSDP engine (``FSDPEngineWithLMHead``, verl/workers/engine/fsdp/transformer_impl.py) runs
the model, turns its output into per-token log-probs and hands them to the loss function
(``ppo_loss`` from verl/workers/utils/losses.py, bound to the actor's config) after the forward.
The fused-gradient mode needs the loss's inputs while the head runs, so this engine, a subclass
registered in verl's ``EngineRegistry`` under the backend name ``compiled_grpo``, gives them to the
head before the forward. A user sets one line (docs/verl.md)::

    actor_rollout_ref.actor.strategy=compiled_grpo

(the reference model follows: verl's ref.yaml reads the actor's strategy). Per micro-batch:

- training with verl's ``ppo_loss`` under settings ``verl_config.grpo_config`` maps: the advantages,
  old / reference log-probs, rollout IS weights and response mask are scattered onto the model's
  packed positions (the positions verl's own ``no_padding_2_padding`` reads), and the head computes
  ``grpo_loss`` with ``gradient_mode="fused"``: the logits once (6NHV), the prompt and masked rows
  skipped on the device. verl's ``ppo_loss`` still runs on the detached log-probs, for its metrics
  (pg_clipfrac, ppo_kl, ...) exactly as verl computes them; its value is not used for the gradient.
- anything else (forward-only log-probs, another loss function, a setting the mapping does not
  take, Ulysses sequence parallelism, distillation): the head returns the log-probs and entropy of
  ``cg.token_logprobs``, what the fused-kernel backend returns (verl.py), and verl's loss runs on
  them as in verl's own engine. A training micro-batch that falls back logs why, once per reason.

The old log-probs verl computes with this engine are the same bits the fused loss computes
(log-probs are bitwise independent of the batch and of the gradient mode), so the on-policy ratio
is exactly 1.

verl's normalizers: token-mean divides by the global ``batch_num_tokens`` times ``dp_size``; that
is grpo_loss's ``num_items_in_batch`` (divided by the world size, which is the DP size without
sequence parallelism). The sequence means divide by ``global_batch_size`` times ``dp_size``, where
grpo_loss divides by the micro-batch's sequence count S: the loss is scaled by S * dp_size /
global_batch_size (a constant: the fused mode scales its stored gradients by it).

verl's FSDP engine branches on ``engine_config.strategy == "fsdp" / "fsdp2"`` where it wraps the
model (``_build_fsdp_module``, and ``enable_activation_offloading`` asserts those names): this
engine is FSDP2 and presents ``fsdp2`` there. ``FSDPEngineConfig.__post_init__`` asserts the
strategy is fsdp / fsdp2 / fsdp_turbo; the actor's strategy reaches the engine config after that
check (``ActorConfig.__post_init__`` copies it with ``object.__setattr__``), so the actor-level
setting is the one that works.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import types
from typing import Any, Callable, NamedTuple, Optional

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils import losses as verl_losses
from verl.workers.utils.padding import no_padding_2_padding

import compiled_grpo as cg
from compiled_grpo import fused as _fused
from compiled_grpo.integrations import verl as cg_verl
from compiled_grpo.integrations.verl_config import grpo_config

BACKEND = "compiled_grpo"
_log = logging.getLogger(__name__)
_logged: set = set()
# the loss inputs verl's ppo_loss reads from the micro-batch ([B, R], response positions)
_LOSS_FIELDS = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob")


def _fall_back(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        _log.warning("compiled_grpo engine: verl's loss on the log-probs (recompute op) for this "
                     "micro-batch, not the fused-gradient loss: %s", reason)


class _Packed(NamedTuple):
    """The loss inputs on the model's positions [L]: the mask, the per-token tensors by verl's
    field name, and R (the response positions' padded width, verl's horizon for
    seq-mean-token-sum-norm)."""
    mask: torch.Tensor
    values: dict
    response_length: int


def _to_positions(micro_batch, length: int) -> _Packed:
    """verl's [B, R] response-position tensors scattered onto the model's packed positions [L]
    (remove-padding: the sequences' valid tokens end to end, prompt first). The positions are the
    ones verl's own no_padding_2_padding reads a response's log-prob from (its input arange + 1,
    so its zero padding marks a position past a response); the rest, the static pad of
    ``pad_to_length`` included, are masked."""
    n = micro_batch["input_ids"].values().shape[0]
    device = micro_batch["input_ids"].values().device
    where = no_padding_2_padding(torch.arange(1, n + 1, device=device), micro_batch)  # [B, R]
    fields = [f for f in _LOSS_FIELDS if f in micro_batch.keys()]
    data = micro_batch.select(*fields).to_padded_tensor()
    slot = torch.where(where > 0, where - 1, length).flatten()        # past the end: a dummy slot
    valid = (where > 0) & data["response_mask"].bool()

    def scatter(x: torch.Tensor, dtype) -> torch.Tensor:
        out = torch.zeros(length + 1, dtype=dtype, device=device)
        return out.scatter_(0, slot, x.to(dtype).flatten())[:length]

    values = {f: scatter(data[f], torch.float32) for f in fields if f != "response_mask"}
    return _Packed(scatter(valid, torch.bool), values, data["response_mask"].shape[-1])


class _FusedHead:
    """The head of one training micro-batch: ``grpo_loss`` in the fused mode inside the lm_head's
    call (FSDP2's hooks unshard the weight and reduce-scatter its gradient); ``loss`` is kept for
    the engine's loss function."""

    def __init__(self, actor, micro_batch, dp_size: int, tokens: int):
        self.actor, self.micro_batch, self.dp_size, self.tokens = actor, micro_batch, dp_size, tokens
        self.loss: Optional[torch.Tensor] = None

    def config(self, temperature: float, response_length: int) -> cg.GRPOConfig:
        entropy = tu.get_non_tensor_data(self.micro_batch, "calculate_entropy", False)
        cfg = grpo_config(self.actor, response_length=response_length, temperature=float(temperature),
                          metrics="with_entropy" if entropy else "none")
        if cfg.entropy_coef:
            # grpo_loss's bonus is the micro-batch's token mean (TRL's); verl's divides the sum by
            # the global batch_num_tokens / dp_size, as its policy term: the coefficient carries
            # the ratio of the two divisors
            items = tu.get_non_tensor_data(self.micro_batch, "batch_num_tokens", None)
            if items is not None:
                cfg = dataclasses.replace(cfg, entropy_coef=cfg.entropy_coef * max(self.tokens, 1)
                                          * self.dp_size / items)
        # sequence-coupled losses (GSPO) fuse only where a whole sequence fits a row block: "auto"
        # recomputes otherwise
        return dataclasses.replace(cfg, gradient_mode="auto" if _fused.sequence_coupled(cfg) else "fused")

    def __call__(self, lm_head, hidden, labels, temperature):
        mb = self.micro_batch
        length = labels.shape[-1]
        packed = _to_positions(mb, length)
        cfg = self.config(temperature, packed.response_length)
        offsets = mb["input_ids"].offsets().to(labels.device)
        cu = torch.cat([offsets[:-1], offsets.new_tensor([length])])   # a static pad joins the last
        num_sequences = offsets.numel() - 1
        gbs = tu.get_non_tensor_data(mb, "global_batch_size", None)
        scale = 1.0
        items = None
        if cfg.loss_type in ("dapo", "cispo"):
            items = tu.get_non_tensor_data(mb, "batch_num_tokens", None)
        elif gbs is not None:
            scale = num_sequences * self.dp_size / gbs
        max_seqlen = (int(offsets.diff().max()) + length - int(offsets[-1])
                      if _fused.sequence_coupled(cfg) else None)
        v = packed.values

        def forward(h):
            out = cg.grpo_loss(h.reshape(length, -1), lm_head.weight, labels.reshape(length),
                               v["advantages"], packed.mask, v["old_log_probs"], v.get("ref_log_prob"),
                               bias=getattr(lm_head, "bias", None), sampling_ratio=v.get("rollout_is_weights"),
                               num_items_in_batch=items, cu_seqlens=cu, max_seqlen=max_seqlen, config=cfg)
            return out.loss * scale, out.logprobs, out.entropy

        # the loss is an output of the head's call and of the model's (verl.py): FSDP2's backward
        # hooks of both see it
        self.loss, logprobs, entropy = cg_verl.in_head_call(lm_head, forward, hidden)
        entropy = entropy.view(labels.shape) if entropy is not None else None
        return logprobs.view(labels.shape), entropy


def _verl_actor_config(loss_function: Callable) -> Any:
    """The actor config bound to verl's ppo_loss (engine_workers.py: partial(ppo_loss, config=...)),
    or None for any other loss function."""
    if isinstance(loss_function, functools.partial) and loss_function.func is verl_losses.ppo_loss:
        return loss_function.keywords.get("config")
    return None


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu", "cpu"])
class CompiledGRPOEngine(FSDPEngineWithLMHead):
    """verl's FSDP2 engine with an LM head whose actor update is grpo_loss's fused mode (module
    docstring)."""

    def _build_module(self):
        module = super()._build_module()
        # the instance's forward, not the class's: verl's apply_monkey_patch replaces the model
        # class's forward, which every other engine in the process would see
        module.forward = types.MethodType(cg_verl.forward_with_compiled_grpo_backend, module)
        module.compiled_grpo_head = None
        self._hf_module = module
        return module

    def _build_fsdp_module(self, module):
        strategy = self.engine_config.strategy
        object.__setattr__(self.engine_config, "strategy", "fsdp2")   # verl branches on the name
        try:
            return super()._build_fsdp_module(module)
        finally:
            object.__setattr__(self.engine_config, "strategy", strategy)

    def _fused_head(self, micro_batch, loss_function) -> Optional[_FusedHead]:
        actor = _verl_actor_config(loss_function)
        if actor is None:
            return _fall_back(f"the loss function is {loss_function!r}, not verl's ppo_loss")
        for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
            if tu.get_non_tensor_data(micro_batch, key, False):
                return _fall_back(f"{key} is set")
        if self.use_ulysses_sp:
            return _fall_back("Ulysses sequence parallelism (the head sees a slice of each sequence)")
        if not tu.get_non_tensor_data(micro_batch, "use_remove_padding", True):
            return _fall_back("use_remove_padding=False (the fused loss takes verl's packed layout)")
        try:
            cfg = grpo_config(actor, response_length=1)
        except ValueError as e:
            return _fall_back(str(e))
        if cfg.importance_sampling_level == "sequence" and "rollout_is_weights" in micro_batch.keys():
            # verl's GSPO-token multiplies each token's term, gradient included, by its weight;
            # grpo_loss's sequence ratio has one gradient per sequence (equal without the weights)
            return _fall_back("loss_mode='gspo' with rollout_is_weights (verl weights each token's "
                              "gradient; compiled_grpo's sequence ratio does not)")
        # the micro-batch's response tokens: a host count, before the tensors move to the device
        tokens = int(micro_batch["response_mask"].sum())
        return _FusedHead(actor, micro_batch, self.get_data_parallel_size(), tokens)

    def forward_step(self, micro_batch, loss_function, forward_only):
        # the model's output is always (log_probs, entropy) from the head: verl's fused-kernel
        # branch of prepare_model_inputs / prepare_model_outputs
        tu.assign_non_tensor(micro_batch, use_fused_kernels=True)
        head = None if forward_only or loss_function is None else self._fused_head(micro_batch, loss_function)
        if head is not None:   # what verl's forward_step does first; the head reads the same tensors
            micro_batch = head.micro_batch = micro_batch.to(get_device_id())
        if head is None:
            return super().forward_step(micro_batch, loss_function, forward_only)

        def fused_loss(model_output, data, dp_group=None):
            with torch.no_grad():   # verl's metrics, from verl's own loss on the detached log-probs
                _, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            return head.loss, metrics

        self._hf_module.compiled_grpo_head = head
        try:
            return super().forward_step(micro_batch, fused_loss, forward_only)
        finally:
            self._hf_module.compiled_grpo_head = None
