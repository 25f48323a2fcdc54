"""`compiled_grpo::linear_logprobs`: per-token log-probs, entropy and lse of a linear head,
without ever materializing the [N, V] logits.

Legend: N = B*T tokens (dynamic), H hidden size, V vocab size.

    a        = (hidden @ weight.T + bias) * logit_scale          # [N, V], never stored
    z        = cap * tanh(a / cap) / temperature                  # a / temperature without a cap
    lse      = z.logsumexp(-1)                                    # [N] fp32
    logprobs = z.gather(-1, ids[:, None])[:, 0] - lse             # [N] fp32
    entropy  = lse - (z.softmax(-1) * z).sum(-1)                  # [N] fp32

Two `torch.library.triton_op`s joined by `register_autograd` (research/inductor-apis.md §1):
the forward returns (logprobs, entropy, lse); the backward takes their three grads (None grads
become zeros) and returns (d_hidden, d_weight, d_bias). lse is differentiable
(d lse / dz = softmax(z)), so a z-loss on it gets the right gradient. When with_entropy=False the
entropy slot holds zeros (not computed; the kernels skip that work) and its grad is ignored.

Each op body branches on `hidden.device.type`, settled at trace time because fake tensors keep
their device: CUDA launches the Triton kernels of `recompute/dense.py` / `recompute/rows.py` through
`launch.declared`: eager, a plain launch; traced, by default the whole CUDA body is one opaque
custom op (`compiled_grpo::linear_logprobs_cuda`, `_cuda_backward`) that runs eager's launches
at run time, its fake the body on fake tensors (tuning.TRACE_LAUNCHES: per-launch nodes cost ~35 us
of dispatch each, 2x the eager step at qwen2.5-0.5b); with TRACE_LAUNCHES, one mutable custom op
per launch whose mutated buffers are what the kernel declares it writes (not wrap_triton, whose
inferred writes dropped dW launches: launching/traced.py); every other device runs the chunked pure-PyTorch body of `cpu.py`, which
Inductor compiles like any aten code.
Neither path allocates an [N, V] tensor (see those modules for workspace sizes), and neither
reads a tensor value on the host, so dynamic N compiles once. Mark N dynamic on hidden and ids
alike (the outputs are viewed as ids.shape, so a static hidden would specialize ids' N and
`mark_dynamic(ids, 0)` then raises ConstraintViolationError); note that `x.clone()` drops a mark.

The recompute op's measurements and what moved them: bench/results/HISTORY.md ("The recompute
op's design measurements"). Compile caches do not key on tuning.TMA: see there.
Padded rows (`row_mask`, what token_logprobs / grpo_loss pass for their mask): on CUDA the op
runs recompute/rows.py, valid rows compacted first on the device and every kernel stopping at a device
count: no FLOP and no host sync for padding.
Numerics (tests/test_linear_logprobs_gpu.py, N=1024, full head): error vs an fp32 upcast
reference <= 2x that of eager bf16 for logprobs, entropy, d_hidden, d_weight, d_bias; bitwise
deterministic across runs.

Gradients: d_weight only when weight requires grad (frozen / LoRA heads pay no dW GEMM), same for
bias and hidden (`ctx.needs_input_grad`). Grads come back in the inputs' dtypes.
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.library import triton_op

from lowerings.linear_logprobs import cpu as _torch_impl
from lowerings.linear_logprobs import tuning
from lowerings.linear_logprobs.launching.traced import _tracing as _launch_tracing
from lowerings.linear_logprobs.launching.traced import declared


class LinearLogprobs(NamedTuple):
    logprobs: Tensor            # [...] fp32, differentiable
    entropy: Optional[Tensor]   # [...] fp32, differentiable; None unless with_entropy=True
    lse: Tensor                 # [...] fp32, differentiable (d lse / dz = softmax(z))


def _on_cuda(hidden: Tensor) -> bool:
    return hidden.device.type == "cuda"


def _rows_path(hidden: Tensor, row_mask: Optional[Tensor]) -> bool:
    """The row-masked CUDA path (recompute/rows.py) for a row mask on CUDA with 16/32-bit operands;
    fp64 on CUDA computes every row (then zeroes the padded ones), as the CPU body does."""
    return row_mask is not None and _on_cuda(hidden) and hidden.element_size() <= 4


def _mask_rows(row_mask: Optional[Tensor], *vectors: Tensor) -> tuple[Tensor, ...]:
    """[N] vectors with the padded rows set to 0 (outputs there, or incoming grads there)."""
    if row_mask is None:
        return vectors
    return tuple(torch.where(row_mask, t, 0) for t in vectors)


@triton_op("compiled_grpo::linear_logprobs", mutates_args=())
def _linear_logprobs_op(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
                        temperature: float, fp32_lm_head: bool, with_entropy: bool,
                        row_mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                        final_logit_softcapping: Optional[float] = None,
                        round_logits: bool = False, compute_dtype: Optional[torch.dtype] = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], ids [N] int64, bias [V], row_mask [N] bool ->
    (logprobs, entropy, lse) [N], 0 at rows where row_mask is False. fp32_lm_head: hidden and
    weight are fp32 casts of bf16 tensors (linear_logprobs passes upcast_lm_head's exact_tf32):
    fewer TF32 products on CUDA (tuning.logits_precision); the CPU body multiplies in fp32."""
    if _on_cuda(hidden):
        body = _cuda_forward if _opaque(hidden) else _cuda_forward_body
        return body(hidden, weight, ids, bias, row_mask, temperature, fp32_lm_head, with_entropy,
                    logit_scale, final_logit_softcapping, round_logits, compute_dtype)
    out = _cpu_forward(hidden, weight, ids, bias, temperature, with_entropy, logit_scale,
                       final_logit_softcapping, round_logits, compute_dtype)
    return _mask_rows(row_mask, *out)


