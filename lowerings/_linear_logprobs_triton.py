"""Triton kernels and launchers for `compiled_grpo::linear_logprobs` on CUDA.

Legend: N tokens (dynamic), H hidden, V vocab (static), S vocab splits of the forward,
C vocab columns per backward chunk (CHUNK_V), BN/BV/BK tile sizes.

Forward, 2NHV FLOPs: grid (row blocks, S vocab splits). Each program runs a BN x BV logits
tile GEMM (fp32 accumulator, K loop over H) for each vocab tile of its split and folds it into
online fp32 statistics per row: max m, sum exp(z - m), sum exp(z - m) * z (only when entropy is
asked: a constexpr), and the target logit. The S partial statistics ([S, N] fp32, 16 bytes a
row and split) are combined by a few torch ops that Inductor fuses into one kernel: split
statistics plus a combine step, no atomics, so the result is deterministic. The splits are there
to fill the GPU when N/BN row blocks alone would not.

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
every bf16 backward has). LINEAR_LOGPROBS_DX_GROUP_MIB trades memory for fewer groups.
A frozen weight skips step 2, a hidden without grad skips step 3.
Under torch.compile steps 2, 3 and the dX store are small mutable custom ops (`_dw_rows_op`,
`_dx_acc_op`, `_dx_store_op`, mutates_args on dW / acc / dX): functionalization turns them into
auto_functionalized nodes that Inductor reinplaces, so the compiled backward writes the one dW,
acc and dX buffers in place like eager (see _linear_logprobs_gemms). The workspace ws is
one buffer rewritten by every step's kernel (reinplaced too), which also orders step i+1's
kernel after step i's GEMMs.

Operand loads: on sm_90+ with 16-bit operands (see _use_tma / TMA), the X and W tiles load with
TMA through in-kernel tensor descriptors (`tl.make_tensor_descriptor`, one pair per program;
host `TensorDescriptor`s do not trace through wrap_triton, torch 2.11); their zero fill replaces
the row / column / K masks. Same dots in the same order: bitwise-equal outputs. H200,
N=16384, H=4096, V=151936 bf16: forward 41.0 -> 32.0 ms (cuBLAS logits GEMM 29.8 ms), eager
and under torch.compile alike (compiled fwd 32.4 ms, dlogits 34.7 ms in all vs eager 30.1 /
34.4; `python -m lowerings._bench_op --compile --tma=1 --profile`). Elsewhere (older GPUs,
fp32, the TRITON_INTERPRET tests) masked pointer loads.

Precision: bf16/fp16 tiles use tensor-core dots with fp32 accumulation; their products are exact
in fp32, so `fp32_lm_head` changes nothing for them. fp32 inputs use IEEE fp32 dots (no tf32).
All pointer offsets are int64 (N*V and V*H exceed 2^31 at real sizes).

`forward`/`backward` take `wrap`, the function applied to each kernel before launch:
`torch.library.wrap_triton` inside the triton_op, identity in the TRITON_INTERPRET tests.
"""
import os
from typing import Callable, Optional

import torch
import torch._guards
import triton
import triton.language as tl
from torch import Tensor

from lowerings._linear_logprobs_gemms import (_dw_rows_impl, _dw_rows_op, _dx_acc_impl,
                                              _dx_acc_op, _dx_store_impl, _dx_store_op)

