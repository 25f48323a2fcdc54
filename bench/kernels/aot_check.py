"""Compile the CUDA kernels for Hopper (sm_90) on any machine, with no GPU: Triton's own
ahead-of-time path (triton.compile of an ASTSource for a GPUTarget, down to a cubin through the
ptxas that the triton wheel ships and picks for sm_90).

    python -m bench.kernels.aot_check [LABEL_PART ...]   # every case, or those whose label holds one

Each kernel is built at the tiles and flags its launcher uses for bf16 operands with TMA (the
module values, so a retuned table is what gets checked), with the divisibility-by-16 that
Triton's launcher assumes for aligned pointers and strides, and must fit the 227 KiB of shared
memory a Hopper block may take; ptxas's register and spill counts are printed beside it. This
catches what the CPU interpreter tests cannot: a kernel that does not lower (an unsupported op,
a layout or descriptor the compiler rejects) or does not fit, before any device time is spent.
It says nothing about speed or about results on the GPU.
TRITON_INTERPRET must be unset (the interpreter replaces the kernels; tests/test_aot_hopper.py
runs this in a subprocess).
"""
import contextlib
import io
import re
import sys
from typing import Optional

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs.recompute import dense
from lowerings.linear_logprobs.recompute import rows
from lowerings.linear_logprobs.fused import schedule as fused
from lowerings.linear_logprobs.fused import steps as fused_steps
from lowerings.linear_logprobs.fused import order as fused_order
from lowerings.linear_logprobs.recompute import dw_steps
from lowerings.linear_logprobs.fused import blocks as fc
from lowerings.linear_logprobs.kernels import logits as k
from lowerings.linear_logprobs.kernels import combine as kc
from lowerings.linear_logprobs.kernels import dw as kdw
from lowerings.linear_logprobs.kernels import dw_gluon as kdw_ws
from lowerings.linear_logprobs.kernels import fused_block as kf
from lowerings.linear_logprobs.kernels import rows as kr
from lowerings.linear_logprobs.kernels import splits as ks
from lowerings.linear_logprobs.launching.fast import FP_FUSION

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448                  # bytes of shared memory a block may opt into on H100 / H200
FP32_PTRS = {"m_ptr", "s_ptr", "t_ptr", "zt_ptr", "zoff_ptr", "lse_ptr", "ent_ptr", "glp_ptr", "lp_ptr",
             "gent_ptr", "glse_ptr", "dbp_ptr", "part_ptr", "g_ptr", "acc_ptr", "ref_ptr",
             "scale_ptr"}
PTR_TYPES = {"count_ptr": "*i32", "plan_ptr": "*i32", "lens_ptr": "*i64", "blk_ptr": "*i64",
             "perm_ptr": "*i64", "ids_ptr": "*i64", "z_ptr": "*fp16"}
FLOATS = {"inv_temp", "cap_pre", "cap_post", "lead"}
# scalars that are multiples of 16 at the bench shapes (Triton's launcher specializes such ints:
# the vocab sizes 151936 / 128256 / 256000, H, the strides, 2048-row blocks), so the kernels
# compile here as they do there (vectorized stores need it)
ALIGNED = {"H", "V", "N", "cols", "cols_per_split", "out_n", "n_rows", "stride_x", "stride_w",
           "stride_ws", "stride_dx", "stride_dw", "stride_z", "stride_out",
           # the recompute path's row-group and vocab-chunk starts (multiples of its 128-row
           # tiles and 256-column chunks): a masked store of ws vectorizes only when the
           # compiler knows the chunk's columns start at a multiple of 16
           "v_first", "v0", "row_first", "x_row_first", "row0"}


