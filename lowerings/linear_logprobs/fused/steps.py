"""The fused path's two block steps (fused/schedule.py's schedule) as mutable custom ops and their
bodies, and the incoming gradient's scaling of the gradients they store: the Triton body
(fused/blocks.py) on CUDA tensors, the PyTorch body (cpu.py) elsewhere.

Legend: R' rows of a block (its n valid ones first, n = counts[b] on the device), H hidden,
V vocab.
"""
import functools
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lowerings.linear_logprobs import cpu as _cpu
from lowerings.linear_logprobs.device import cdiv, grid_sms
try:   # the Triton side: absent triton (a CPU-only install off Linux) the PyTorch body runs alone
    from lowerings.linear_logprobs.fused import blocks as _fcuda
    from lowerings.linear_logprobs.launching import precompile as _precompile
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    _fcuda = _precompile = None


def _triton_body(t: Tensor) -> bool:
    """The block steps run fused/blocks.py's Triton kernels on CUDA tensors (the interpreter tests
    patch this to run them on CPU tensors), the PyTorch body elsewhere; fused/schedule.py's workspace and
    plan helpers ask it too, so one patch moves the whole schedule."""
    if t.device.type == "cuda" and _fcuda is None:
        raise RuntimeError("compiled_grpo's CUDA kernels need triton (pip install triton==3.6.0)")
    return t.device.type == "cuda"