def _opaque(hidden: Tensor) -> bool:
    """Whether a CUDA body runs as its opaque custom op: inside a trace (tuning.TRACE_LAUNCHES)."""
    return not tuning.TRACE_LAUNCHES and _launch_tracing([hidden])


def _cuda_forward_body(hidden, weight, ids, bias, row_mask, temperature, fp32_lm_head, with_entropy,
                       logit_scale, softcap, round_logits, compute_dtype):
    """The CUDA forward: row-masked (recompute/rows.py) or dense (recompute/dense.py)."""
    scaling = dict(logit_scale=logit_scale, softcap=softcap, round_logits=round_logits,
                   compute_dtype=compute_dtype)
    if _rows_path(hidden, row_mask):
        from lowerings.linear_logprobs.recompute import rows as cuda_rows
        return cuda_rows.forward(hidden, weight, ids, bias, row_mask, temperature, fp32_lm_head,
                                 with_entropy, wrap=declared, **scaling)
    from lowerings.linear_logprobs.recompute import dense as _dense
    out = _dense.forward(hidden, weight, ids, bias, temperature, fp32_lm_head,
                         with_entropy, wrap=declared, **scaling)
    return _mask_rows(row_mask, *out)


@torch.library.custom_op("compiled_grpo::linear_logprobs_cuda", mutates_args=())
def _cuda_forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
                  row_mask: Optional[Tensor], temperature: float, fp32_lm_head: bool,
                  with_entropy: bool, logit_scale: float, softcap: Optional[float],
                  round_logits: bool, compute_dtype: Optional[torch.dtype]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """_cuda_forward_body as one opaque node of a traced graph (tuning.TRACE_LAUNCHES): at run
    time the eager launches, after the kernels the trace handed to the precompile workers."""
    _precompile_wait()
    return _cuda_forward_body(hidden, weight, ids, bias, row_mask, temperature, fp32_lm_head,
                              with_entropy, logit_scale, softcap, round_logits, compute_dtype)


# The fake is the body itself on fake tensors: its outputs' shapes, and each launch traced
# (launching/traced.py), which hands its kernel to the precompile workers.
_cuda_forward.register_fake(_cuda_forward_body)