def _signature(fn, consts: dict, ptrs: Optional[dict] = None) -> tuple[dict, dict]:
    """(signature, attrs) of a kernel: pointer dtypes by argument name (bf16 operands; `ptrs`
    overrides some), fp32 for the logit-transform scalars, i32 for the other scalars;
    tt.divisibility 16 on pointers and on the ALIGNED scalars."""
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        if p.name.endswith("_ptr"):
            sig[p.name] = (ptrs or {}).get(p.name) or PTR_TYPES.get(
                p.name, "*fp32" if p.name in FP32_PTRS else "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i32"
        if p.name.endswith("_ptr") or p.name in ALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    assert not missing, f"{fn.__name__}: constexprs {missing} not given"
    return sig, attrs


def cases():
    """(label, kernel, constexprs, num_warps, num_stages) of each launch configuration."""
    bn, bv, bk, warps, stages = tuning.TILES
    gemm, dw = tuning.step_tiles(2)
    logit = dict(HAS_BIAS=False, HAS_CAP=False, ROUND=False, WITH_ENTROPY=True, DOT_PREC="tf32", USE_TMA=True,
                 BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=tuning.GROUP_N, STORE_E=False,
                 E_HEADROOM=fc.E_HEADROOM)
    fused_fwd = recompute = {}   # one forward kernel, one split plan (split_plan.fwd_split_plan)
    yield ("forward, fused (STORE_Z)", k._fwd_kernel,
           dict(logit, **fused_fwd, HAS_COUNT=True, STORE_Z=True), warps,
           stages)
    yield ("forward, fused, no entropy", k._fwd_kernel,
           dict(logit, **fused_fwd, WITH_ENTROPY=False, HAS_COUNT=True, STORE_Z=True), warps, stages)
    yield ("forward, fused, ROUND (round_logits)", k._fwd_kernel,
           dict(logit, **fused_fwd, ROUND=True, HAS_COUNT=True, STORE_Z=True),
           warps, stages)
    for ent in (True, False):   # the exp-scaled backward's forward (fused.exp_scaled)
        yield (f"forward, fused, STORE_E, WITH_ENTROPY={ent}", k._fwd_kernel,
               dict(logit, **fused_fwd, WITH_ENTROPY=ent, HAS_COUNT=True, STORE_Z=True,
                    STORE_E=True), warps, stages)
    yield ("forward, recompute", k._fwd_kernel,
           dict(logit, **recompute, HAS_COUNT=False, STORE_Z=False),
           warps, stages)
    yield ("forward, softcapped", k._fwd_kernel,
           dict(logit, **fused_fwd, HAS_CAP=True, HAS_COUNT=True, STORE_Z=True), warps, stages)
    yield ("dlogits, recompute", k._dlogits_kernel,
           dict({k: c for k, c in logit.items() if k not in ("STORE_E", "E_HEADROOM")},
                NEED_DB=False, HAS_COUNT=True), warps, stages)
    rr, rh, rwarps = fc.REF_TILE
    yield ("target logit reference", kf._target_ref_kernel,
           dict(HAS_BIAS=False, BLOCK_R=rr, BLOCK_H=rh), rwarps, 1)
    pr, ph, pwarps = fc.PREP_TILE
    yield ("exp-scaled c, c * X", kf._exp_prep_kernel, dict(BLOCK_R=pr, BLOCK_H=ph),
           pwarps, 1)
    en, ev, ewarps = fc.DLOGITS_TILE
    for cap, rnd in ((False, False), (True, False), (True, True)):
        yield (f"dlogits, fused in place, HAS_CAP={cap}, ROUND={rnd}", kf._fused_dlogits_kernel,
               dict(HAS_CAP=cap, ROUND=rnd, WITH_ENTROPY=True, NEED_DB=False, TILE_V=bv, BLOCK_N=en,
                    BLOCK_V=ev), ewarps, 1)
    wc, wh, wk, wwarps, wstages = dw
    for out in (False, True):
        dw_c = dict(ACCUMULATE=True, ON_DEVICE=False, DOT_PREC="tf32", USE_TMA=True,
                    TMA_OUT=out, BLOCK_C=wc, BLOCK_H=wh, BLOCK_K=wk, GROUP_C=rows.GROUP_M)
        yield (f"dW step, persistent, TMA_OUT={out}", kdw._dw_step_persistent_kernel, dw_c, wwarps,
               wstages)
        yield (f"dW step, TMA_OUT={out}", kdw._dw_step_kernel, dw_c, wwarps, wstages)
        # the fused path's pair: store and add, one of them working (fused_cuda.block_backward)
        for acc in (False, True):
            yield (f"dW step, persistent, fused, ACCUMULATE={acc}, TMA_OUT={out}",
                   kdw._dw_step_persistent_kernel, dict(dw_c, ACCUMULATE=acc, ON_DEVICE=True),
                   wwarps, wstages)
    # an fp32 dW of bf16 operands (lm_head_dtype: an fp32 lm_head multiplied in bf16): the fused
    # path takes the 4-byte dW tiles for it (fused_cuda.block_backward; the 2-byte ones need
    # 272 KiB of shared memory with an fp32 dW tile)
    fc_, fh_, fk_, fwarps_, fstages_ = tuning.step_tiles(4)[1]
    for acc in (False, True):
        yield (f"dW step, persistent, fused, fp32 dW, ACCUMULATE={acc}", kdw._dw_step_persistent_kernel,
               dict(ACCUMULATE=acc, ON_DEVICE=True, DOT_PREC="tf32", USE_TMA=True, TMA_OUT=False,
                    BLOCK_C=fc_, BLOCK_H=fh_, BLOCK_K=fk_, GROUP_C=rows.GROUP_M,
                    _ptrs={"dw_ptr": "*fp32"}), fwarps_, fstages_)
    # the Gluon warp-specialized step (sm_90's default, dw_steps.DW_WS_TILES); its num_stages
    # slot carries maxnreg (check: a Gluon kernel pipelines by hand, and its register split
    # between the partitions follows maxnreg)
    wsc, wsh, wsk, wss, wswarps, wsregs, wsnc = dw_steps.DW_WS_TILES
    for acc, nc, nwarps in ((False, wsnc, wswarps), (True, wsnc, wswarps), (True, 1, 8)):
        yield (f"dW step, warp-specialized (Gluon), ACCUMULATE={acc}, NC={nc}",
               kdw_ws._dw_step_ws_kernel,
               dict(ACCUMULATE=acc, ON_DEVICE=True, BLOCK_C=wsc, BLOCK_H=wsh, BLOCK_K=wsk,
                    GROUP_C=rows.GROUP_M, STAGES=wss, NC=nc, num_warps=nwarps), nwarps, wsregs)
    gm, gh, gk, gwarps, gstages = gemm
    tiles = dict(DOT_PREC="tf32", USE_TMA=True, BLOCK_M=gm, BLOCK_H=gh, BLOCK_K=gk)
    for store in (True, False):   # the group's last chunk (scatter to dX), or a bulk reduce-add
        yield (f"dX step, recompute, STORE={store}", kr._dx_step_kernel,
               dict(tiles, ACCUMULATE=True, STORE=store, ACC_TMA=rows.DX_ACC_TMA,
                    S_MAX=max(1, rows.DX_SPLITS), GROUP_M=rows.GROUP_M), gwarps, gstages)
    yield ("dX step's K-split partials' sum, recompute", ks._dx_split_reduce_kernel,
           dict(S_MAX=max(1, rows.DX_SPLITS), BLOCK_M=gm, BLOCK_R=rows.GATHER_ROWS,
                BLOCK_H=rows.GATHER_H, ROW_SCALE=False), 4, 1)
    rr, rh, rwarps = fc.REDUCE_TILE
    for scale in (False, True):
        yield (f"dX step, split over V, ROW_SCALE={scale}", kf._dx_split_kernel,
               dict(tiles, S_MAX=max(1, fc.DX_SPLITS), GROUP_M=rows.GROUP_M, ROW_SCALE=scale),
               gwarps, gstages)
        yield (f"dX split partials' sum, ROW_SCALE={scale}", ks._dx_split_reduce_kernel,
               dict(S_MAX=max(1, fc.DX_SPLITS), BLOCK_M=gm, BLOCK_R=rr, BLOCK_H=rh,
                    ROW_SCALE=scale), rwarps, 1)
    yield ("row gather", kr._gather_rows_kernel,
           dict(BLOCK_R=rows.GATHER_ROWS, BLOCK_H=rows.GATHER_H), 4, 1)
    yield ("gradient scaling", kf._scale_kernel, dict(BLOCK=fused_steps.SCALE_BLOCK), 8, 1)
    yield ("whole sequences first-fit", kf._first_fit_kernel,
           dict(BLOCK_G=64, CHUNK=fused_order.FIRST_FIT_CHUNK), 4, 1)
    # fp32 operands (fp32 inputs, fp32_lm_head): FP32_DOT products through pointers (TMA takes
    # 16-bit operands only), the 4-byte tiles (tuning.tiles, tuning.step_tiles(4))
    f32 = {n: "*fp32" for n in ("x_ptr", "w_ptr", "b_ptr", "ws_ptr", "dw_ptr", "dx_ptr")}
    bn4, bv4, bk4, warps4, stages4 = tuning.tiles(torch.empty(0))
    logit4 = dict(logit, DOT_PREC=tuning.FP32_DOT, USE_TMA=False, BLOCK_K=bk4)
    yield ("fp32, forward, fused (STORE_Z)", k._fwd_kernel,
           dict(logit4, HAS_COUNT=True, STORE_Z=True,
                _ptrs=dict(f32, z_ptr="*fp32")), warps4, stages4)
    yield ("fp32, forward, recompute", k._fwd_kernel,
           dict(logit4, HAS_COUNT=False, STORE_Z=False, _ptrs=f32),
           warps4, stages4)
    yield ("fp32, dlogits, recompute", k._dlogits_kernel,
           dict({k: c for k, c in logit4.items() if k not in ("STORE_E", "E_HEADROOM")},
                NEED_DB=False, HAS_COUNT=True, _ptrs=f32), warps4, stages4)
    # fp32 operands holding bf16 values (fp32_lm_head over a bf16 head): the logits GEMMs in one
    # TF32 product (tuning.logits_precision)
    prec1 = tuning.logits_precision(tuning.FP32_DOT, True)
    *_, stages1 = tuning.tiles(torch.empty(0), prec1)
    exact = dict(logit4, DOT_PREC=prec1)
    yield ("fp32 of bf16, forward, fused (STORE_Z)", k._fwd_kernel,
           dict(exact, HAS_COUNT=True, STORE_Z=True, _ptrs=dict(f32, z_ptr="*fp32")), warps4, stages1)
    yield ("fp32 of bf16, forward, recompute", k._fwd_kernel,
           dict(exact, HAS_COUNT=False, STORE_Z=False, _ptrs=f32), warps4, stages1)
    yield ("fp32 of bf16, dlogits, recompute", k._dlogits_kernel,
           dict({k: c for k, c in exact.items() if k not in ("STORE_E", "E_HEADROOM")},
                NEED_DB=False, HAS_COUNT=True, _ptrs=f32), warps4, stages1)
    gm4, gh4, gk4, gwarps4, gstages4 = tuning.step_tiles(4)[0]
    tiles4 = dict(DOT_PREC=tuning.FP32_DOT, USE_TMA=False, BLOCK_M=gm4, BLOCK_H=gh4, BLOCK_K=gk4)
    yield ("fp32, dX step, split over V", kf._dx_split_kernel,
           dict(tiles4, S_MAX=max(1, fc.DX_SPLITS), GROUP_M=rows.GROUP_M, ROW_SCALE=False,
                _ptrs=f32), gwarps4, gstages4)
    yield ("fp32, dX step, recompute", kr._dx_step_kernel,
           dict(tiles4, ACCUMULATE=True, STORE=True, ACC_TMA=False, S_MAX=max(1, rows.DX_SPLITS),
                GROUP_M=rows.GROUP_M, _ptrs=f32),
           gwarps4, gstages4)
    fc_, fh_, fk_, fwarps_, fstages_ = tuning.step_tiles(4)[1]
    yield ("fp32, dW step, persistent, fused", kdw._dw_step_persistent_kernel,
           dict(ACCUMULATE=True, ON_DEVICE=True, DOT_PREC=tuning.FP32_DOT, USE_TMA=False,
                TMA_OUT=False, BLOCK_C=fc_, BLOCK_H=fh_, BLOCK_K=fk_, GROUP_C=rows.GROUP_M,
                _ptrs=f32), fwarps_, fstages_)
    # ... and their two-product form where W / X hold bf16 values (tuning.gradient_precision)
    prec2 = tuning.gradient_precision(tuning.FP32_DOT, True)
    yield ("fp32 of bf16, dX step, split over V", kf._dx_split_kernel,
           dict(tiles4, DOT_PREC=prec2, S_MAX=max(1, fc.DX_SPLITS), GROUP_M=rows.GROUP_M,
                ROW_SCALE=False, _ptrs=f32), gwarps4, gstages4)
    yield ("fp32 of bf16, dX step, recompute", kr._dx_step_kernel,
           dict(tiles4, DOT_PREC=prec2, ACCUMULATE=True, STORE=True, ACC_TMA=False,
                S_MAX=max(1, rows.DX_SPLITS), GROUP_M=rows.GROUP_M, _ptrs=f32), gwarps4, gstages4)
    yield ("fp32 of bf16, dW step, persistent", kdw._dw_step_persistent_kernel,
           dict(ACCUMULATE=True, ON_DEVICE=True, DOT_PREC=prec2, USE_TMA=False, TMA_OUT=False,
                BLOCK_C=fc_, BLOCK_H=fh_, BLOCK_K=fk_, GROUP_C=rows.GROUP_M, _ptrs=f32),
           fwarps_, fstages_)
    cr, cwarps = tuning.COMBINE_TILE
    for ent in (False, True):   # S = 64 splits: 2 S0 at a 262144 vocab
        yield (f"forward splits' combine, WITH_ENTROPY={ent}", kc._combine_kernel,
               dict(WITH_ENTROPY=ent, HAS_COUNT=True, BLOCK_R=cr, BLOCK_S=64, STORE_E=True,
                    E_HEADROOM=fc.E_HEADROOM, TILE_V=bv), cwarps, 1)


def _ptxas_usage(log: str) -> str:
    """Registers and spill bytes a thread, from the `ptxas -v` log of Triton's own ptxas run
    (informational: spills inside a loop cost local-memory traffic every iteration)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (f"{regs.group(1) if regs else '?'} regs, spills "
            f"{'/'.join(spill.groups()) if spill else '?'} B st/ld")


def build(fn, consts: dict, num_warps: int, num_stages: int):
    """The kernel compiled for sm_90 at one case's constexprs and options (cases)."""
    consts = dict(consts)
    sig, attrs = _signature(fn, consts, consts.pop("_ptrs", None))
    if fn.is_gluon():   # num_stages is the case's maxnreg (cases)
        return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=TARGET,
                              options=dict(num_warps=num_warps, maxnreg=num_stages, enable_fp_fusion=FP_FUSION))
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=FP_FUSION))


