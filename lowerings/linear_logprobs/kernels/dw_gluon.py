"""The dW step (fused blocks and recompute row groups, dw_steps.launch) as a warp-specialized
persistent Gluon kernel (sm_90 only): the same arithmetic as kernels.dw._dw_step_persistent_kernel
(dW (+)= ws[:n].T @ xg[:n], the K loop stopping at the block's valid count n read on the
device), with a producer/consumer schedule Triton 3.6 does not build from tl.dot:

  loader (1 warp)      walks this program's output tiles and K steps, TMA-loading the ws / xg
                       operand tiles into a STAGES-deep ring (ready / empty mbarriers), across
                       tile boundaries, so the next tile's first operands arrive while the
                       consumers' epilogues run; when adding, it also TMA-loads the old dW tile
                       into the epilogue buffer (c_ready / c_empty), so no consumer waits on a
                       global load
  consumer q of NC     vocab rows [q, q + 1) * BLOCK_C / NC of each tile (ws's columns, its own
                       part of each stage), the stage's whole xg tile: async wgmma over the ring
                       (one MMA in flight), then the epilogue of its part: old + fp32 sum,
                       rounded to dW's dtype ONCE, TMA-stored

TMA copies through triton_compat.tma_load / tma_store (Gluon's async_load / async_store; the
pre-3.8 names on Triton 3.6 / 3.7).

NC = 2 (fused_cuda's default, 4 warps each): the two consumers share each xg stage (the operand
bytes of one 128 x 256 tile a K step) and are not locked together, so one's epilogue runs while
the other's wgmmas go on, up to the ring's depth (three 48 KB stages: ~1.5 k cycles of one
consumer's MMAs, about an epilogue's length). H100, qwen3-8b (bench/results/dw_ws_h100.txt,
ncu_h100_7a873e1.txt): 5.33 M cycles a full block against one 8-warp consumer's 5.42 M (NC = 1);
the forward's longer epilogue (the row statistics) outlasts that slack (the Gluon forward, removed: HISTORY.md).

One rounding per block, as the pointer epilogue of kernels.dw._dw_tile (the TMA reduce-add
rounds twice: bench/results/HISTORY.md, dW error budget). Deterministic: each dW element has one
writer per launch. Legend: n valid rows of the block, C = cols vocab rows of dW, H hidden.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowerings.linear_logprobs.kernels import tiles as _k
from lowerings.linear_logprobs.launching.triton_compat import tma_load, tma_store   # 3.6-3.9 names
from lowerings.linear_logprobs.kernels import dw as _kdw
from lowerings.linear_logprobs.kernels.writes import writes

# The Triton step's helpers, their bodies compiled as Gluon functions (one definition of the
# valid rows, the skip rule and the tile order): kernels.dw._dw_rows / _dw_skips, and
# kernels.tiles._swizzle_id (GROUP_C vocab blocks share their xg columns in L2).
_dw_rows = gluon.jit(_kdw._dw_rows.fn)
_dw_skips = gluon.jit(_kdw._dw_skips.fn)
_tile_of = gluon.jit(_k._swizzle_id.fn)


@gluon.jit
def _dw_ws_loader(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty,
                  n_valid, n_cblocks, n_hblocks, ACCUMULATE: gl.constexpr,
                  GROUP_C: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    PART_C: gl.constexpr = a_desc.block_type.shape[1]    # BLOCK_C / NC: a consumer's part
    BLOCK_H: gl.constexpr = b_desc.block_type.shape[1]
    NC: gl.constexpr = c_buf.type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0] // NC
    k_steps = gl.cdiv(n_valid, BLOCK_K)
    it = 0
    t = 0
    for tile_id in range(gl.program_id(0), n_cblocks * n_hblocks, gl.num_programs(0)):
        pid_c, pid_h = _tile_of(tile_id, n_cblocks, n_hblocks, GROUP_C)
        for k in range(k_steps):
            s = it % STAGES
            # a stage is free once the consumer's MMA that read it retired (first pass: the
            # barriers' initial phase counts as free)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NC * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for q in gl.static_range(NC):   # each consumer's vocab rows of ws's tile
                tma_load(a_desc, [k * BLOCK_K, (pid_c * NC + q) * PART_C], bar,
                         a_bufs.index(s * NC + q))
            tma_load(b_desc, [k * BLOCK_K, pid_h * BLOCK_H], bar, b_bufs.index(s))
            it += 1
        if ACCUMULATE:
            # the old dW tile, once every consumer's store of the previous tile has left c_buf
            # (each says so during this tile's first K step, so this wait never holds the ring
            # back)
            mbarrier.wait(c_empty, (t + 1) & 1)
            mbarrier.expect(c_ready, NC * c_desc.block_type.nbytes)
            for q in gl.static_range(NC):
                tma_load(c_desc, [(pid_c * NC + q) * PART_C, pid_h * BLOCK_H], c_ready,
                         c_buf.index(q))
        t += 1


@gluon.jit
def _dw_ws_consumer(a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, c_desc, n_valid,
                    n_cblocks, n_hblocks, ACCUMULATE: gl.constexpr, GROUP_C: gl.constexpr,
                    WHICH: gl.constexpr):
    """Vocab rows [WHICH, WHICH + 1) * BLOCK_C / NC of each output tile, on this partition's
    warps."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[1]
    PART_C: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = b_bufs.type.shape[2]
    NC: gl.constexpr = c_buf.type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0] // NC
    c_part = c_buf.index(WHICH)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_H, 16])
    k_steps = gl.cdiv(n_valid, BLOCK_K)
    it = 0
    t = 0
    for tile_id in range(gl.program_id(0), n_cblocks * n_hblocks, gl.num_programs(0)):
        pid_c, pid_h = _tile_of(tile_id, n_cblocks, n_hblocks, GROUP_C)
        acc = gl.zeros([PART_C, BLOCK_H], gl.float32, acc_layout)
        for k in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            # its part of ws's tile [BK, BC / NC] read as the transpose: an MN-major A operand
            acc = warpgroup_mma(a_bufs.index(s * NC + WHICH).permute((1, 0)), b_bufs.index(s),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # step it - 1's MMA retired: its stage goes back to the loader
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
            if ACCUMULATE:
                if k == 0:
                    # the previous tile's store has read c_buf: the loader may refill it
                    tma.store_wait(0)
                    mbarrier.arrive(c_empty, count=1, pred=t > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
        if ACCUMULATE:
            mbarrier.wait(c_ready, t & 1)
            acc = acc + c_part.load(acc_layout).to(gl.float32)
        else:
            tma.store_wait(0)
        c_part.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [(pid_c * NC + WHICH) * PART_C, pid_h * BLOCK_H], c_part)
        t += 1
    tma.store_wait(0)


@writes("dw_ptr")
@gluon.jit(do_not_specialize=_k.DW_VARYING, do_not_specialize_on_alignment=_k.VARYING_PTRS)
def _dw_step_ws_kernel(ws_ptr, x_ptr, dw_ptr, count_ptr, row0, n_rows, v0, cols, H, stride_ws,
                       stride_x, stride_dw, n_cblocks, n_hblocks, n_later, final,
                       ACCUMULATE: gl.constexpr, ON_DEVICE: gl.constexpr,
                       BLOCK_C: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_C: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr,
                       num_warps: gl.constexpr):
    """kernels.dw._dw_step_persistent_kernel's contract (launched storing and adding, the same
    skip rule, kernels.dw._dw_skips) on a grid of at most one program per SM. NC = 1: one
    consumer of num_warps warps on each BLOCK_C x BLOCK_H tile; NC = 2 (num_warps = 4): two,
    each on half its vocab rows, sharing each stage's xg tile (module docstring)."""
    n_valid, add = _dw_rows(count_ptr, row0, n_rows, n_later, ON_DEVICE)
    if _dw_skips(n_valid, add, final, ACCUMULATE, ON_DEVICE):
        return
    dtype: gl.constexpr = ws_ptr.dtype.element_ty
    PART_C: gl.constexpr = BLOCK_C // NC
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, PART_C], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_H], dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PART_C, BLOCK_H],
                                                                  dw_ptr.dtype.element_ty)
    # operands of max(n, 1) rows (a tensor map has no empty dims); their zero fill past n masks
    # the last K step
    rows = gl.maximum(n_valid, 1)
    a_desc = tma.make_tensor_descriptor(ws_ptr, [rows, cols], [stride_ws, 1], [BLOCK_K, PART_C],
                                        a_layout)
    b_desc = tma.make_tensor_descriptor(x_ptr, [rows, H], [stride_x, 1], [BLOCK_K, BLOCK_H],
                                        b_layout)
    c_desc = tma.make_tensor_descriptor(dw_ptr + v0.to(gl.int64) * stride_dw, [cols, H],
                                        [stride_dw, 1], [PART_C, BLOCK_H], c_layout)
    # stage s, consumer q's part: a_bufs[s NC + q]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES * NC, BLOCK_K, PART_C], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_H], b_layout)
    c_buf = gl.allocate_shared_memory(dw_ptr.dtype.element_ty, [NC, PART_C, BLOCK_H], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NC)   # every consumer releases a stage
    mbarrier.init(c_ready, count=1)
    mbarrier.init(c_empty, count=NC)             # every consumer's store has left c_buf
    if NC == 2:
        gl.warp_specialize([
            (_dw_ws_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, c_desc,
                               n_valid, n_cblocks, n_hblocks, ACCUMULATE, GROUP_C, 0)),
            (_dw_ws_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, c_desc,
                               n_valid, n_cblocks, n_hblocks, ACCUMULATE, GROUP_C, 1)),
            (_dw_ws_loader, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_buf, ready, empty,
                             c_ready, c_empty, n_valid, n_cblocks, n_hblocks, ACCUMULATE,
                             GROUP_C)),
        ], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_dw_ws_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, c_desc,
                               n_valid, n_cblocks, n_hblocks, ACCUMULATE, GROUP_C, 0)),
            (_dw_ws_loader, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_buf, ready, empty,
                             c_ready, c_empty, n_valid, n_cblocks, n_hblocks, ACCUMULATE,
                             GROUP_C)),
        ], [1], [40])