# Tiles of the logits GEMM: (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages). Overridable for
# the interpreter tests (tiles of 16) and for tuning runs (LINEAR_LOGPROBS_TILES="128,128,64,8,3").
TILES = tuple(int(t) for t in os.environ.get("LINEAR_LOGPROBS_TILES", "128,256,64,8,3").split(","))
GROUP_N = 16                # row blocks per program group (L2 reuse, see _swizzle)
FWD_COLS_PER_SPLIT = 8192   # fewest splits S0 = cdiv(V, 8192); see _fwd_splits for the pick
CHUNK_V = 6144              # backward vocab columns a step: workspace R * CHUNK_V elements
# Budget of the backward's fp32 dX accumulator, one row group of R = cdiv(N, G) rows (see
# _row_groups): 32 MiB is 2048 rows at H=4096. LINEAR_LOGPROBS_DX_GROUP_MIB raises it (fewer
# groups, fewer roundings of dW, more memory).
DX_GROUP_BYTES = int(os.environ.get("LINEAR_LOGPROBS_DX_GROUP_MIB", "32")) << 20
WS_BYTES = 24 << 20         # the backward's dlogits workspace R * C: C shrinks to fit it ...
# ... unless that would make more than MAX_STEPS (row group, chunk) steps: the loops unroll into
# the compiled graph, so steps bound its size and compile time. Past N ~ 20k rows (H=4096,
# V=151936) memory then grows with N instead (about 280 MiB at N=131072) and G stops at
# MAX_ROW_GROUPS (also the bound on dW's roundings).
MAX_STEPS = 256
MAX_ROW_GROUPS = 16
# TMA loads of the logits-tile operands on sm_90+: "1" eager and compiled (default), "eager"
# only outside torch.compile tracing, "0" never (the pointer path). Read at call time
# (benchmarks toggle it). Inductor's FX graph / AOTAutograd caches key on the traced program,
# not on this setting: after changing it, compile with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
# (a cache hit otherwise replays the kernels of the earlier setting; that is what once made TMA
# look no faster under compile).
TMA = os.environ.get("LINEAR_LOGPROBS_TMA", "1")


