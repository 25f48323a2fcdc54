"""token_logprobs: per-token log-prob (and entropy) from hidden states and the lm_head weight.

Shape legend: B batch, T positions, H hidden, V vocab. Logits [B, T, V] are never materialized:
this calls ``torch.ops.compiled_grpo.linear_logprobs`` (Triton on CUDA, a chunked PyTorch loop
elsewhere). Call it under ``torch.no_grad()`` for old/ref log-probs: a row's log-prob is bitwise
independent of the batch it is computed in (docs/exactness.md), so the on-policy ratio is
exactly 1 at every token.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from compiled_grpo import distributed as _tp
from compiled_grpo._checks import (INT_DTYPES, LM_HEAD_DTYPES, check_cu_seqlens, check_lm_head, check_tensor, check_token_ids,
                                   mask_to_bool)
from lowerings.linear_logprobs import LinearLogprobs as TokenLogprobs
from lowerings.linear_logprobs import linear_logprobs


def check_packed_hidden(hidden) -> None:
    """With cu_seqlens, hidden is [N, H] or HF's packed batch [1, N, H]."""
    if hidden.dim() not in (2, 3) or (hidden.dim() == 3 and hidden.shape[0] != 1):
        raise ValueError(f"hidden must have shape [N, H] or [1, N, H] (a packed batch) when cu_seqlens is given, "
                         f"got {tuple(hidden.shape)}")


def _prepare(hidden, weight, token_ids, bias, mask, temperature, cu_seqlens=None, vocab_size=None):
    """vocab_size: the ids' upper bound, weight.shape[0] by default (the global V under TP; inf for
    uneven TP shards, whose range is checked after the gather)."""
    check_lm_head(hidden, weight, bias)
    if cu_seqlens is not None:
        check_packed_hidden(hidden)
        check_cu_seqlens(cu_seqlens, hidden.shape[-2], hidden.device)
    check_tensor("token_ids", token_ids, dtypes=INT_DTYPES, device=hidden.device)
    if tuple(token_ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"token_ids must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(token_ids.shape)}")
    if (not isinstance(temperature, (int, float, torch.SymInt, torch.SymFloat)) or isinstance(temperature, bool)
            or not temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if mask is None:
        valid = torch.ones_like(token_ids, dtype=torch.bool)
    else:
        check_tensor("mask", mask, device=hidden.device)
        if tuple(mask.shape) != tuple(token_ids.shape):
            raise ValueError(f"mask must have the shape of token_ids {tuple(token_ids.shape)}, got {tuple(mask.shape)}")
        valid = mask_to_bool(mask)
    check_token_ids(token_ids, weight.shape[0] if vocab_size is None else vocab_size, valid)
    # Masked positions may hold padding ids such as -100: read row 0 there instead. A bad id at a
    # valid position is clamped too: where the check above is a device assert (compiled, CUDA)
    # the computation still runs, and an out-of-range gather inside Inductor's parallel CPU
    # loops aborted the process (std::terminate) instead of raising the assert's RuntimeError.
    bound = weight.shape[0] if vocab_size is None else vocab_size
    ids = torch.where(valid, token_ids, 0).long()
    if bound != float("inf"):
        ids = ids.clamp(0, bound - 1)
    return ids, valid


# Bounds of the logits' scale factors (s / T; s / c and c / T with a cap c): within them a logit
# a * s / T stays a finite fp32 number for any |a| < 2^27 (fp32 max ~2^128), and no factor
# flushes to 0. Real heads use factors within [1e-2, 1e2].
SCALE_MIN, SCALE_MAX = 2.0 ** -100, 2.0 ** 100


def check_model_scaling(logit_scale, final_logit_softcapping, temperature=None) -> None:
    """logit_scale a finite number > 0; final_logit_softcapping None or a finite number > 0; with
    a temperature (already checked > 0), the logits' scale factors within [SCALE_MIN, SCALE_MAX]."""
    def real(x):   # x > 0 and x < inf, not math.isfinite: a dynamic=True compile passes SymFloats
        return (isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)
                and 0 < x < math.inf)
    if not real(logit_scale):
        raise ValueError(f"logit_scale must be a finite number > 0, got {logit_scale!r}")
    if final_logit_softcapping is not None and not real(final_logit_softcapping):
        raise ValueError(f"final_logit_softcapping must be None or a finite number > 0, "
                         f"got {final_logit_softcapping!r}")
    if temperature is None:
        return
    # The kernels and bodies scale fp32 logits by s / T (and by s / c, c / T with a cap): a
    # factor past SCALE_MAX overflows the logits to inf (NaN everywhere), one under SCALE_MIN
    # flushes them toward 0 (a silently uniform softmax).
    factors = [("logit_scale / temperature", logit_scale / temperature)]
    if final_logit_softcapping is not None:
        factors += [("logit_scale / final_logit_softcapping", logit_scale / final_logit_softcapping),
                    ("final_logit_softcapping / temperature", final_logit_softcapping / temperature)]
    for what, f in factors:
        if not SCALE_MIN <= f <= SCALE_MAX:
            raise ValueError(f"temperature, logit_scale and final_logit_softcapping must keep {what} "
                             f"within [2^-100, 2^100] (fp32 logits stay finite), got {f!r} "
                             f"(temperature={temperature!r}, logit_scale={logit_scale!r}, "
                             f"final_logit_softcapping={final_logit_softcapping!r})")


