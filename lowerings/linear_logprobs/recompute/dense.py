"""Triton kernels and launchers for `compiled_grpo::linear_logprobs` on CUDA.

Legend: N tokens (dynamic), H hidden, V vocab (static), S vocab splits of the forward,
C vocab columns per backward chunk (CHUNK_V), BN/BV/BK tile sizes.

Forward, 2NHV FLOPs: grid (row blocks, S vocab splits). Each program runs a BN x BV logits
tile GEMM (fp32 accumulator, K loop over H) for each vocab tile of its split and folds it into
online fp32 statistics per row: max m, sum exp(z - m), sum exp(z - m) * z (only when entropy is
asked: a constexpr), and the target logit. The S partial statistics ([S, N] fp32, 16 bytes a
row and split) are merged by one small kernel (_combine_kernel, shared by every CUDA path), in
a fixed order, no atomics. The split plan is fixed by the head's shape, tiles and SM count (recompute/plan.py):
a row's log-prob, entropy and lse are bitwise the same whatever N, mask, packing, path or
torch.compile (batch invariance; tests/test_batch_invariance_gpu.py).

Backward, 6NHV FLOPs (2NHV recompute + the dX and dW GEMMs), in G row groups of R rows
(R * H * 4 bytes <= DX_GROUP_BYTES: G = 8, R = 2048 at N=16384, H=4096) and, inside each, a
Python loop over vocab chunks of C columns (G and V are static, so the loops do not specialize
N):
  1. `_dlogits_kernel` recomputes the logits tile of the group's rows, forms
     dz = (g_lp * onehot - p * (g_lp - g_lse + g_H * (log p + H))) / T in registers, and
     writes it in the input dtype to a workspace ws [R, C] (24 MiB at R=2048, C=6144), plus
     fp32 per-row-block column sums for d_bias.
  2. dW[c] (+)= ws.T @ X[group]: one cuBLAS GEMM with an fp32 accumulator into the dW rows;
     group 0 writes them, later groups add (beta = 1), so dW is rounded to its dtype G times.
  3. acc (+)= ws @ W[c]: cuBLAS with an fp32 output (`out_dtype`) into the group's fp32 dX
     accumulator acc [R, H] (32 MiB), cast once into dX's rows after the group's last chunk.
Peak beyond inputs and gradients: acc + ws + small (58 MiB measured in the GRPO bench at the
size above, against the N * H * 4 = 256 MiB of one fp32 dX accumulator over all rows, the
previous design). At most MAX_STEPS (group, chunk) steps, G <= MAX_ROW_GROUPS: past that C
grows (the unrolled loops bound the compiled graph; N=131072: 286 MiB). Grouping
also keeps acc's read-modify-write in L2-sized pieces; the price is dW's G roundings (a relative
error of order sqrt(G) * 2^-9 for bf16, well under the 2^-8-scale error of bf16 dlogits that
every bf16 backward has). DX_GROUP_BYTES trades memory for fewer groups.
A frozen weight skips step 2, a hidden without grad skips step 3.
Under torch.compile the whole body is one opaque custom op by default (op.py, tuning.TRACE_LAUNCHES);
with TRACE_LAUNCHES, steps 2, 3 and the dX store are small mutable custom ops (`_dw_rows_op`,
`_dx_acc_op`, `_dx_store_op`, mutates_args on dW / acc / dX): functionalization turns them into
auto_functionalized nodes that Inductor reinplaces, so the compiled backward writes the one dW,
acc and dX buffers in place like eager (see recompute/gemms.py). The workspace ws is
one buffer rewritten by every step's kernel (reinplaced too), which also orders step i+1's
kernel after step i's GEMMs.

Operand loads: on sm_90+ with 16-bit operands (see _use_tma / TMA), the X and W tiles load with
TMA through in-kernel tensor descriptors (`tl.make_tensor_descriptor`, one pair per program;
host `TensorDescriptor`s do not trace through wrap_triton, torch 2.11); their zero fill replaces
the row / column / K masks. Same dots in the same order: bitwise-equal outputs. H200,
N=16384, H=4096, V=151936 bf16: forward 41.0 -> 32.0 ms (cuBLAS logits GEMM 29.8 ms), eager
and under torch.compile alike (compiled fwd 32.4 ms, dlogits 34.7 ms in all vs eager 30.1 /
34.4; `python -m bench.kernels.op --compile --tma=1 --profile`). Elsewhere (older GPUs,
fp32, the TRITON_INTERPRET tests) masked pointer loads.

Precision: bf16/fp16 tiles use tensor-core dots with fp32 accumulation; their products are exact
in fp32, so `fp32_lm_head` changes nothing for them. fp32 inputs use 3xTF32 dots (FP32_DOT:
tensor cores, fp32-accurate to a few ulp).
All pointer offsets are int64 (N*V and V*H exceed 2^31 at real sizes).

`forward`/`backward` take `wrap`, the function applied to each kernel before launch:
`launch.declared` inside the triton_op (each kernel's declared writes become a mutable custom op's
under tracing), identity in the TRITON_INTERPRET tests.
"""
from typing import Callable, Optional