@triton.jit
def _swizzle(n_blocks, n_other, GROUP_N: tl.constexpr):
    """1-D program id -> (row block, other index), GROUP_N row blocks at a time. The ~132
    resident programs then share GROUP_N row blocks of X and ~132/GROUP_N column tiles of W
    (16 MiB + 8 * 2 MiB at GROUP_N=16, BV=256: inside the 50 MB L2) instead of each streaming
    its own 1 MiB of X rows from HBM for every vocab tile (forward 45 -> 41 ms on H200)."""
    pid = tl.program_id(0)
    width = GROUP_N * n_other
    first = (pid // width) * GROUP_N
    size = tl.minimum(n_blocks - first, GROUP_N)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The X and W operands of _logits_tile: in-kernel TMA descriptors (made once per program;
    their 128-byte tensor maps live in Triton's global scratch, see _ensure_allocator) or the
    raw pointers."""
    if USE_TMA:
        x_src = tl.make_tensor_descriptor(x_ptr, shape=[N, H], strides=[stride_x, 1],
                                          block_shape=[BLOCK_N, BLOCK_K])
        w_src = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[stride_w, 1],
                                          block_shape=[BLOCK_V, BLOCK_K])
    else:
        x_src = x_ptr
        w_src = w_ptr
    return x_src, w_src


@triton.jit
def _logits_tile(x_src, w_src, b_ptr, row0, col0, rows, cols, row_mask, col_mask, H, stride_x,
                 stride_w, inv_temp, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                 USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """z = (x[rows] @ w[cols].T + b[cols]) * inv_temp, fp32 [BLOCK_N, BLOCK_V]; rows = row0 +
    arange(BLOCK_N), cols = col0 + arange(BLOCK_V). USE_TMA: x_src / w_src are descriptors
    whose loads zero-fill rows >= N, cols >= V and k >= H (what the pointer path's masks do)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            a = x_src.load([row0, k0])
            b = w_src.load([col0, k0])
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PREC)
    else:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_src + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
        w_ptrs = w_src + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        for k0 in range(0, H, BLOCK_K):
            k_mask = (ks + k0) < H
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * tl.cast(inv_temp, tl.float32)


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, N, V, H, stride_x,
                stride_w, inv_temp, cols_per_split, n_blocks, n_splits, HAS_BIAS: tl.constexpr,
                WITH_ENTROPY: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_N: tl.constexpr):
    pid_n, split = _swizzle(n_blocks, n_splits, GROUP_N)
    x_src, w_src = _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA, BLOCK_N,
                             BLOCK_V, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    # The first tile of each split has a valid column, so m is finite after it; tiles past V
    # (only in the last split, under BLOCK_V * splits columns in all) are fully masked.
    for i in range(0, cols_per_split, BLOCK_V):
        col0 = split * cols_per_split + i
        cols = col0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logits_tile(x_src, w_src, b_ptr, pid_n * BLOCK_N, col0, rows, cols, row_mask,
                         col_mask, H, stride_x, stride_w, inv_temp, HAS_BIAS, DOT_PREC, USE_TMA,
                         BLOCK_N, BLOCK_V, BLOCK_K)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        # the target logit first: after the max, z is only needed as d = z - m_new (same
        # registers), so the tile is held once rather than as z and exp(z) side by side
        zt += tl.sum(tl.where(cols[None, :] == ids[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        d = z - m_new[:, None]                             # <= 0, -inf on masked columns
        e = tl.exp(d)                                      # 0 on masked columns
        if WITH_ENTROPY:
            # t = sum e * (z - m), rescaled to the new max: alpha * (t + (m - m_new) * s)
            shift = tl.where(s > 0, (m - m_new) * s, 0.0)  # s = 0 before the first tile
            t = alpha * (t + shift) + tl.sum(tl.where(col_mask[None, :], e * d, 0.0), 1)
        s = s * alpha + tl.sum(e, 1)
        m = m_new
    out = split.to(tl.int64) * N + rows
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(t_ptr + out, t, mask=row_mask)
    tl.store(zt_ptr + out, zt, mask=row_mask)


@triton.jit
def _dlogits_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, glse_ptr,
                    ws_ptr, dbp_ptr, N, V, H, row_first, n_rows, v_first, stride_x, stride_w,
                    stride_ws, inv_temp, n_blocks, n_vtiles, HAS_BIAS: tl.constexpr,
                    WITH_ENTROPY: tl.constexpr, NEED_DB: tl.constexpr, DOT_PREC: tl.constexpr,
                    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    """Rows row_first + [0, n_rows) of X (N rows in all), columns v_first + [0, stride_ws):
    ws[r, c] = dz[row_first + r, v_first + c]; dbp[pid_n, c] = its sum over the tile's rows."""
    pid_n, pid_v = _swizzle(n_blocks, n_vtiles, GROUP_N)
    local_rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # row inside the group
    rows = row_first + local_rows
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)     # column inside the chunk
    cols = v_first + local
    row_mask = local_rows < n_rows
    col_mask = (local < stride_ws) & (cols < V)
    x_src, w_src = _operands(x_ptr, w_ptr, N, V, H, stride_x, stride_w, USE_TMA, BLOCK_N,
                             BLOCK_V, BLOCK_K)
    z = _logits_tile(x_src, w_src, b_ptr, row_first + pid_n * BLOCK_N, v_first + pid_v * BLOCK_V,
                     rows, cols, row_mask, col_mask, H, stride_x, stride_w, inv_temp, HAS_BIAS,
                     DOT_PREC, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K)
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    coef = g_lp - tl.load(glse_ptr + rows, mask=row_mask, other=0.0)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    if WITH_ENTROPY:
        g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        dz = -p * (coef[:, None] + g_ent[:, None] * (logp + ent[:, None]))
    else:
        dz = -p * coef[:, None]
    dz = tl.where(cols[None, :] == ids[:, None], dz + g_lp[:, None], dz) * tl.cast(inv_temp, tl.float32)
    mask = row_mask[:, None] & col_mask[None, :]
    dz = tl.where(mask, dz, 0.0)                      # padded rows/cols may hold inf/nan
    ws_ptrs = ws_ptr + local_rows.to(tl.int64)[:, None] * stride_ws + local[None, :]
    tl.store(ws_ptrs, dz.to(ws_ptr.dtype.element_ty), mask=mask)
    if NEED_DB:
        tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_ws + local, tl.sum(dz, 0),
                 mask=col_mask)


def _prepare(hidden: Tensor, weight: Tensor, fp32_lm_head: bool):
    """Common operand dtype (a mixed-dtype head is cast once) and the dot precision."""
    dt = torch.promote_types(hidden.dtype, weight.dtype)
    x, w = hidden.to(dt).contiguous(), weight.to(dt).contiguous()
    return x, w, ("ieee" if dt == torch.float32 else "tf32")


def _tma_alloc(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """In-kernel descriptors need Triton's global scratch (a per-launch buffer holding each
    program's tensor maps, ~256 bytes a program): install a torch allocator unless the thread
    already has one (the setting is a ContextVar; Inductor's launcher installs its own)."""
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
    if TMA == "0" or not x.is_cuda or x.element_size() != 2 or (TMA == "eager" and _tracing(x)):
        return False
    target = triton.runtime.driver.active.get_current_target()
    if target.backend != "cuda" or not isinstance(target.arch, int) or target.arch < 90:
        return False
    for t in (x, w):
        off = t.storage_offset()
        if not isinstance(off, int) or off % 8 or t.stride(1) != 1 or t.stride(0) % 8:
            return False
    _ensure_allocator()   # also while tracing: the thread that compiles is the one that runs
    return True


def forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
            temperature: float, fp32_lm_head: bool, with_entropy: bool,
            wrap: Callable = lambda k: k) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), each [N] fp32; entropy is zeros unless with_entropy."""
    bn, bv, bk, warps, stages = TILES
    x, w, prec = _prepare(hidden, weight, fp32_lm_head)
    tma = _use_tma(x, w)
    ids = ids.contiguous()                                 # read at unit stride, like bias
    bias = bias.contiguous() if bias is not None else None
    n, h = x.shape
    v = w.shape[0]
    splits, cols = _fwd_splits(n, v, bn, bv, x.device)
    m, s, t, zt = (x.new_empty((splits, n), dtype=torch.float32) for _ in range(4))  # [S, N]
    n_blocks = triton.cdiv(n, bn)
    wrap(_fwd_kernel)[(n_blocks * splits,)](
        x, w, bias if bias is not None else x, ids, m, s, t, zt, n, v, h, x.stride(0),
        w.stride(0), 1.0 / temperature, cols, n_blocks, splits, HAS_BIAS=bias is not None,
        WITH_ENTROPY=with_entropy, DOT_PREC=prec, USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv,
        BLOCK_K=bk, GROUP_N=GROUP_N, num_warps=warps, num_stages=stages)
    m_all = m.amax(0)                                                      # [N]
    scale = torch.exp(m - m_all)                                           # [S, N]
    s_all = (s * scale).sum(0)                                             # [N]
    log_s = torch.log(s_all)
    lse = m_all + log_s                                                    # [N]
    if with_entropy:   # H = lse - E_p[z] = log S - E_p[z - m_all], no cancellation against m
        ent = log_s - (scale * (t + (m - m_all) * s)).sum(0) / s_all
    else:
        ent = torch.zeros_like(lse)
    return zt.sum(0) - lse, ent, lse          # one split holds the target logit, others 0


def _tracing(*tensors: Tensor) -> bool:
    return torch._guards.detect_fake_mode(tensors) is not None


def _hint(n) -> int:
    """n, or the size hint of a symbolic n (1 when unbacked)."""
    return n if isinstance(n, int) else (n.node.hint or 1)


def _fwd_splits(n, v: int, bn: int, bv: int, device: torch.device) -> tuple[int, int]:
    """(S, columns per split): balanced splits of whole BV tiles. Between S0 = cdiv(V,
    FWD_COLS_PER_SPLIT) and 2 * S0, the S whose n_blocks * S programs fill the last wave of the
    GPU's SMs best, all programs being about as long (H200, N=16384, V=151936: S0 = 19 gives
    2432 programs, 18.4 waves of 132; S = 33 gives 32 full waves, forward 32.0 -> 31.1 ms).
    From N's size hint when symbolic (S is a Python int); S0 off CUDA (the interpreter tests)."""
    s0 = triton.cdiv(v, FWD_COLS_PER_SPLIT)
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" and torch.cuda.is_available() else None)
    n_blocks = triton.cdiv(_hint(n), bn)
    best = None
    for s in range(s0, 2 * s0 + 1) if sms else (s0,):
        cols = triton.cdiv(triton.cdiv(v, s), bv) * bv
        s = triton.cdiv(v, cols)
        fill = 1.0 if not sms else n_blocks * s / (triton.cdiv(n_blocks * s, sms) * sms)
        if best is None or fill > best[0] + 1e-3:
            best = (fill, s, cols)
    return best[1], best[2]