def check(label: str, fn, consts: dict, num_warps: int, num_stages: int) -> tuple[int, str]:
    """(shared-memory bytes, ptxas usage) of the compiled kernel; raises if it does not
    compile or fit. The usage is what the ptxas Triton picks for sm_90, with Triton's own flags,
    printed (its `-v` log: knobs.nvidia.dump_ptxas_log) while it compiles; always_compile, since
    a cached kernel runs no ptxas (Triton 3.9 takes its CUDA 13 ptxas, `ptxas-blackwell`, for
    sm_90 and adds --regAllocOptLevel=2: running another ptxas on its PTX read nothing)."""
    out = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(out):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        c = build(fn, consts, num_warps, num_stages)
    if c.metadata.shared > SMEM_LIMIT:
        raise RuntimeError(f"{label}: {c.metadata.shared} bytes of shared memory > {SMEM_LIMIT}")
    return c.metadata.shared, _ptxas_usage(out.getvalue())


def main(argv=None) -> int:
    """Every case, or those whose label holds one of the arguments."""
    only = sys.argv[1:] if argv is None else argv
    print(f"triton {triton.__version__}, sm_{TARGET.arch}", flush=True)
    failed = 0
    for label, fn, consts, num_warps, num_stages in cases():
        if only and not any(o in label for o in only):
            continue
        try:
            smem, usage = check(label, fn, consts, num_warps, num_stages)
            print(f"ok    {label:38s} {fn.__name__:27s} {smem / 1024:5.1f} KiB shared, {usage}",
                  flush=True)
        except Exception as e:   # report every kernel, then fail
            failed += 1
            print(f"FAIL  {label:40s} {fn.__name__:28s} {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