@torch.library.custom_op("compiled_grpo::linear_logprobs_cpu_forward", mutates_args=())
def _cpu_forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
                 temperature: float, with_entropy: bool, logit_scale: float,
                 softcap: Optional[float], round_logits: bool = False,
                 compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """cpu.forward as an opaque op: under torch.compile Inductor calls it as it is instead of
    regenerating its exp / sum loops, so compiled and eager log-probs are the same bits (the
    batch invariance of cpu.py's docstring). Its backward is the recompute op's (traced)."""
    return _torch_impl.forward(hidden, weight, ids, bias, temperature, with_entropy,
                               logit_scale=logit_scale, softcap=softcap, round_logits=round_logits,
                               compute_dtype=compute_dtype)


@_cpu_forward.register_fake
def _(hidden, weight, ids, bias, temperature, with_entropy, logit_scale, softcap, round_logits=False,
      compute_dtype=None):
    dt = _torch_impl._compute_dtype(*_torch_impl.operands(hidden, weight, None, compute_dtype)[:2])
    return tuple(hidden.new_empty(hidden.shape[0], dtype=dt) for _ in range(3))


@triton_op("compiled_grpo::linear_logprobs_backward", mutates_args=())
def _linear_logprobs_backward_op(
        hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
        entropy: Tensor, grad_logprobs: Tensor, grad_entropy: Tensor, grad_lse: Tensor,
        temperature: float, fp32_lm_head: bool, with_entropy: bool, need_hidden: bool,
        need_weight: bool, need_bias: bool, row_mask: Optional[Tensor] = None,
        logit_scale: float = 1.0, final_logit_softcapping: Optional[float] = None,
        round_logits: bool = False, compute_dtype: Optional[torch.dtype] = None
        ) -> tuple[Tensor, Tensor, Tensor]:
    """-> (d_hidden [N, H], d_weight [V, H], d_bias [V]); a [0]-shaped tensor where not needed.
    Rows where row_mask is False contribute nothing (their incoming grads are ignored)."""
    if _on_cuda(hidden):
        body = _cuda_backward if _opaque(hidden) else _cuda_backward_body
        return body(hidden, weight, ids, bias, lse, entropy, grad_logprobs, grad_entropy, grad_lse,
                    temperature, fp32_lm_head, with_entropy, need_hidden, need_weight, need_bias,
                    row_mask, logit_scale, final_logit_softcapping, round_logits, compute_dtype)
    scaling = dict(logit_scale=logit_scale, softcap=final_logit_softcapping,
                   round_logits=round_logits, compute_dtype=compute_dtype)
    grad_logprobs, grad_entropy, grad_lse = _mask_rows(row_mask, grad_logprobs, grad_entropy,
                                                       grad_lse)
    return _torch_impl.backward(hidden, weight, ids, bias, lse, entropy, grad_logprobs,
                                grad_entropy, grad_lse, temperature, with_entropy, need_hidden,
                                need_weight, need_bias, row_mask=row_mask, **scaling)


def _cuda_backward_body(hidden, weight, ids, bias, lse, entropy, grad_logprobs, grad_entropy,
                        grad_lse, temperature, fp32_lm_head, with_entropy, need_hidden, need_weight,
                        need_bias, row_mask, logit_scale, softcap, round_logits, compute_dtype):
    """The CUDA backward: row-masked (recompute/rows.py) or dense (recompute/dense.py)."""
    scaling = dict(logit_scale=logit_scale, softcap=softcap, round_logits=round_logits,
                   compute_dtype=compute_dtype)
    if _rows_path(hidden, row_mask):
        from lowerings.linear_logprobs.recompute import rows as cuda_rows
        return cuda_rows.backward(hidden, weight, ids, bias, row_mask, lse, entropy,
                                  grad_logprobs, grad_entropy, grad_lse, temperature,
                                  fp32_lm_head, with_entropy, need_hidden, need_weight,
                                  need_bias, wrap=declared, **scaling)
    grad_logprobs, grad_entropy, grad_lse = _mask_rows(row_mask, grad_logprobs, grad_entropy,
                                                       grad_lse)
    from lowerings.linear_logprobs.recompute import dense as _dense
    return _dense.backward(hidden, weight, ids, bias, lse, entropy, grad_logprobs,
                           grad_entropy, grad_lse, temperature, fp32_lm_head,
                           with_entropy, need_hidden, need_weight, need_bias,
                           wrap=declared, **scaling)


