"""verl 0.9: compiled_grpo's op as the fused log-prob backend of the actor and the reference.

verl gets the per-token log-probs and entropy from the model's forward when
``actor_rollout_ref.model.use_fused_kernels=True``: its ``apply_monkey_patch``
(verl/models/transformers/monkey_patch.py) replaces the HF model class's forward by
``forward_with_torch_backend`` or ``forward_with_triton_backend`` (verl/models/transformers/
dense_common.py), chosen by ``fused_kernel_options.impl_backend``. This module adds a third
backend, ``compiled_grpo``; a user sets (docs/verl.md)::

    actor_rollout_ref.model.use_fused_kernels=True
    +actor_rollout_ref.model.fused_kernel_options.impl_backend=compiled_grpo

and the forward returns verl's ``CausalLMOutputForPPO(log_probs, entropy)`` from
``cg.token_logprobs``: no [tokens, vocab] logits, log-probs bitwise independent of the
micro-batch (old and current log-probs equal on-policy whatever the micro-batch sizes), the
temperature as verl passes it, remove-padding's packed [1, total_nnz] inputs as they come.

How it gets in: compiled_grpo declares this module in verl's ``verl.plugins`` entry-point group,
which ``import verl`` loads in every process (the trainer and its Ray workers); importing it
wraps ``monkey_patch.patch_forward_with_backends`` (``install``), which ``apply_monkey_patch``
calls by that name. Where plugins are off (``VERL_USE_EXTERNAL_PLUGINS=none``) set
``actor_rollout_ref.model.external_lib=compiled_grpo.integrations.verl`` instead (verl imports
it in the workers). Models: the dense causal LMs of dense_common (Qwen2 / Qwen3 / Llama ...);
verl's vision-language forwards are left to verl's backends (NotImplementedError names them).

FSDP2: the op runs inside the lm_head module's own call (``head_logprobs``), so FSDP2's hooks
unshard its weight (an untied head wrapped on its own too: verl#7427's
``'FSDPParam' object has no attribute '_unsharded_param'`` came from reading
``lm_head.weight`` outside them) and reduce-scatter its gradient in the backward.
"""
from __future__ import annotations

import logging

import torch

import compiled_grpo as cg

BACKEND = "compiled_grpo"
# verl's own forwards for these model classes (monkey_patch.patch_forward_with_backends)
_VL_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5")
_log = logging.getLogger(__name__)


def in_head_call(lm_head: torch.nn.Module, fn, hidden: torch.Tensor):
    """``fn(hidden)`` run as ``lm_head``'s own call (its forward swapped for the call's duration),
    so that module hooks, FSDP2's unshard and post-backward among them, see a forward of the
    head while ``fn`` reads ``lm_head.weight``."""
    lm_head.forward = fn
    try:
        return lm_head(hidden)
    finally:
        del lm_head.forward


def head_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) of ``labels`` [...] under ``lm_head(hidden)`` [..., V] / temperature,
    each [...] fp32, computed by cg.token_logprobs inside ``lm_head``'s own call."""
    def forward(h):
        out = cg.token_logprobs(h, lm_head.weight, labels, getattr(lm_head, "bias", None),
                                temperature=float(temperature), with_entropy=True)
        return out.logprobs, out.entropy

    return in_head_call(lm_head, forward, hidden)


def forward_with_compiled_grpo_backend(self, input_ids=None, attention_mask=None, position_ids=None,
                                       past_key_values=None, inputs_embeds=None, labels=None,
                                       use_cache=None, output_attentions=None,
                                       output_hidden_states=None, return_dict=None,
                                       cache_position=None, logits_to_keep=0, temperature: float = 1.0,
                                       shift_labels=None, **loss_kwargs):
    """verl's ``forward_with_torch_backend`` (dense_common.py, 0.9.1) with the log-probs and
    entropy from compiled_grpo: the same arguments, the same label roll (``shift_labels`` first,
    then ``labels``, then ``input_ids``, rolled by -1), the same output."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    outputs = forward_base_model(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 output_attentions=output_attentions,
                                 output_hidden_states=output_hidden_states,
                                 cache_position=cache_position)
    if not return_dict:
        raise NotImplementedError("forward_with_compiled_grpo_backend has to return_dict")
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise RuntimeError("forward_with_compiled_grpo_backend needs labels, shift_labels or input_ids")
    # compiled_grpo's verl engine (verl_engine.py) sets a head of its own per micro-batch: the loss
    # in the fused-gradient mode; otherwise the log-probs and entropy
    head = getattr(self, "compiled_grpo_head", None) or head_logprobs
    log_probs, entropy = head(self.lm_head, outputs[0], rolled.to(torch.int64), temperature)
    # the fused loss leaves through the model's output: FSDP2 hooks the root module's outputs to
    # unshard the root's own parameters (the final norm's) for the backward, which starts there
    return CausalLMOutputForPPO(loss=getattr(head, "loss", None), log_probs=log_probs, entropy=entropy,
                                past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def install() -> None:
    """Make ``fused_kernel_options.impl_backend=compiled_grpo`` choose
    forward_with_compiled_grpo_backend in verl's apply_monkey_patch (idempotent)."""
    from verl.models.transformers import monkey_patch as mp

    original = mp.patch_forward_with_backends
    if getattr(original, "_compiled_grpo", False):
        return

    def patch_forward_with_backends(model, use_fused_kernels: bool = False,
                                    fused_kernels_backend: str = None):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return original(model, use_fused_kernels=use_fused_kernels,
                            fused_kernels_backend=fused_kernels_backend)
        model_type = getattr(model.config, "model_type", None)
        if model_type in _VL_MODELS:
            raise NotImplementedError(
                f"fused_kernels_backend={BACKEND!r} covers verl's dense causal LMs; "
                f"{model.__class__.__name__} ({model_type}) has verl's own vision-language forward: "
                f"use impl_backend 'torch' or 'triton' for it")
        model._verl_fused_kernels_backend = BACKEND
        model.__class__.forward = forward_with_compiled_grpo_backend
        print(f"Using compiled_grpo backend for fused kernels in {model.__class__.__name__}")

    patch_forward_with_backends._compiled_grpo = True
    patch_forward_with_backends.__wrapped__ = original
    mp.patch_forward_with_backends = patch_forward_with_backends


try:   # imported as verl's plugin (or external_lib): register the backend now
    install()
except ImportError as e:   # verl (or what its monkey_patch imports) absent: say so, loudly
    _log.warning("compiled_grpo.integrations.verl: verl's monkey_patch did not import (%s); the "
                 "'compiled_grpo' fused-kernel backend is not registered", e)

try:   # verl's engine registry: strategy=compiled_grpo (verl_engine.py)
    from compiled_grpo.integrations import verl_engine  # noqa: F401,E402
except ImportError as e:
    _log.warning("compiled_grpo.integrations.verl: verl's FSDP engine did not import (%s); the "
                 "'compiled_grpo' engine strategy is not registered", e)
