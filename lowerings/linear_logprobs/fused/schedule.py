"""Fused-gradient schedule of a linear head: log-probs, entropy AND the parameter gradients of a
loss in one pass over the logits, 6NHV FLOPs instead of the recompute design's 8NHV.

Legend: N tokens (dynamic), H hidden, V vocab (static), G row blocks of R rows, n_b the valid
rows of block b (a device scalar, never read on the host).

The recompute op (op.py) must compute the logits twice: its forward cannot know the loss's
gradient. A caller that can form the per-token gradient (dL/dlogp, dL/dentropy) as soon as a
row block's statistics exist (grpo_loss: compiled_grpo/fused.py) hands in ``grad_fn`` and gets
the gradients back with the outputs:

    order rows: valid rows first (order_rows), or the caller's plan of whole groups
                (order_rows_grouped)                                     perm [G R], counts [G]
    per block b (rows [b R, (b + 1) R) of that order):
      fwd   logits tile z [n_b, V] once: online statistics -> (logp, entropy, lse) [R] and z kept
            in the workspace ws [R, V]                                          2 n_b H V
      grad  (g_lp, g_ent) = grad_fn(idx, logp, entropy)   (idx: original row of each row)
      bwd   ws <- dlogits in place; dW (+)= ws[:n_b].T @ X_b; dX_b = ws[:n_b] @ W    4 n_b H V
    (the blocks run from b = G - 1 down to 0: the partial block first, see the loop)

Workspace: ws [R, V] in the operands' 16-bit dtype (fp32 for fp32, fp64 on CPU for fp64),
sized by the caller's ``block_rows`` (compiled_grpo: GRPOConfig.fused_workspace_mib), plus xg
[R, H] (the block's hidden rows, gathered), small per-row vectors and, on CUDA, up to 48 MiB of
fp32 partials for the dX step when it splits its K = V loop (a block whose dX grid would leave
SMs idle: a short last block, or few H blocks; fused_cuda.DX_SPLITS). On CUDA z is stored as
d = z - (running row max) in fp16 with the max per (row, 256-column tile) in fp32, which keeps
z exact where p is large (fp16's 11 bits where bf16 would have 8); the dlogits are then
formed in place in the input dtype (kernels.logits._fused_dlogits_kernel). Or, where exact (exp_scaled:
no entropy gradient, no softcap, no d_bias, no shards, bf16 / fp32), the exp-scaled backward: z
stored as e = exp(z - R*) in the input dtype, the dlogits c * e' applied as a scale of dX's rows
and of X's rows before dW, no pass between the GEMMs (kernels/fused_block.py). dW is rounded to its dtype
once per block (G roundings, as the recompute path's row groups); dX rows once. No atomics:
bitwise deterministic.

The blocks are a Python loop of G (static, from N's size hint) steps, each two mutable custom
ops (fused/steps.py's ``fused_block_forward`` / ``fused_block_backward``, opaque to Inductor: they launch the
Triton kernels themselves on CUDA and run PyTorch on CPU); ``grad_fn`` between them is plain
torch code that Dynamo traces (compiled_grpo uses torch.func.grad of the loss functions). The
ops mutate the workspace and the gradient buffers in place, so under torch.compile they become
auto_functionalized nodes that Inductor reinplaces (as recompute/gemms.py). Plain eager calls run the ops'
bodies directly (fused_steps.block_steps: the same code, without the op layers' host time). The ops' fake
implementations, which a trace calls, also hand the steps' kernels to launching/precompile.py's workers, so
they compile while the rest of the step does (an eager call hands one block's over first).
"""
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from lowerings.linear_logprobs import tuning as _tune
from lowerings.linear_logprobs import cpu as _cpu
from lowerings.linear_logprobs.device import cdiv, size_hint, sm_count, static_int   # sm_count: wave_rows, callers
try:   # the Triton side: absent triton (a CPU-only install off Linux) the PyTorch body runs alone
    from lowerings.linear_logprobs.recompute import dense as _dense
    from lowerings.linear_logprobs.recompute import plan as _plan
    from lowerings.linear_logprobs.fused import blocks as _fcuda
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    _dense = _plan = _fcuda = None
from lowerings.linear_logprobs.fused import steps as _steps
from lowerings.linear_logprobs.fused.order import (next_fit_blocks, order_rows, order_rows_grouped,  # noqa: F401 (callers)
                                                   pack_sequences)