@torch.library.custom_op("compiled_grpo::linear_logprobs_cuda_backward", mutates_args=())
def _cuda_backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
                   entropy: Tensor, grad_logprobs: Tensor, grad_entropy: Tensor, grad_lse: Tensor,
                   temperature: float, fp32_lm_head: bool, with_entropy: bool, need_hidden: bool,
                   need_weight: bool, need_bias: bool, row_mask: Optional[Tensor],
                   logit_scale: float, softcap: Optional[float], round_logits: bool,
                   compute_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    """_cuda_backward_body as one opaque node of a traced graph, as _cuda_forward."""
    _precompile_wait()
    return _cuda_backward_body(hidden, weight, ids, bias, lse, entropy, grad_logprobs, grad_entropy,
                               grad_lse, temperature, fp32_lm_head, with_entropy, need_hidden,
                               need_weight, need_bias, row_mask, logit_scale, softcap, round_logits,
                               compute_dtype)


_cuda_backward.register_fake(_cuda_backward_body)


def _precompile_wait() -> None:
    """The kernels a trace handed to the precompile workers, adopted before the first launch."""
    from lowerings.linear_logprobs.launching import precompile
    precompile.wait()


def _model_scaling(logit_scale: float, softcap: Optional[float], round_logits: bool = False,
                   compute_dtype: Optional[torch.dtype] = None) -> tuple:
    """The trailing (logit_scale, final_logit_softcapping, round_logits, compute_dtype) op
    arguments; none at their defaults (1.0, None, False, None), so plain heads trace to the same
    op calls as before these arguments."""
    if round_logits or compute_dtype is not None:
        return (float(logit_scale), None if softcap is None else float(softcap),
                bool(round_logits), compute_dtype)
    if float(logit_scale) == 1.0 and softcap is None:
        return ()
    return float(logit_scale), None if softcap is None else float(softcap)


def _setup_context(ctx, inputs, output):
    (hidden, weight, ids, bias, temperature, fp32_lm_head, with_entropy, row_mask, scale, cap,
     round_logits, compute_dtype) = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, ids, bias, lse, entropy, row_mask)
    ctx.temperature, ctx.fp32_lm_head, ctx.with_entropy = temperature, fp32_lm_head, with_entropy
    ctx.logit_scale, ctx.softcap, ctx.round_logits = scale, cap, round_logits
    ctx.compute_dtype = compute_dtype


def _backward(ctx, g_lp, g_ent, g_lse):
    hidden, weight, ids, bias, lse, entropy, row_mask = ctx.saved_tensors
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    need_b = need_b and bias is not None
    zeros = torch.zeros_like(lse)
    g_lp = zeros if g_lp is None else g_lp
    g_ent = zeros if (g_ent is None or not ctx.with_entropy) else g_ent
    g_lse = zeros if g_lse is None else g_lse
    dx, dw, db = _linear_logprobs_backward_op(
        hidden, weight, ids, bias, lse, entropy, g_lp, g_ent, g_lse, ctx.temperature,
        ctx.fp32_lm_head, ctx.with_entropy, need_x, need_w, need_b, row_mask,
        *_model_scaling(ctx.logit_scale, ctx.softcap, ctx.round_logits, ctx.compute_dtype))
    return (dx if need_x else None, dw if need_w else None, None, db if need_b else None,
            None, None, None, None, None, None, None, None)


