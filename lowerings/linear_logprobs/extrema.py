"""`compiled_grpo::linear_logits_extrema`: each row's least and greatest logit of a linear head,
without the [N, V] logits.

Legend: N tokens, H hidden size, V vocab size, C vocab columns a chunk.

    a        = hidden @ weight.T + bias        # [N, C] a chunk, in the operands' dtype (F.linear)
    z        = f(a), f(a) = cap * tanh(a * logit_scale / cap) / temperature
               (a * logit_scale / temperature without a cap: the op's z, op.py)
    (lo, hi) = (z.amin(-1), z.amax(-1))        # [N] fp32

What the naive-fusion pass emits for logits min / max read as metrics beside the log-probs
(`logits.detach().min(-1)`, `.amax(-1)`, `.max()` under `torch.no_grad()`:
naive_fusion/extrema.py). The GEMM runs in the operands' dtype with its output in that dtype, as
the user's `h @ W.T` did (a bf16 head: bf16 logits, so the extremum is the user's bf16 value up
to the GEMM's summation order), not the log-prob op's fp32 accumulation.

f is applied to the [N] extrema of a, not to the tiles: each step of f (a multiply by a positive
constant, tanh, a division by a positive constant, each rounded) is non-decreasing, so
min_v f(a_v) = f(min_v a_v) exactly, and the chunk loop reads each [N, C] tile once (one amin,
one amax). NaN propagates as in torch's amin / amax; a -inf logit (a banned token) is a row's
min as it is the user's.

Cost: one forward GEMM of the rows more (2 N H V FLOPs, every row: the user's metric reads the
padded rows too), in vocab chunks of at most WS_BYTES of logits; no gradient (the pass emits it
for detached or no-grad values only, and the wrapper detaches its inputs).
"""
from typing import Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs.cpu import scale_logits
from lowerings.linear_logprobs.op import upcast_lm_head

# Bytes of one [N, C] chunk of logits in the operands' dtype; C at least MIN_COLS (a GEMM that
# keeps the tensor cores busy), at most V. Tests lower it to run several chunks on tiny shapes.
WS_BYTES = 256 << 20
MIN_COLS = 256


@torch.library.custom_op("compiled_grpo::linear_logits_extrema", mutates_args=())
def _extrema_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float,
                logit_scale: float, softcap: Optional[float]) -> tuple[Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] -> (min, max) [N] fp32 of z (module docstring).
    Opaque under torch.compile: its body runs eagerly, so the chunk loop has the real N."""
    dt = torch.promote_types(hidden.dtype, weight.dtype)
    n, v = hidden.shape[0], weight.shape[0]
    lo = hidden.new_full((n,), float("inf"), dtype=dt)
    hi = hidden.new_full((n,), float("-inf"), dtype=dt)
    cols = min(v, max(MIN_COLS, WS_BYTES // max(1, n * torch.finfo(dt).bits // 8)))
    h, w = hidden.to(dt), weight.to(dt)
    b = None if bias is None else bias.to(dt)
    # the pass made autocast's casts explicit: the GEMM runs in the dtype it was given
    with torch.autocast(hidden.device.type, enabled=False):
        for v0 in range(0, v, cols):
            a = torch.nn.functional.linear(h, w[v0:v0 + cols], None if b is None else b[v0:v0 + cols])
            lo = torch.minimum(lo, a.amin(-1))
            hi = torch.maximum(hi, a.amax(-1))
    return tuple(scale_logits(x.float(), temperature, logit_scale, softcap)[0] for x in (lo, hi))


@_extrema_op.register_fake
def _(hidden, weight, bias, temperature, logit_scale, softcap):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(2))


def linear_logits_extrema(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                          temperature: float = 1.0, fp32_lm_head: bool = False,
                          logit_scale: float = 1.0,
                          final_logit_softcapping: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """hidden [..., H], weight [V, H], bias [V] -> (min, max) [...] fp32 of each row's logits z
    (linear_logprobs' z for the same arguments), detached. fp32_lm_head: the GEMM in fp32 over
    16-bit inputs (upcast_lm_head), else in the operands' dtype."""
    if fp32_lm_head:
        hidden, weight, bias, _ = upcast_lm_head(hidden, weight, bias)
    lead = hidden.shape[:-1]
    lo, hi = _extrema_op(hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach(),
                         None if bias is None else bias.detach(), float(temperature),
                         float(logit_scale),
                         None if final_logit_softcapping is None else float(final_logit_softcapping))
    return lo.view(lead), hi.view(lead)