def _row_groups(n, h: int) -> int:
    """G, the number of row groups of the backward: the fp32 dX accumulator of one group,
    cdiv(N, G) * H * 4 bytes, fits DX_GROUP_BYTES. A symbolic N takes the size hint it was
    traced with (G is a Python int: the loops unroll at trace time), so a graph compiled for
    dynamic N keeps that G for every N it runs (any N is correct; memory scales as N / G)."""
    return min(MAX_ROW_GROUPS, max(1, triton.cdiv(_hint(n) * h * 4, DX_GROUP_BYTES)))


def backward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor], lse: Tensor,
             entropy: Tensor, g_lp: Tensor, g_ent: Tensor, g_lse: Tensor, temperature: float,
             fp32_lm_head: bool, with_entropy: bool, need_x: bool, need_w: bool, need_b: bool,
             wrap: Callable = lambda k: k) -> tuple[Tensor, Tensor, Tensor]:
    """(dX [N, H], dW [V, H], db [V]) in the inputs' dtypes; [0]-shaped where not needed."""
    bn, bv, bk, warps, stages = TILES
    x, w, prec = _prepare(hidden, weight, fp32_lm_head)
    tma = _use_tma(x, w)
    # The kernel reads the [N] vectors at unit stride: autograd hands in expanded grads (the
    # grad of a .sum() is a stride-0 view of one element), so make them dense first.
    ids, lse, entropy, g_lp, g_ent, g_lse = (
        t.contiguous() for t in (ids, lse, entropy, g_lp, g_ent, g_lse))
    bias = bias.contiguous() if bias is not None else None
    n, h = x.shape
    v = w.shape[0]
    groups = _row_groups(n, h)
    # Group g holds rows [min(g * R, N), min((g + 1) * R, N)), R a whole number of row blocks;
    # with a dynamic N smaller than the traced one the last groups may be empty (no-ops).
    r = triton.cdiv(triton.cdiv(n, groups), bn) * bn
    fit = WS_BYTES // (_hint(r) * x.element_size()) // bv * bv             # C of WS_BYTES
    few_steps = triton.cdiv(triton.cdiv(v * groups, MAX_STEPS), bv) * bv     # C of MAX_STEPS
    c = min(max(min(CHUNK_V, fit), few_steps, bv), triton.cdiv(v, bv) * bv)
    ws = x.new_empty((r, c))                                               # [R, C]
    acc = x.new_empty((r, h), dtype=torch.float32) if need_x else None     # [R, H] fp32
    dx = hidden.new_empty((n, h)) if need_x else None                      # [N, H]
    dw = weight.new_empty(weight.shape) if need_w else None                # [V, H]
    db = [None] * triton.cdiv(v, c)                                        # fp32 [C'] each
    tracing = _tracing(ws, x)
    dw_rows, dx_acc, dx_store = ((_dw_rows_op, _dx_acc_op, _dx_store_op) if tracing else
                                 (_dw_rows_impl, _dx_acc_impl, _dx_store_impl))
    for g in range(groups):
        r0 = torch.sym_min(g * r, n)
        rows = torch.sym_min((g + 1) * r, n) - r0
        n_blocks = triton.cdiv(rows, bn)
        # each chunk's kernel rewrites rows [0, n_blocks); zeroed once a group so the rows past
        # a shorter last group hold no partial sums of the group before it
        dbp = x.new_zeros((r // bn, c), dtype=torch.float32) if need_b else ws  # [R/BN, C]
        for ci, v0 in enumerate(range(0, v, c)):
            cols = min(c, v - v0)
            n_vtiles = triton.cdiv(cols, bv)
            wrap(_dlogits_kernel)[(n_blocks * n_vtiles,)](
                x, w, bias if bias is not None else x, ids, lse, entropy, g_lp, g_ent, g_lse,
                ws, dbp, n, v, h, r0, rows, v0, x.stride(0), w.stride(0), c, 1.0 / temperature,
                n_blocks, n_vtiles, HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy,
                NEED_DB=need_b, DOT_PREC=prec, USE_TMA=tma, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk,
                GROUP_N=GROUP_N, num_warps=warps, num_stages=stages)
            if need_w:
                dw_rows(dw, v0, ws, cols, x, r0, rows, g > 0)
            if need_x:
                dx_acc(acc, ws, rows, w, v0, cols, v0 > 0)
            if need_b:
                part = dbp.sum(0).narrow(0, 0, cols)                       # [C'] fp32
                db[ci] = part if db[ci] is None else db[ci] + part
        if need_x:
            dx_store(dx, r0, rows, acc)
    empty = hidden.new_empty(0)
    return (dx if need_x else empty, dw if need_w else weight.new_empty(0),
            torch.cat(db).to(bias.dtype) if need_b else empty)