_linear_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def upcast_lm_head(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """fp32_lm_head's casts -> (hidden, weight, bias, exact_tf32): bf16 / fp16 tensors to fp32
    (autograd casts their grads back); fp32, fp64 and None as they are. exact_tf32: the fp32
    copies of hidden and weight hold bf16 values, 8-bit significands exact in TF32's 10, so the
    CUDA kernels' logits GEMMs take one TF32 product and the dX / dW GEMMs two instead of
    3xTF32's three (tuning.logits_precision, gradient_precision; fp16's 11-bit and fp32's 24-bit
    significands are not). One definition for the op and the fused path."""
    exact = hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    up = tuple(t.float() if t is not None and t.dtype in (torch.bfloat16, torch.float16) else t
               for t in (hidden, weight, bias))
    return up + (exact,)


def linear_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor] = None,
                    *, temperature: float = 1.0, fp32_lm_head: bool = False,
                    with_entropy: bool = False, row_mask: Optional[Tensor] = None,
                    logit_scale: float = 1.0, final_logit_softcapping: Optional[float] = None,
                    round_logits: bool = False,
                    compute_dtype: Optional[torch.dtype] = None) -> LinearLogprobs:
    """hidden [..., H], weight [V, H], ids [...] int64 in [0, V), bias [V] -> LinearLogprobs [...].

    Callers guarantee ids in [0, V) (the loss maps masked positions to 0); no device check here.
    fp32_lm_head (Fast-LLM's name; vLLM's bf16_last_layer_fp32, TRL's cast_lm_head_to_fp32):
    bf16 / fp16 hidden, weight and bias are cast to fp32 before the op (upcast_lm_head), so every
    path runs fp32 operands with fp32-accurate products (CUDA: 3xTF32, tuning.FP32_DOT): the
    logits as before (16-bit products are exact in fp32), but the dlogits workspace and the
    dX / dW GEMMs in fp32 instead of the input dtype, and dW summed over row groups in fp32. The casts' backward returns the grads in the
    inputs' dtypes. Costs an fp32 copy of W (and of dW) and fp32 GEMM speed.

    row_mask [...] bool: rows where it is False are padding. Their logprobs, entropy and lse
    are 0, their incoming grads are ignored and they get zero d_hidden; on CUDA they also cost
    no FLOPs (recompute/rows.py: valid rows ordered first on the device, kernels that stop at a
    device count, no host sync). Elsewhere every row is computed and the padded ones zeroed.

    logit_scale, final_logit_softcapping (HF / TRL names; Cohere-style scaled heads, Gemma 2/3's
    cap): z = c * tanh((hidden @ weight.T + bias) * logit_scale / c) / temperature, c the cap;
    without a cap z = (hidden @ weight.T + bias) * logit_scale / temperature. Callers validate
    them (finite, > 0).
    round_logits: the logits in the operands' 16-bit dtype, as TRL 1.16's head computes them
    under autocast and as vLLM / SGLang sample from them: hidden @ weight.T rounded to bf16 /
    fp16 (and again after adding the bias, itself rounded), then the scale, cap, temperature and
    every statistic in fp32; the logits gradient is rounded to that dtype before the dX / dW
    GEMMs (as it always is on CUDA). No effect with fp32 operands (fp32_lm_head included).
    (The op's own fp32_lm_head argument says more: the fp32 operands it gets are casts of a bf16
    head (upcast_lm_head's exact_tf32), so the CUDA kernels' logits GEMMs take one TF32 product instead of
    3xTF32's three and the dX / dW GEMMs two (tuning.logits_precision, gradient_precision): the
    same products less those of zeros, the same accuracy, not the same bits. fp32_lm_head over
    fp16 or fp32 inputs passes False.)
    compute_dtype: the dtype hidden, weight and bias are multiplied in (None: their common
    dtype), with the grads accumulated in fp32 and returned in the inputs' own dtypes: fp32
    inputs with compute_dtype=torch.bfloat16 are TRL's head under bf16 autocast (fp32 hidden
    states and lm_head, a bf16 GEMM, fp32 grads). Ignored with fp32_lm_head."""
    exact = False
    if fp32_lm_head:
        compute_dtype = None
        hidden, weight, bias, exact = upcast_lm_head(hidden, weight, bias)
    lead = ids.shape
    h = hidden.reshape(-1, hidden.shape[-1])                               # [N, H]
    rm = None if row_mask is None else row_mask.reshape(-1).to(torch.bool)
    lp, ent, lse = _linear_logprobs_op(h, weight, ids.reshape(-1), bias, float(temperature),
                                       exact, bool(with_entropy), rm,
                                       *_model_scaling(logit_scale, final_logit_softcapping,
                                                       round_logits, compute_dtype))
    return LinearLogprobs(lp.view(lead), ent.view(lead) if with_entropy else None,
                          lse.view(lead))
