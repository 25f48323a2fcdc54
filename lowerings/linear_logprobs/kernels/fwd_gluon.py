"""The fused path's forward as a warp-specialized Gluon kernel (sm_90 only): the same results
as kernels.logits._fwd_kernel with STORE_Z and DEVICE_SPLITS (no bias, no softcap), its operand stages
fed by a TMA loader warp instead of the consumer's warps synchronizing at every K step.

A program is one row block of BLOCK_N rows and one split of the vocab (fused_cuda.fwd_plan_table,
read on the device at the block's valid count, as _fwd_kernel reads it):

  loader (1 warp)        for each vocab tile j of the split and K step k: X[block, k] and
                         W[tile j, k] into one STAGES-deep ring (ready / empty mbarriers; a
                         stage is free once every consumer read it)
  consumer q of NC       rows [q, q + 1) * BLOCK_N / NC of each stage's X tile, the whole W
                         tile: async wgmma over every ring position (one MMA in flight), then
                         the tile's epilogue (kernels.logits._tile_stats / _tile_out, compiled as
                         Gluon: one definition of the math) and its stores

NC = 1 (the default tiles): one 8-warp consumer, Triton's schedule with the loader warp. NC = 2:
two 4-warp consumers on the block's halves that share each stage (W loaded once per block, 48 KB
of operands per 128 x 256 x 64 step), free to drift apart by up to the ring's depth, so one
half's epilogue may run under the other's wgmmas; a half with no valid row (a block's tail)
only passes the stages on.

Not the default (fused_cuda.FWD_WS). Nsight Compute on an H100 (qwen3-8b, one full 2048-row
block, bench/results/ncu_h100_7a873e1.txt): _fwd_kernel 5.49 M cycles, NC = 1 5.53 M, NC = 2
5.66 M, the tensor pipe ~86 / 85 / 83% busy; the step in turns is level or slower
(bench/results/fwd_ws_h100.txt). What all three lose against cuBLAS's plain logits GEMM (5.01 M
cycles a block, ~96% busy) is the statistics epilogue, which no variant overlaps with the MMAs:
a 128 x 256 fp32 accumulator takes half the register file, so a second one for the next tile
does not fit, and the halves' drift (NC = 2) is bounded by the three 48 KB stages that fit in
shared memory beside the store tile (HISTORY.md). A one-bit mbarrier phase: no consumer waits on
a ring position more than STAGES past another's (a stage is refilled only once all released it).
Legend: n valid rows (count, on the device), H hidden, V vocab, BV = BLOCK_V.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowerings.linear_logprobs.kernels import logits as _k

# kernels/logits.py's helpers compiled as Gluon functions: the program's rows and split, and the
# epilogue's statistics and stored values (one definition each)
_plan_split = gluon.jit(_k._plan_split.fn)
_tile_stats = gluon.jit(_k._tile_stats.fn)
_tile_out = gluon.jit(_k._tile_out.fn)


@gluon.jit
def _fwd_ws_loader(x_desc, w_desc, x_bufs, w_bufs, ready, empty, row0, col_begin, n_tiles,
                   k_steps):
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    it = 0
    for j in range(n_tiles):
        for k in range(k_steps):
            s = it % STAGES
            # free once both consumers' MMAs that read it retired (first pass: the barriers'
            # initial phase counts as free)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row0, k * BLOCK_K], bar, x_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [col_begin + j * BLOCK_V, k * BLOCK_K], bar,
                                            w_bufs.index(s))
            it += 1


@gluon.jit
def _fwd_ws_consumer(x_bufs, w_bufs, o_bufs, z_desc, ready, empty, ids_ptr, m_ptr, s_ptr,
                     t_ptr, zt_ptr, z_ptr,
                     zoff_ptr, ref_ptr, n_valid, V, inv_temp, out_row0, out_n, split, stride_z,
                     n_ztiles, row0, col_begin, n_tiles, n_halves, k_steps,
                     WITH_ENTROPY: gl.constexpr, STORE_E: gl.constexpr,
                     E_HEADROOM: gl.constexpr, TMA_STORE: gl.constexpr, WHICH: gl.constexpr,
                     NC: gl.constexpr):
    """Row part WHICH of NC (BLOCK_N / NC rows, on this partition's warps: 4 a 64-row part)
    over every ring position j * k_steps + k. No consumer waits on a position more than STAGES
    past another's (a stage is refilled only once every consumer released it), so an
    mbarrier's one-bit phase never aliases."""
    HALF: gl.constexpr = x_bufs.type.shape[1] // NC
    BLOCK_V: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_V, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    if WHICH < n_halves:
        rows = row0 + WHICH * HALF + gl.arange(0, HALF, layout=row_layout)
        row_mask = rows < n_valid
        ids = gl.load(ids_ptr + out_row0 + rows, mask=row_mask, other=-1)
        m = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        s = gl.zeros([HALF], gl.float32, row_layout)
        t = gl.zeros([HALF], gl.float32, row_layout)
        zt = gl.zeros([HALF], gl.float32, row_layout)
        ref = m   # read only with STORE_E
        if STORE_E:
            ref = gl.load(ref_ptr + rows, mask=row_mask, other=0.0)
        rows64 = rows.to(gl.int64)
        for j in range(n_tiles):
            it0 = j * k_steps
            acc = gl.zeros([HALF, BLOCK_V], gl.float32, acc_layout)
            for k in range(k_steps):
                it = it0 + k
                st = it % STAGES
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                # this half's rows of X's tile; W's tile [BV, BK] read as its transpose
                # [BK, BV]: a K-major wgmma B operand
                acc = warpgroup_mma(x_bufs.index(st).slice(WHICH * HALF, HALF),
                                    w_bufs.index(st).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # step it - 1's MMA retired: this consumer is done with its stage
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((it0 + k_steps - 1) % STAGES), count=1)
            col0 = col_begin + j * BLOCK_V
            cols = col0 + gl.arange(0, BLOCK_V, layout=col_layout)
            col_mask = cols < V
            z = gl.where(col_mask[None, :], acc * inv_temp, float("-inf"))
            m, s, t, zt, m_sh, d, e = _tile_stats(z, cols, ids, m, s, t, zt, WITH_ENTROPY)
            val, r_t = _tile_out(d, e, m_sh, ref, STORE_E, E_HEADROOM)
            if TMA_STORE:   # through this half's smem tile: 16-byte bulk writes
                o_buf = o_bufs.index(WHICH)
                tma.store_wait(0)   # its previous tile has left o_buf
                o_buf.store(val.to(z_ptr.dtype.element_ty))
                fence_async_shared()
                # rows past n and columns past V fall outside z_desc: not written
                tma.async_copy_shared_to_global(z_desc, [row0 + WHICH * HALF, col0], o_buf)
            else:           # from the MMA's registers (4-byte pieces of each row)
                zmask = row_mask[:, None] & col_mask[None, :]
                gl.store(z_ptr + rows64[:, None] * stride_z + cols[None, :],
                         val.to(z_ptr.dtype.element_ty), mask=zmask)
            gl.store(zoff_ptr + rows64 * n_ztiles + col0 // BLOCK_V, r_t, mask=row_mask)
        out = split.to(gl.int64) * out_n + out_row0 + rows
        gl.store(m_ptr + out, m, mask=row_mask)
        gl.store(s_ptr + out, s, mask=row_mask)
        gl.store(t_ptr + out, t, mask=row_mask)
        gl.store(zt_ptr + out, zt, mask=row_mask)
        if TMA_STORE:
            tma.store_wait(0)
    else:   # no valid row in this half: pass each stage on once it has arrived
        for it in range(n_tiles * k_steps):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(st), count=1)


@gluon.jit
def _fwd_ws_kernel(x_ptr, w_ptr, ids_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, count_ptr, N, V, H,
                   stride_x, stride_w, inv_temp, out_row0, out_n, z_ptr, zoff_ptr, stride_z,
                   n_ztiles, ref_ptr, plan_ptr, WITH_ENTROPY: gl.constexpr,
                   STORE_E: gl.constexpr, E_HEADROOM: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_V: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_N: gl.constexpr,
                   STAGES: gl.constexpr, TMA_STORE: gl.constexpr, NC: gl.constexpr,
                   num_warps: gl.constexpr):
    """kernels.logits._fwd_kernel's contract with HAS_COUNT, STORE_Z, DEVICE_SPLITS, USE_TMA and no
    bias or softcap (fused_cuda.block_forward launches it in its place with FWD_WS): the same
    grid (the plan table's largest nb * S programs; those past the block's valid row blocks
    exit), the same [S, out_n] statistics, the same stored tile values and zoff references.
    NC = 2 (num_warps = 4): consumer 0 (the default partition) on rows [0, BLOCK_N / 2),
    consumer 1 and the loader are workers; NC = 1 (num_warps = 8): one consumer on the whole
    row block (Triton's 8-warp schedule, its stages fed by the loader warp instead of
    synchronizing its warps every K step), and the loader."""
    n_valid, pid_n, split, cols_per_split, programs = _plan_split(
        count_ptr, out_row0, N, plan_ptr, BLOCK_N, BLOCK_V, GROUP_N)
    if gl.program_id(0) >= programs:
        return
    HALF: gl.constexpr = BLOCK_N // NC
    row0 = pid_n * BLOCK_N
    col_begin = split * cols_per_split
    # the split's tiles that hold a column < V (the first always does; tiles wholly past V, in
    # the last split, change no statistic and have no zoff slot: _fwd_kernel masks them out)
    n_tiles = gl.cdiv(gl.minimum(cols_per_split, V - col_begin), BLOCK_V)
    n_halves = gl.minimum(gl.cdiv(n_valid - row0, HALF), NC)
    k_steps = gl.cdiv(H, BLOCK_K)
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_V, BLOCK_K], dtype)
    # operands of max(n, 1) rows (a tensor map has no empty dims); the zero fill past n and V
    # masks the last row half and vocab tile
    x_desc = tma.make_tensor_descriptor(x_ptr, [gl.maximum(n_valid, 1), H], [stride_x, 1],
                                        [BLOCK_N, BLOCK_K], x_layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, [V, H], [stride_w, 1], [BLOCK_V, BLOCK_K],
                                        w_layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], x_layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_V, BLOCK_K], w_layout)
    z_dtype: gl.constexpr = z_ptr.dtype.element_ty
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_V], z_dtype)
    # TMA_STORE: each part's stored tile goes through its own smem tile [HALF, BV] (else a
    # token buffer: the consumers store from registers)
    O_ROWS: gl.constexpr = HALF if TMA_STORE else 8
    o_bufs = gl.allocate_shared_memory(z_dtype, [NC if TMA_STORE else 1, O_ROWS, BLOCK_V],
                                       gl.NVMMASharedLayout.get_default_for([O_ROWS, BLOCK_V],
                                                                            z_dtype))
    z_desc = tma.make_tensor_descriptor(z_ptr, [gl.maximum(n_valid, 1), V], [stride_z, 1],
                                        [HALF, BLOCK_V], o_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NC)   # every consumer releases a stage
    # (the partitions' argument lists spelled out: a Gluon kernel builds no tuple of functions)
    if NC == 2:
        gl.warp_specialize([
            (_fwd_ws_consumer, (x_bufs, w_bufs, o_bufs, z_desc, ready, empty, ids_ptr, m_ptr,
                                s_ptr, t_ptr, zt_ptr, z_ptr, zoff_ptr, ref_ptr, n_valid, V,
                                inv_temp, out_row0, out_n, split, stride_z, n_ztiles, row0,
                                col_begin, n_tiles, n_halves, k_steps, WITH_ENTROPY, STORE_E,
                                E_HEADROOM, TMA_STORE, 0, NC)),
            (_fwd_ws_consumer, (x_bufs, w_bufs, o_bufs, z_desc, ready, empty, ids_ptr, m_ptr,
                                s_ptr, t_ptr, zt_ptr, z_ptr, zoff_ptr, ref_ptr, n_valid, V,
                                inv_temp, out_row0, out_n, split, stride_z, n_ztiles, row0,
                                col_begin, n_tiles, n_halves, k_steps, WITH_ENTROPY, STORE_E,
                                E_HEADROOM, TMA_STORE, 1, NC)),
            (_fwd_ws_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, row0, col_begin,
                              n_tiles, k_steps)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_fwd_ws_consumer, (x_bufs, w_bufs, o_bufs, z_desc, ready, empty, ids_ptr, m_ptr,
                                s_ptr, t_ptr, zt_ptr, z_ptr, zoff_ptr, ref_ptr, n_valid, V,
                                inv_temp, out_row0, out_n, split, stride_z, n_ztiles, row0,
                                col_begin, n_tiles, n_halves, k_steps, WITH_ENTROPY, STORE_E,
                                E_HEADROOM, TMA_STORE, 0, NC)),
            (_fwd_ws_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, row0, col_begin,
                              n_tiles, k_steps)),
        ], [1], [24])