def token_logprobs(hidden: Tensor, weight: Tensor, token_ids: Tensor, bias: Optional[Tensor] = None, *,
                   mask: Optional[Tensor] = None, temperature: float = 1.0, fp32_lm_head: bool = False,
                   with_entropy: bool = False, cu_seqlens: Optional[Tensor] = None, tp_group=None,
                   vocab_start: Optional[int] = None, logit_scale: float = 1.0,
                   final_logit_softcapping: Optional[float] = None,
                   round_logits: bool = False, lm_head_dtype: Optional[torch.dtype] = None
                   ) -> TokenLogprobs:
    """log_softmax((hidden @ weight.T + bias) / temperature)[token_ids], without the logits.

    Model scalings under HF / TRL's names (Cohere / Granite-style ``logit_scale``, Gemma 2/3's
    ``final_logit_softcapping`` c), applied in HF's order before the temperature:
    ``z = (hidden @ weight.T + bias) * logit_scale``, then ``c * tanh(z / c)``, then ``/ temperature``.

    hidden [..., H], weight [V, H], token_ids [...]; returns ``TokenLogprobs(logprobs, entropy, lse)``,
    each [...] fp32 (fp64 for fp64 inputs), entropy None unless ``with_entropy``. With ``mask``,
    masked positions may hold any id and report logprob/entropy/lse 0 (the op skips those rows:
    no FLOPs on CUDA, no gradient). Differentiable in hidden, weight and bias.

    Packed inputs (``cu_seqlens`` [S + 1] int32/int64, 0 first, N last): hidden [N, H] or
    [1, N, H], token_ids and mask [N] or [1, N]; outputs take token_ids' shape. A token's
    log-prob does not depend on where its sequence starts, so ``cu_seqlens`` is checked (shape,
    dtype; values in eager CPU code, a device assert elsewhere) and otherwise unused.

    Vocab-parallel TP (``tp_group``, compiled_grpo/distributed.py): weight [V_r, H] and bias [V_r]
    are this rank's contiguous vocab shard, ranks in order, an even split unless ``vocab_start``
    (this rank's first id) or a DTensor weight (Shard(0) on a 1-D mesh) says otherwise; hidden and
    the global token_ids are the same on every rank. Outputs are the full-vocab values, identical
    on every rank; grads: the full d_hidden on every rank, each rank's d_weight/d_bias shard.
    """
    shard = None
    if tp_group is not None or vocab_start is not None or _tp.is_dtensor(weight):
        shard = _tp.vocab_shard(weight, bias, tp_group, vocab_start)
        weight, bias = shard.weight, shard.bias
    ids, valid = _prepare(hidden, weight, token_ids, bias, mask, temperature, cu_seqlens,
                          vocab_size=None if shard is None else shard.vocab_size or float("inf"))
    check_model_scaling(logit_scale, final_logit_softcapping, temperature)
    if not isinstance(round_logits, bool):
        raise TypeError(f"round_logits must be a bool, got {type(round_logits).__name__}")
    if lm_head_dtype not in LM_HEAD_DTYPES:
        raise ValueError(f"lm_head_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, "
                         f"got {lm_head_dtype!r}")
    scaling = dict(logit_scale=float(logit_scale), final_logit_softcapping=final_logit_softcapping,
                   round_logits=round_logits, compute_dtype=lm_head_dtype)
    # row_mask: masked rows cost no FLOPs on CUDA (padding or prompt tokens) and get no gradient.
    row_mask = None if mask is None else valid.reshape(-1)
    if shard is None:
        out = linear_logprobs(hidden, weight, ids, bias, temperature=float(temperature), fp32_lm_head=fp32_lm_head,
                              with_entropy=with_entropy, row_mask=row_mask, **scaling)
    else:
        out = _tp.tp_linear_logprobs(hidden, shard, ids, temperature=float(temperature), fp32_lm_head=fp32_lm_head,
                                     with_entropy=with_entropy, row_mask=row_mask, **scaling)
    if mask is None:
        return out
    # The op already zeroes masked rows; this select is one cheap elementwise pass that keeps the
    # outputs' contract (0 at masked positions) independent of the op's backends.
    ent = None if out.entropy is None else torch.where(valid, out.entropy, 0)
    return TokenLogprobs(torch.where(valid, out.logprobs, 0), ent, out.lse)