import torch
import torch._guards
import triton
from torch import Tensor

from lowerings.linear_logprobs import tuning as _tune
from lowerings.linear_logprobs.cpu import round_dtype
from lowerings.linear_logprobs.kernels.combine import _combine_kernel
from lowerings.linear_logprobs.kernels.logits import _dlogits_kernel, _fwd_kernel
from lowerings.linear_logprobs.recompute import plan as _plan
from lowerings.linear_logprobs.device import (cdiv, grid_sms, next_power_of_2, size_hint,  # noqa: F401 (callers)
                                             sm_count)
from lowerings.linear_logprobs.recompute.gemms import (_dw_rows_impl, _dw_rows_op, _dx_acc_impl,
                                              _dx_acc_op, _dx_store_impl, _dx_store_op)

def _bias(bias: Optional[Tensor], compute_dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """The bias as the kernels read it: dense, in compute_dtype when one is given (its value
    rounded as the operands' are; d_bias keeps the input's dtype)."""
    if bias is None:
        return None
    return (bias if compute_dtype is None else bias.to(compute_dtype)).contiguous()


def _prepare(hidden: Tensor, weight: Tensor, compute_dtype: Optional[torch.dtype] = None):
    """The operands in the dtype they are multiplied in (compute_dtype, else their common dtype:
    a mixed-dtype head is cast once) and the dot precision. The grads keep the inputs' dtypes."""
    dt = compute_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    x, w = hidden.to(dt).contiguous(), weight.to(dt).contiguous()
    return x, w, _tune.dot_precision(dt)


# Triton's global scratch, one buffer a (device, stream), reused by every launch on it (see
# _tma_alloc); at most SCRATCH_STREAMS streams are remembered (a process that makes a stream a
# step does not pile up buffers).
_SCRATCH: dict[tuple[int, int], Tensor] = {}
SCRATCH_STREAMS = 8


def _tma_alloc(size: int, alignment: int, stream: int) -> Tensor:
    """Triton's launcher asks for `size` bytes of global scratch on `stream` before each launch of
    a kernel with in-kernel tensor maps (size = programs x bytes a program) and drops the buffer
    right after. Kernels on one stream run in order, so one buffer a stream serves them all. A
    fresh torch.empty a launch (32 such launches a step at 8 blocks) costs the host-bound
    small-policy eager step ~0.8 ms on one H100 host and ~6 ms on a slower one (qwen2.5-0.5b;
    bench/results/host_scratch_h100.txt). Grown when a launch needs more (the old buffer goes
    back to the caching allocator on the same stream, so later work on it is ordered after that
    launch). While a CUDA graph is captured each launch takes a buffer of the graph's pool, as
    before (a cached one would be shared across graphs and replays). The caching allocator's
    512-byte alignment covers Triton's (128)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        if buf is None and len(_SCRATCH) >= SCRATCH_STREAMS:
            _SCRATCH.clear()
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf


def _ensure_allocator() -> None:
    """In-kernel descriptors need Triton's global scratch (a per-launch buffer holding each
    program's tensor maps, ~256 bytes a program): install a torch allocator (_tma_alloc) unless
    the thread already has one (the setting is a ContextVar; Inductor's launcher installs its
    own)."""
    try:
        from triton.runtime._allocation import _NULL_ALLOCATOR, _allocator
        if _allocator.get() is not _NULL_ALLOCATOR:
            return
    except ImportError:
        pass
    triton.set_allocator(_tma_alloc)


def _use_tma(x: Tensor, w: Tensor) -> bool:
    """TMA operand loads: CUDA tensors on an sm_90+ target (the active Triton driver's, so a
    fake-driver trace on CPU takes this path too), 16-bit operands, 16-byte aligned rows and
    storage offsets (TMA's requirements; a symbolic offset falls back to pointers, adding no
    guard). Off under TRITON_INTERPRET (CPU tensors) and per TMA above."""
    if _tune.TMA == "0" or not x.is_cuda or x.element_size() != 2 or (_tune.TMA == "eager" and _tracing(x)):
        return False
    target = triton.runtime.driver.active.get_current_target()
    if target.backend != "cuda" or not isinstance(target.arch, int) or target.arch < 90:
        return False
    if not (_tma_aligned(x) and _tma_aligned(w)):
        return False
    _ensure_allocator()   # also while tracing: the thread that compiles is the one that runs
    return True


def _tma_aligned(t: Tensor) -> bool:
    """A 2-D 16-bit tensor a tensor map can address: unit column stride, 16-byte aligned row
    stride and storage offset (a symbolic offset: no, adding no guard)."""
    off = t.storage_offset()
    return isinstance(off, int) and off % 8 == 0 and t.stride(1) == 1 and t.stride(0) % 8 == 0


def _dw_tma_out(tma: bool, dw: Tensor) -> bool:
    """The dW steps write dW through a tensor map (kernels.dw._dw_tile's TMA_OUT: bulk stores and
    L2 reduce-adds) when the operands take TMA and dW is addressable (DW_TMA_OUT)."""
    return tma and _tune.DW_TMA_OUT and dw.element_size() == 2 and _tma_aligned(dw)


def rounds(x: Tensor, round_logits: bool) -> bool:
    """The kernels' ROUND: round_logits where cpu.round_dtype rounds (16-bit operands; rounding
    fp32 logits to the fp32 operands' dtype changes nothing). The dlogits workspace already has
    the operands' dtype, so the logits gradient is rounded before the dX / dW GEMMs either way."""
    return round_dtype(x, x, round_logits) is not None


def _scalars(temperature: float, logit_scale: float, softcap: Optional[float]) -> tuple:
    """(inv_temp, cap_pre, cap_post) of kernels.logits._logits_tile: s / T, s / c and c / T for
    z = c * tanh(a * s / c) / T; without a cap z = a * (s / T) (cap_pre, cap_post unused)."""
    if softcap is None:
        return logit_scale / temperature, 1.0, 1.0
    return logit_scale / temperature, logit_scale / softcap, softcap / temperature


def forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
            temperature: float, fp32_lm_head: bool, with_entropy: bool,
            wrap: Callable = lambda k: k, logit_scale: float = 1.0,
            softcap: Optional[float] = None, round_logits: bool = False,
            compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), each [N] fp32; entropy is zeros unless with_entropy.
    round_logits: the GEMM's output rounded to the 16-bit operands' dtype (kernels' ROUND);
    compute_dtype: the dtype the operands are multiplied in (op.linear_logprobs).
    Logits z = softcap * tanh(a * logit_scale / softcap) / T, a = hidden @ weight.T + bias
    (z = a * logit_scale / T when softcap is None)."""
    x, w, prec = _prepare(hidden, weight, compute_dtype)
    lprec = _tune.logits_precision(prec, fp32_lm_head)           # fp32_lm_head: a bf16 head, upcast
    bn, bv, bk, warps, stages = _tune.tiles(x, lprec)
    tma = _use_tma(x, w)
    ids = ids.contiguous()                                 # read at unit stride, like bias
    bias = _bias(bias, compute_dtype)
    n, h = x.shape
    v = w.shape[0]
    splits, cols = _plan.fwd_split_plan(v, h, x.element_size(), bn, bv, x.device)
    m, s, t, zt = (x.new_empty((splits, n), dtype=torch.float32) for _ in range(4))  # [S, N]
    n_blocks = cdiv(n, bn)
    wrap(_fwd_kernel)[(n_blocks * splits,)](
        x, w, bias if bias is not None else x, ids, m, s, t, zt, ids, n, v, h, x.stride(0),
        w.stride(0), *_scalars(temperature, logit_scale, softcap), cols, n_blocks, splits, 0, n, m, m, 0, 0,
        HAS_BIAS=bias is not None, HAS_CAP=softcap is not None, ROUND=rounds(x, round_logits),
        WITH_ENTROPY=with_entropy, HAS_COUNT=False, STORE_Z=False, DOT_PREC=lprec, USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv,
        BLOCK_K=bk, GROUP_N=_tune.GROUP_N, ref_ptr=m, STORE_E=False, E_HEADROOM=0.0,
        num_warps=warps, num_stages=stages)
    return combine(wrap, m, s, t, zt, ids, None, with_entropy)


def combine(wrap: Callable, m: Tensor, s: Tensor, t: Tensor, zt: Tensor, ids: Tensor,
            count: Optional[Tensor], with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The S splits' statistics [S, N] -> (logprobs, entropy, lse) [N] fp32: one launch of
    _combine_kernel, the merge every CUDA path shares (a Triton kernel, so Inductor cannot
    re-fuse it differently from eager: the same bits compiled or not). count [1] int32: rows
    past it are 0 (the row-masked path's padding, ordered last)."""
    splits, n = m.shape
    lp, ent, lse = (m.new_empty(n) for _ in range(3))                     # [N] fp32
    cr, cwarps = _tune.COMBINE_TILE
    wrap(_combine_kernel)[(cdiv(n, cr), 1)](
        m, s, t, zt, count if count is not None else ids, lp, ent, lse, n, splits,
        WITH_ENTROPY=with_entropy, HAS_COUNT=count is not None, BLOCK_R=cr,
        BLOCK_S=next_power_of_2(splits), ref_ptr=m, ws_ptr=m, zoff_ptr=m, ids_ptr=ids, V=0,
        stride_ws=0, n_ztiles=0, STORE_E=False, E_HEADROOM=0.0, TILE_V=16, num_warps=cwarps)
    return lp, ent, lse


def _tracing(*tensors: Tensor) -> bool:
    return torch._guards.detect_fake_mode(tensors) is not None


def _row_groups(n, h: int, budget: int = 0) -> int:
    """G, the number of row groups of the backward: the fp32 dX accumulator of one group,
    cdiv(N, G) * H * 4 bytes, fits DX_GROUP_BYTES. A symbolic N takes the size hint it was
    traced with (G is a Python int: the loops unroll at trace time), so a graph compiled for
    dynamic N keeps that G for every N it runs (any N is correct; memory scales as N / G)."""
    return min(_tune.MAX_ROW_GROUPS, max(1, cdiv(size_hint(n) * h * 4, budget or _tune.DX_GROUP_BYTES)))


def _chunk_cols(v: int, r, groups: int, elem_bytes: int, bv: int, ws_bytes: int = 0) -> int:
    """C, the backward's vocab columns a step: CHUNK_V, shrunk so that the workspace [R, C]
    fits ws_bytes (WS_BYTES by default), grown so that there are at most MAX_STEPS (group,
    chunk) steps."""
    fit = (ws_bytes or _tune.WS_BYTES) // (max(1, size_hint(r)) * elem_bytes) // bv * bv   # C of the budget (N = 0: R = 0)
    return bound_cols(min(_tune.CHUNK_V, fit), v, groups, bv)


def bound_cols(c: int, v: int, groups: int, bv: int) -> int:
    """C, at least BV and the columns that keep the backward within MAX_STEPS (group, chunk)
    steps, at most V in whole BV tiles."""
    few_steps = cdiv(cdiv(v * groups, _tune.MAX_STEPS), bv) * bv  # C of MAX_STEPS
    return min(max(c, few_steps, bv), cdiv(v, bv) * bv)


def backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
             entropy: Tensor, g_lp: Tensor, g_ent: Tensor, g_lse: Tensor, temperature: float,
             fp32_lm_head: bool, with_entropy: bool, need_x: bool, need_w: bool, need_b: bool,
             wrap: Callable = lambda k: k, logit_scale: float = 1.0,
             softcap: Optional[float] = None, round_logits: bool = False,
             compute_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dX [N, H], dW [V, H], db [V]) in the inputs' dtypes; [0]-shaped where not needed.
    The dlogits kernel applies the chain rule of the scale and cap (see _dlogits_kernel)."""
    x, w, prec = _prepare(hidden, weight, compute_dtype)
    lprec = _tune.logits_precision(prec, fp32_lm_head)           # the recomputed logits' (forward's)
    bn, bv, bk, warps, stages = _tune.tiles(x, lprec)
    tma = _use_tma(x, w)
    # The kernel reads the [N] vectors at unit stride: autograd hands in expanded grads (the
    # grad of a .sum() is a stride-0 view of one element), so make them dense first.
    ids, lse, entropy, g_lp, g_ent, g_lse = (
        t.contiguous() for t in (ids, lse, entropy, g_lp, g_ent, g_lse))
    b_dtype = None if bias is None else bias.dtype                         # d_bias's dtype
    bias = _bias(bias, compute_dtype)
    n, h = x.shape
    v = w.shape[0]
    groups = _row_groups(n, h)
    # Group g holds rows [min(g * R, N), min((g + 1) * R, N)), R a whole number of row blocks;
    # with a dynamic N smaller than the traced one the last groups may be empty (no-ops).
    r = cdiv(cdiv(n, groups), bn) * bn
    c = _chunk_cols(v, r, groups, x.element_size(), bv)
    ws = x.new_empty((r, c))                                               # [R, C]
    acc = x.new_empty((r, h), dtype=torch.float32) if need_x else None     # [R, H] fp32
    dx = hidden.new_empty((n, h)) if need_x else None                      # [N, H]
    dw = weight.new_empty(weight.shape) if need_w else None                # [V, H]
    db = [None] * cdiv(v, c)                                        # fp32 [C'] each
    sms = grid_sms(ws.device)                                       # the dlogits grid
    tracing = _tracing(ws, x)
    dw_rows, dx_acc, dx_store = ((_dw_rows_op, _dx_acc_op, _dx_store_op) if tracing else
                                 (_dw_rows_impl, _dx_acc_impl, _dx_store_impl))
    for g in range(groups):
        r0 = torch.sym_min(g * r, n)
        rows = torch.sym_min((g + 1) * r, n) - r0
        n_blocks = cdiv(rows, bn)
        # each chunk's kernel rewrites rows [0, n_blocks); zeroed once a group so the rows past
        # a shorter last group hold no partial sums of the group before it
        dbp = x.new_zeros((r // bn, c), dtype=torch.float32) if need_b else ws  # [R/BN, C]
        for ci, v0 in enumerate(range(0, v, c)):
            cols = min(c, v - v0)
            n_vtiles = cdiv(cols, bv)
            wrap(_dlogits_kernel)[(sms,)](   # persistent: sms programs whatever N is
                x, w, bias if bias is not None else x, ids, lse, entropy, g_lp, g_ent, g_lse,
                ws, dbp, ids, n, v, h, r0, r0, rows, v0, x.stride(0), w.stride(0), c,
                *_scalars(temperature, logit_scale, softcap), n_blocks, n_vtiles, sms,
                HAS_BIAS=bias is not None, HAS_CAP=softcap is not None, ROUND=rounds(x, round_logits),
                WITH_ENTROPY=with_entropy, NEED_DB=need_b, HAS_COUNT=False, DOT_PREC=lprec, USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk,
                GROUP_N=_tune.GROUP_N, num_warps=warps, num_stages=stages)
            if need_w:
                dw_rows(dw, v0, ws, cols, x, r0, rows, g > 0)
            if need_x:
                dx_acc(acc, ws, rows, w, v0, cols, v0 > 0)
            if need_b:
                part = dbp.sum(0).narrow(0, 0, cols)                       # [C'] fp32
                db[ci] = part if db[ci] is None else db[ci] + part
        if need_x:
            dx_store(dx, r0, rows, acc)
    # a fresh [0] tensor for each grad not needed: a custom op's outputs must not alias
    return (dx if need_x else hidden.new_empty(0), dw if need_w else weight.new_empty(0),
            torch.cat(db).to(b_dtype) if need_b else hidden.new_empty(0))