class FusedResult(NamedTuple):
    logprobs: Tensor   # [N] fp32 (fp64 on CPU for fp64 inputs), 0 at padded rows, detached
    entropy: Tensor    # [N], zeros unless with_entropy
    lse: Tensor        # [N]
    d_hidden: Optional[Tensor]  # [N, H] in hidden's dtype, 0 at padded rows
    d_weight: Optional[Tensor]  # [V, H] in weight's dtype
    d_bias: Optional[Tensor]    # [V] in bias's dtype


def ws_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The workspace dtype: the operands' common dtype on CUDA (16-bit or fp32), the CPU body's
    compute dtype (fp32, or fp64) elsewhere."""
    if _steps._triton_body(hidden):
        return torch.promote_types(hidden.dtype, weight.dtype)
    return _cpu._compute_dtype(hidden, weight)


def ws_cols(hidden: Tensor, v: int) -> int:
    """The workspace's row length: V, rounded up to 64 columns for the Triton body (128-byte
    rows: TMA-legal strides)."""
    return cdiv(v, 64) * 64 if _steps._triton_body(hidden) else v


def ws_row_bytes(hidden: Tensor, weight: Tensor, v: Optional[int] = None) -> int:
    """Bytes of one workspace row of v columns (weight's rows by default): what a caller's
    budget divides by to get R. On CPU a row also carries its share of the body's [R, C] tiles
    (steps.cpu_tile_cols), so that the budget covers all a block holds, not the workspace alone."""
    v = weight.shape[0] if v is None else v
    cols = ws_cols(hidden, v) + (0 if _steps._triton_body(hidden) else _steps.cpu_tile_cols(v))
    return cols * ws_dtype(hidden, weight).itemsize


def wave_rows(hidden: Tensor, weight: Tensor) -> Optional[int]:
    """Rows whose dX step fills whole waves of the GPU (split_plan.dx_wave_rows: H100 / H200, H = 4096,
    bf16: 1024). A block of R rows runs cdiv((R / BLOCK_M) * H blocks, SMs) waves of K = V long
    programs, so R = 2176 costs 3 waves where 2048 costs 2 (H100, qwen3-8b packed: 42.1 ms
    against 39.5 for the padded twin's 2048-row blocks). None off CUDA."""
    if hidden.device.type != "cuda":
        return None
    return _plan.dx_wave_rows(hidden.shape[-1], ws_dtype(hidden, weight).itemsize,
                               sm_count(hidden.device.index))


def block_align(hidden: Tensor, weight: Tensor, budget: int) -> Optional[int]:
    """What the rows of a batch's blocks are a multiple of when it is longer than one block of
    `budget` rows (a multiple of 128): whole dX waves where the budget holds one (wave_rows),
    else the rows in (budget / 2, budget] whose forward grid wastes least of its last wave under
    the head's split plan (split_plan.block_rows; qwen2.5-0.5b at the default budget: 2048 rows, 16
    row tiles x 33 splits = 4 full waves, where 2176 rows ran 4.25 waves in 5). None off CUDA.
    In a trace H, V and the budget are specialized (device.static_int: under dynamic=True the
    graph recompiles for another head, as it would for another dtype), so a compiled graph's
    blocks take the eager call's rows."""
    if hidden.device.type != "cuda":
        return None
    wave = wave_rows(hidden, weight)
    if budget >= wave:
        return wave
    return aligned_rows(hidden.shape[-1], weight.shape[0], budget, ws_dtype(hidden, weight).itemsize,
                        sm_count(hidden.device.index), hidden.device.index)


def aligned_rows(h, v, budget, itemsize: int, sms: int, index: Optional[int]) -> int:
    """block_align's search for a CUDA head of (h, v): ints, or symbols specialized here."""
    return _search_rows(static_int(budget), static_int(v), static_int(h), itemsize, sms, index)


@torch.compiler.assume_constant_result
def _search_rows(budget: int, v: int, h: int, itemsize: int, sms: int, index: Optional[int]) -> int:
    """split_plan.block_rows under the head's split plan: host arithmetic on ints, a constant to
    Dynamo (called, not traced: its loops would otherwise unroll into the trace)."""
    bn, bv = _tune.TILES[:2]
    splits = _plan.fwd_split_plan(v, h, itemsize, bn, bv, torch.device("cuda", index))
    return _plan.block_rows(budget, v, h, itemsize, bn, bv, sms, splits)


def fused_linear_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor],
                          row_mask: Optional[Tensor], grad_fn: Callable, *, blocks: int,
                          block_rows, temperature: float = 1.0,
                          with_entropy: bool = False, logit_scale: float = 1.0,
                          softcap: Optional[float] = None, need_x: bool = True,
                          need_w: bool = True, need_b: bool = False,
                          combine: Optional[Callable] = None,
                          reduce_dx: Optional[Callable] = None,
                          entropy_grad: bool = True, allow_scaled: bool = True,
                          plan: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                          round_logits: bool = False,
                          compute_dtype: Optional[torch.dtype] = None,
                          exact_tf32: bool = False,
                          on_order: Optional[Callable[[Tensor], None]] = None) -> FusedResult:
    """hidden [N, H], weight [V, H], ids [N] in [0, V) (any value at padded rows), bias [V],
    row_mask [N] bool (None: every row valid), ``blocks`` G (a Python int) of ``block_rows`` R
    rows (G * R >= N; R may be symbolic). ``grad_fn(r0, idx, logprobs, entropy) -> (g_lp,
    g_ent)``, each [R'] for the R' rows of the block starting at r0, in their computed order
    (idx [R'] int64: each row's original index; rows past the block's valid count have idx of
    padded rows): the gradient
    of the caller's loss w.r.t. those rows' log-probs and entropies (g_ent ignored unless
    with_entropy). Returns the outputs in the original row order and the gradients of
    sum(g_lp * logprobs + g_ent * entropy) w.r.t. hidden, weight and bias (None where not
    needed). Operands and outputs are detached: the caller attaches the gradients.

    A vocab shard (tensor parallelism: weight / bias are this rank's rows, ids local to them):
    ``combine(idx, logprobs, entropy, lse) -> (logprobs, entropy, lse)`` turns each block's
    shard statistics into the full vocab's before grad_fn and the backward see them (the
    dlogits of a shard are those columns of the full dlogits once lse and entropy are global),
    and ``reduce_dx(dx)`` sums the ranks' parts of dX at the end. Every rank must run the same
    blocks (the same G and R).

    ``entropy_grad`` False promises that grad_fn's g_ent is zero (entropy an output only, no
    entropy term in the loss): with no softcap, no d_bias and no vocab shards the Triton body
    then takes the exp-scaled backward (exp_scaled: no dlogits pass between the GEMMs), unless
    ``allow_scaled`` is False (the in-place dlogits pass: one bf16 rounding fewer in dW).

    ``plan`` (perm [G R], counts [G], slot [N]; order_rows_grouped) replaces the row order for
    groups of rows that are not R-aligned (whole sequences): block b is slots [b R, (b + 1) R),
    its counts[b] valid rows first, and grad_fn's idx holds row 0 in the slots past them (the
    caller masks slots >= counts[b]); masked rows' outputs are 0.

    ``round_logits``: the logits (and their gradient) in the 16-bit operands' dtype, as
    lowerings.linear_logprobs.linear_logprobs states it; ``compute_dtype``: the dtype the
    operands are multiplied in (the grads keep the inputs' dtypes), as it states too;
    ``exact_tf32``: the fp32 operands hold bf16 values (fp32_lm_head over a bf16 head,
    op.upcast_lm_head): the forward's logits GEMM takes one TF32 product (tuning.logits_precision),
    as the op's does, so both give a row the same bits, and the dX / dW GEMMs two
    (tuning.gradient_precision).

    ``on_order(perm)``, if given, is called once with the blocks' row order, perm [G R] (block b's
    idx is perm[b R : b R + R']), before the first block: a caller can gather its per-row inputs
    into that order once instead of in every grad_fn call."""
    hidden, weight = hidden.detach(), weight.detach()
    bias = None if bias is None else bias.detach().contiguous()
    n, h = hidden.shape
    v = weight.shape[0]
    if row_mask is None:
        row_mask = torch.ones(n, dtype=torch.bool, device=hidden.device)
    h_dtype, w_dtype = hidden.dtype, weight.dtype   # the grads' dtypes
    b_dtype = None if bias is None else bias.dtype
    hidden, weight, bias = _cpu.operands(hidden, weight, bias, compute_dtype)
    # rounding needs 16-bit operands of one dtype (a mixed head multiplies in the wider one)
    round_logits = round_logits and _cpu.round_dtype(hidden, weight, True) is not None
    if _steps._triton_body(hidden):   # one common dtype for the kernels, cast once (mixed heads)
        hidden, weight = _dense._prepare(hidden, weight)[:2]
    if size_hint(n) == 0:   # no row (Dynamo specializes a size of 0: no guard on N): the slots past N
        # would read a row 0 that does not exist; the result is empty, dW and d_bias zeros
        dt = torch.float64 if ws_dtype(hidden, weight) == torch.float64 else torch.float32
        empty = hidden.new_zeros(0, dtype=dt)
        return FusedResult(empty, empty.clone(), empty.clone(),
                           hidden.new_zeros((0, h), dtype=h_dtype) if need_x else None,
                           weight.new_zeros(weight.shape, dtype=w_dtype) if need_w else None,
                           bias.new_zeros(v, dtype=b_dtype) if need_b else None)
    slot = None
    if plan is not None:   # grouped blocks: R slots each, like the global order's
        perm, counts, slot = plan
    else:
        perm, counts = order_rows(row_mask, block_rows, blocks)
        # every block R slots: the slots past N (G R >= N) read row 0 and, past every block's
        # count, are never used; with a static R and G the blocks' shapes are static under
        # dynamic N (no guard on each block's rows)
        perm = torch.cat([perm, perm.new_zeros(blocks * block_rows - n)])   # [G R]
    ids_p = ids.index_select(0, perm).contiguous()                          # [G R]
    if on_order is not None:
        on_order(perm)
    cd = ws_dtype(hidden, weight)
    cuda = _steps._triton_body(hidden)
    r = block_rows
    ws = hidden.new_empty((r, ws_cols(hidden, v)), dtype=cd)                 # [R, V]
    n_tiles = cdiv(v, _tune.TILES[1]) if cuda else 1
    zoff = hidden.new_empty((r, n_tiles), dtype=torch.float32)               # [R, V / BV]
    xg = hidden.new_empty((r, h), dtype=cd)                                   # [R, H]
    dx = hidden.new_zeros((n, h), dtype=h_dtype) if need_x else hidden.new_empty(0, dtype=h_dtype)
    # the dX step's split partials (fused_cuda.dx_split_rows): [P, H] fp32, CUDA only
    p_rows = _fcuda.dx_split_rows(r, h, cd.itemsize) if cuda and need_x else 0
    dxp = hidden.new_empty((p_rows, h), dtype=torch.float32)                 # [P, H]
    dw = weight.new_empty(weight.shape, dtype=w_dtype) if need_w else weight.new_empty(0)  # [V, H]
    db = hidden.new_zeros(v, dtype=torch.float32 if cd != torch.float64 else cd) if need_b \
        else hidden.new_empty(0)                                              # [V] acc
    scal = dict(temperature=float(temperature), with_entropy=bool(with_entropy),
                logit_scale=float(logit_scale), softcap=None if softcap is None else float(softcap),
                round_logits=bool(round_logits))
    scaled = cuda and allow_scaled and exp_scaled(cd, with_entropy and entropy_grad, softcap, need_b,
                                                  combine, round_logits)
    ref = hidden.new_empty(3 * r, dtype=torch.float32)                        # [3 R] (scaled)
    step_fwd, step_bwd = _steps.block_steps(hidden)
    if hidden.is_cuda and step_fwd is _steps._block_forward:   # eager: the kernels compiled in parallel
        _fcuda.precompile_eager(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, dx, dxp,
                                dw, db, blocks, r, ref, scaled, scal, need_x, need_w, need_b,
                                exact_tf32)
    lps, ents, lses = [], [], []
    # last block first: with the global order the blocks past the last valid row are empty and
    # the last one with valid rows is partial, so that one runs first and its dW step stores
    # dW (a write of [V, H]) while the full blocks after it add to it, their read of dW hidden
    # under their GEMMs (H100, qwen3-8b, 271 of 2048 rows: 1.35 ms for its reduce-add, docs/performance.md)
    for b in reversed(range(blocks)):
        r0, rows = b * r, r
        lp_b, ent_b, lse_b = step_fwd(hidden, weight, ids_p, bias, perm, counts, ws, zoff, xg, b,
                                      r0, rows, ref=ref, scaled=scaled, exact_tf32=exact_tf32,
                                      **scal)
        idx = perm.narrow(0, r0, rows)                                       # [R'] original rows
        if combine is not None:
            lp_b, ent_b, lse_b = combine(idx, lp_b, ent_b, lse_b)
        g_lp, g_ent = grad_fn(r0, idx, lp_b, ent_b)
        step_bwd(weight, ids_p, perm, counts, ws, zoff, xg, lse_b, ent_b,
                 g_lp.to(lse_b.dtype).contiguous(), g_ent.to(lse_b.dtype).contiguous(), dx, dxp,
                 dw, db, b, r0, rows, need_x=need_x, need_w=need_w, need_b=need_b, ref=ref,
                 scaled=scaled, exact_tf32=exact_tf32, **scal)
        lps.insert(0, lp_b), ents.insert(0, ent_b), lses.insert(0, lse_b)
    # back to the original order (padded rows: 0, the value computed past each block's count)
    perm_n = perm.narrow(0, 0, n)

    def unperm(parts):   # the blocks' slots -> [N] rows
        if slot is not None:   # masked rows: slot G R, a 0 after the blocks' slots
            return torch.cat(parts + [parts[0].new_zeros(1)]).index_select(0, slot)
        t = torch.cat(parts).narrow(0, 0, n)
        return torch.empty_like(t).index_copy_(0, perm_n, t)

    lp, ent, lse = (unperm(t) for t in (lps, ents, lses))
    if reduce_dx is not None and need_x:
        dx = reduce_dx(dx)
    return FusedResult(lp, ent, lse, dx if need_x else None,
                       dw if need_w else None, db.to(b_dtype) if need_b else None)


def exp_scaled(ws_dtype: torch.dtype, entropy_grad: bool, softcap: Optional[float],
               need_b: bool, combine: Optional[Callable], round_logits: bool = False) -> bool:
    """Whether the Triton body's blocks take the exp-scaled backward (kernels.fused_block's block
    comment): the forward stores e = exp(z - R*) and the dlogits are one per-row scale of it,
    applied to dX rows as they are stored and to X's rows before the dW step, with no pass over
    the [R, V] tile between the GEMMs. Exact only where every dlogit is g_lp (1[v = y] - p) s / T
    (no entropy gradient, no softcap's (1 - y^2)); d_bias (a column sum of the dlogits) and vocab
    shards (no target logit on the ranks that do not own it) keep the dlogits pass, and so do
    fp16 operands: e spans e^-87..e^32, fp32's exponent range, which bf16 has and fp16 has not.
    round_logits keeps the pass too: its contract (and TRL's head) rounds the logits gradient
    g_lp (1[v = y] - p) s / T to 16 bits before the GEMMs, where this backward rounds e and c X."""
    return (ws_dtype in (torch.bfloat16, torch.float32) and not round_logits
            and not entropy_grad and softcap is None and not need_b and combine is None)