def block_steps(hidden: Tensor) -> tuple[Callable, Callable]:
    """The two block steps: the custom ops wherever something traces the call (Dynamo, a
    dispatch mode such as make_fx's or functionalization, fake or other tensor subclasses), so
    it sees two opaque, mutating steps; their bodies themselves in plain eager, where the ops'
    dispatcher, autograd, ADInplaceOrView and aliasing-check layers would only cost host time
    (16 calls a step at 8 blocks; a small policy's eager step is host-bound: docs/performance.md)."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or type(hidden) is not Tensor):
        return fused_block_forward, fused_block_backward
    return _block_forward, _block_backward


SCALE_BLOCK = 4096
SCALE_PER_SM = 4     # programs a SM of the scaling kernel's grid-stride grid


def scale_(tensors: list[Tensor], g: Tensor) -> None:
    """t *= g for each (contiguous) t, in place, fp32 math, g a 0-dim tensor: the incoming
    gradient applied to the gradients the blocks stored. Triton body: one pass over each t,
    none when g == 1 (checked on the device: no host sync); a bf16 t.mul_(g) with an fp32 0-dim
    g takes TensorIterator's slow mixed-dtype path instead (3 ms for a 1.2 GiB dW on H100). The
    PyTorch body elsewhere."""
    if not tensors:
        return
    if not _triton_body(tensors[0]):
        torch._foreach_mul_(tensors, g)
        return
    from lowerings.linear_logprobs.kernels.fused_block import _scale_kernel
    g = g.detach().to(torch.float32).reshape(1)
    for t in tensors:
        assert t.is_contiguous()
        programs = SCALE_PER_SM * grid_sms(t.device)
        grid = max(1, min(cdiv(t.numel(), SCALE_BLOCK), programs))
        _scale_kernel[(grid,)](t, g, t.numel(), BLOCK=SCALE_BLOCK, num_warps=8)


@torch.library.custom_op("compiled_grpo::scale_grads_", mutates_args=("tensors",))
def scale_grads_(tensors: list[Tensor], g: Tensor) -> None:
    """scale_ as a mutating custom op: a call bumps the tensors' version counters, so autograd
    refuses a second backward through gradients it already scaled (on CUDA too: scale_'s Triton
    body alone is invisible to autograd). Called by AttachGrads in eager code, and by Inductor's
    code for scale_saved_grads (its lowering): in a traced graph it would be functionalized, and
    Inductor would clone the saved gradients before it."""
    scale_(tensors, g)


@scale_grads_.register_fake
def _(tensors, g):
    return None


@torch.library.custom_op("compiled_grpo::scale_saved_grads", mutates_args=())
def scale_saved_grads(dx: Tensor, saved: list[Tensor], g: Tensor) -> Tensor:
    """-> g * dx (a new tensor, fp32 math; under Inductor dx itself, scaled in place), and each of
    ``saved`` scaled by g in place (scale_: no pass when g == 1): AttachGrads' backward inside a
    compiled graph, where the saved d_hidden / d_weight / d_bias are the backward graph's inputs.
    Declared functional on purpose: as a declared mutation AOTAutograd would functionalize it, and
    Inductor clone the saved gradients first (a graph input nothing copies back to is not
    reinplaced: fx_passes/reinplace.py), a pass over dW (~0.4 ms at qwen3-4b, H200) that eager does
    not make. Inductor lowers it to scale_grads_, a declared write in its own IR, so its scheduler
    orders every other reader of the saved gradients after it (lower_scale_saved_grads); a backend
    that runs the traced graph as it is (aot_eager) meets those readers after the op anyway, since
    they read AttachGrads' outputs. A second backward through the same graph fails autograd's
    saved-tensor version check, as in eager (the bump below, and scale_grads_'s own under Inductor)."""
    out = dx.clone()   # one pass over dX ([N, H]); scale_ skips it too when g == 1 (a bf16
    # dx * fp32 g in PyTorch takes TensorIterator's mixed-dtype path: 0.17 ms at qwen3-4b, H200)
    scale_([out, *saved], g)
    for t in saved:
        torch.autograd.graph.increment_version(t)
    return out


@scale_saved_grads.register_fake
def _(dx, saved, g):
    lower_scale_saved_grads()   # here: plain Python under any trace (Dynamo does not step in)
    return torch.empty_like(dx)


@functools.cache
def lower_scale_saved_grads() -> None:
    """Registers Inductor's lowering of scale_saved_grads: scale_grads_ on dx and the saved
    gradients through Inductor's fallback kernel (a write Inductor's IR declares; nothing
    functionalizes at that level, so nothing is cloned), dx itself the result: the kernels of
    eager's AttachGrads.backward, no more."""
    from torch._inductor import lowering as L
    mutate = L.fallback_handler(torch.ops.compiled_grpo.scale_grads_.default,
                                add_to_fallback_set=False)

    @L.register_lowering(torch.ops.compiled_grpo.scale_saved_grads.default, type_promotion_kind=None)
    def _(dx, saved, g):
        # dX in place too, and returned: the saved d_hidden becomes hidden's gradient as in eager
        # (no [N, H] buffer, and no pass at all when g == 1; an out-of-place g * dx was 0.26 ms at
        # N = 65536, H = 4096 on H200). Nothing else reads it: AttachGrads saved it for this alone.
        mutate([dx, *saved], g)
        return dx


# --- the two block steps as mutable custom ops ------------------------------------------------

def _block_forward(hidden: Tensor, weight: Tensor, ids_p: Tensor, bias: Optional[Tensor],
                   perm: Tensor, counts: Tensor, ws: Tensor, zoff: Tensor, xg: Tensor,
                   b: int, r0: int, rows: int, temperature: float, with_entropy: bool,
                   logit_scale: float, softcap: Optional[float], ref: Tensor, scaled: bool,
                   round_logits: bool = False, exact_tf32: bool = False
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Block b = rows [r0, r0 + rows) of the permuted order: xg <- its hidden rows, ws <- its
    logits (scaled: as e' = exp(z - R*) but at the targets, the references in ref),
    -> (logprobs, entropy, lse) [rows] in that order, 0 past counts[b]. exact_tf32: the fp32
    operands hold bf16 values (tuning.logits_precision; the CPU body's fp32 products are exact
    either way)."""
    if _triton_body(hidden):
        _precompile.wait()   # the kernels the trace handed to the precompile workers
        return _fcuda.block_forward(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, b, r0,
                                    rows, temperature, with_entropy, logit_scale, softcap, ref,
                                    scaled, round_logits, exact_tf32)
    idx = perm.narrow(0, r0, rows)
    x = xg.narrow(0, 0, rows)
    valid = torch.arange(rows, device=x.device) < counts[b]                  # [R']
    # the slots past the block's valid rows read padded rows: zeros, as the Triton body's masked
    # loads, so that garbage there (a nan hidden state) is not in the backward's 0 * x
    x.copy_(hidden.index_select(0, idx).masked_fill(~valid[:, None], 0))     # [R', H]
    zt, ent, lse = _cpu._forward_rows(x, weight, ids_p.narrow(0, r0, rows), bias, temperature,
                                      with_entropy, z_out=ws.narrow(0, 0, rows),
                                      logit_scale=logit_scale, softcap=softcap,
                                      rd=_cpu.round_dtype(weight, weight, round_logits))  # [R']
    return tuple(torch.where(valid, t, 0) for t in (zt - lse, ent, lse))


fused_block_forward = torch.library.custom_op(
    "compiled_grpo::fused_block_forward", mutates_args=("ws", "zoff", "xg", "ref"))(_block_forward)


@fused_block_forward.register_fake
def _(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, b, r0, rows, temperature,
      with_entropy, logit_scale, softcap, ref, scaled, round_logits=False, exact_tf32=False):
    if hidden.device.type == "cuda" and _fcuda is not None:   # its kernels, to the workers
        _precompile.precompile(_fcuda.block_forward, hidden, weight, ids_p, bias, perm, counts,
                               ws, zoff, xg, b, r0, rows, temperature, with_entropy,
                               logit_scale, softcap, ref, scaled, round_logits, exact_tf32)
    dt = torch.float64 if ws.dtype == torch.float64 else torch.float32
    return tuple(hidden.new_empty(rows, dtype=dt) for _ in range(3))


def _block_backward(weight: Tensor, ids_p: Tensor, perm: Tensor, counts: Tensor, ws: Tensor,
                    zoff: Tensor, xg: Tensor, lse: Tensor, ent: Tensor, g_lp: Tensor,
                    g_ent: Tensor, dx: Tensor, dxp: Tensor, dw: Tensor, db: Tensor, b: int,
                    r0: int, rows: int, temperature: float, with_entropy: bool,
                    logit_scale: float, softcap: Optional[float], need_x: bool, need_w: bool,
                    need_b: bool, ref: Tensor, scaled: bool, round_logits: bool = False,
                    exact_tf32: bool = False) -> None:
    """ws <- dlogits of block b's valid rows; dx[perm rows] = ws @ W (dxp: scratch of the
    Triton body's split dX step); dw (+)= ws.T @ xg; db += column sums. Incoming vectors [rows]
    in the block's order. The blocks run from G - 1 down to 0: the first to run stores dW, the
    others add (the Triton body: the first with valid rows stores, decided on the device).
    scaled (Triton body): ws holds e' (fused_block_forward), xg <- c * xg, dx rows scaled by c
    (exp_scaled). exact_tf32: the fp32 operands hold bf16 values (the Triton body's GEMMs:
    tuning.gradient_precision)."""
    if _triton_body(weight):
        _precompile.wait()
        return _fcuda.block_backward(weight, ids_p, perm, counts, ws, zoff, xg, lse, ent, g_lp,
                                     g_ent, dx, dxp, dw, db, b, r0, rows, temperature,
                                     with_entropy, logit_scale, softcap, need_x, need_w, need_b,
                                     ref, scaled, round_logits, exact_tf32)
    cd = ws.dtype
    v = weight.shape[0]
    valid = (torch.arange(rows, device=ws.device) < counts[b])[:, None]      # [R', 1]
    g_lp, g_ent = (torch.where(valid[:, 0], t, 0).to(cd) for t in (g_lp, g_ent))
    zero, lse, ent = torch.zeros_like(g_lp), lse.to(cd), ent.to(cd)          # [R']
    ids_b = ids_p.narrow(0, r0, rows)
    x = xg.narrow(0, 0, rows)                                                # [R', H]
    rd = _cpu.round_dtype(weight, weight, round_logits)   # weight in the operands' dtype here
    acc = x.new_zeros(x.shape) if need_x else None                           # [R', H] dX rows
    first = b == counts.shape[0] - 1   # the first block run (fused_linear_logprobs: last first)
    # Vocab chunks of the workspace: the dlogits and their temporaries are [R', C] tiles, which
    # the budget covers (cpu_tile_cols), not [R', V] copies of the workspace.
    c = cpu_chunk(v)
    for v0 in range(0, v, c):
        v1 = min(v0 + c, v)
        z = ws.narrow(0, 0, rows)[:, v0:v1]                                  # [R', C]
        y = None if softcap is None else z * (temperature / softcap)         # tanh(a s / c)
        cols = torch.arange(v0, v1, device=ws.device)                        # [C]
        dz = _cpu.dlogits(z, y, lse, ent, g_lp, g_ent, zero, ids_b, cols, temperature,
                          with_entropy, logit_scale)
        dz = torch.where(valid, dz, 0)                                       # [R', C]
        if rd is not None:   # the logits gradient in the operands' 16-bit dtype (round_logits)
            dz = dz.to(rd).to(cd)
        if need_x:
            w = weight[v0:v1].to(cd)                                         # [C, H]
            acc.addmm_(dz, torch.where(torch.isinf(w), 0, w))
        if need_w:
            part = dz.T @ x                                                  # [C, H]
            dw[v0:v1].copy_(part) if first else dw[v0:v1].add_(part.to(dw.dtype))
        if need_b:
            db[v0:v1].add_(dz.sum(0).to(db.dtype))
    if need_x:
        # added into the zeros of dx: a row's one valid slot adds its dX, every other slot
        # (padded rows, the slots past N or past a grouped block's rows: perm 0) adds zeros
        dx.index_add_(0, perm.narrow(0, r0, rows), acc.to(dx.dtype))


def cpu_chunk(v: int) -> int:
    """Vocab columns of the CPU backward's [R, C] tiles: half the forward's (cpu.CHUNK_V), so its
    ~6 tiles alive at once stay under the forward's CPU_FWD_TILES full-width ones."""
    return max(1, min(v, _cpu.CHUNK_V // 2))


# [R, CHUNK_V] tiles the CPU body's forward holds at once (_cpu._forward_rows: the logits, exp,
# exp * z and its masked copy), which a fused block's budget covers with its [R, V] workspace
# (fused/schedule.ws_row_bytes); measured by bench/memory.py.
CPU_FWD_TILES = 4


def cpu_tile_cols(v: int) -> int:
    """Columns per workspace row that the CPU body's tiles add to the [R, V] workspace."""
    return CPU_FWD_TILES * min(_cpu.CHUNK_V, v)


fused_block_backward = torch.library.custom_op(
    "compiled_grpo::fused_block_backward",
    mutates_args=("ws", "xg", "dx", "dxp", "dw", "db", "ref"))(_block_backward)


@fused_block_backward.register_fake
def _(weight, ids_p, perm, counts, ws, zoff, xg, lse, ent, g_lp, g_ent, dx, dxp, dw, db, b, r0,
      rows, temperature, with_entropy, logit_scale, softcap, need_x, need_w, need_b, ref,
      scaled, round_logits=False, exact_tf32=False):
    if weight.device.type == "cuda" and _fcuda is not None:
        _precompile.precompile(_fcuda.block_backward, weight, ids_p, perm, counts, ws, zoff, xg,
                               lse, ent, g_lp, g_ent, dx, dxp, dw, db, b, r0, rows, temperature,
                               with_entropy, logit_scale, softcap, need_x, need_w, need_b, ref,
                               scaled, round_logits, exact_tf32)
    return None


class AttachGrads(torch.autograd.Function):
    """loss -> loss, whose backward returns g * (d_hidden, d_weight, d_bias) formed by the
    fused schedule, and g itself to the loss's own graph (grpo_loss's fused mode computes the
    loss from detached log-probs, where that g goes nowhere; the naive-fusion pass's rewrite
    keeps any other gradient path to the loss there: separable.py)."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, dx, dw, db):
        ctx.save_for_backward(dx, dw, db)
        ctx.has = (dx is not None, dw is not None, db is not None)
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        dx, dw, db = ctx.saved_tensors
        # Eager 16/32-bit: scaled in place, so d_weight becomes weight.grad with no second
        # [V, H] buffer (and no pass at all when g == 1); the mutating custom op bumps their
        # version counters, so a second backward through the same graph (retain_graph=True)
        # fails autograd's saved-tensor version check rather than reuse scaled gradients (on
        # CUDA too, where scale_'s Triton kernel alone is invisible to autograd). Traced
        # (Dynamo's trace of grpo_loss, or AOTAutograd's of the pass's rewritten graph, which
        # runs this under a dispatch mode on functional tensors): in place as well, through
        # scale_saved_grads, which says why it is declared functional. Float64 (gradcheck's
        # repeated backward; memory is not its concern) and an eager tensor subclass: out of place.
        tracing = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
        float64 = any(t is not None and t.dtype == torch.float64 for t in (dx, dw, db))
        g0 = g.reshape(())   # the pass's loss may be [1]

        grads = [t if ok else None for t, ok in zip((dx, dw, db), ctx.has)]
        if not float64 and not tracing and type(g) is Tensor:   # fp32 math (scale_)
            scale_grads_([t for t in grads if t is not None], g0)
        elif not float64 and tracing and grads[0] is not None:   # d_hidden carries the op
            grads[0] = scale_saved_grads(grads[0], [t for t in grads[1:] if t is not None], g0)
        else:   # float64, an eager tensor subclass, or traced with a frozen trunk
            grads = [None if t is None else (g0 * t).to(t.dtype) for t in grads]
        return (g, *grads, None, None, None)
