"""The backward's per-step cuBLAS GEMMs of `compiled_grpo::linear_logprobs` on CUDA, and their
mutable custom-op wrappers for tracing (see recompute/dense.py for the loop that calls
them). Legend: R rows of a row group, C' columns of a vocab chunk, H hidden."""
import torch
from torch import Tensor


def _dw_rows_impl(dw: Tensor, v0: int, ws: Tensor, cols: int, x: Tensor, r0: int, rows: int,
                  accumulate: bool) -> None:
    """dw[v0 : v0 + cols] (+)= ws[:rows, :cols].T @ x[r0 : r0 + rows]: one cuBLAS GEMM with an
    fp32 accumulator, written into the dW rows (accumulate: beta = 1, one rounding to dW's
    dtype per row group; an fp32 dW of 16-bit operands (compute_dtype) through cuBLAS's fp32
    output, other mixed dtypes through fp32 temporaries)."""
    out = dw.narrow(0, v0, cols)                                           # [C', H]
    a, b = ws[:rows, :cols].T, x.narrow(0, r0, rows)                       # [C', R], [R, H]
    if dw.dtype == torch.float32 and x.dtype != torch.float32 and x.is_cuda:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif dw.dtype != x.dtype:
        prod = a.float() @ b.float()
        out.add_(prod) if accumulate else out.copy_(prod)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _dx_acc_impl(acc: Tensor, ws: Tensor, rows: int, w: Tensor, v0: int, cols: int,
                 accumulate: bool) -> None:
    """acc[:rows] (+)= ws[:rows, :cols] @ w[v0 : v0 + cols] (acc [R, H] fp32, ws and w in the
    input dtype): one cuBLAS GEMM with an fp32 output (out_dtype; beta = 1 when accumulating
    reads acc in the epilogue)."""
    out, a, b = acc[:rows], ws[:rows, :cols], w.narrow(0, v0, cols)
    if a.dtype == torch.float32 or not a.is_cuda:   # fp32 inputs; CPU interpreter tests
        out.addmm_(a.float(), b.float()) if accumulate else torch.mm(a.float(), b.float(), out=out)
    elif accumulate:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def _dx_store_impl(dx: Tensor, r0: int, rows: int, acc: Tensor) -> None:
    """dx[r0 : r0 + rows] = acc[:rows], cast to dX's dtype once."""
    dx.narrow(0, r0, rows).copy_(acc[:rows])


# The per-chunk cuBLAS steps and the per-group dX store as mutable custom ops, for tracing only
# (tuning.TRACE_LAUNCHES; by default a trace holds the whole body as one opaque op: op.py).
# Written as plain in-place / out= torch calls inside the triton_op body, functionalization turns
# each dW slice write into a slice_scatter producing a new [V, H] dW and each dX accumulation
# into mm + add producing a new tensor, and Inductor kept many of those versions alive (18 GiB
# beyond grads at N=16384, V=151936, H=4096 on H200). A custom op with mutates_args becomes
# `auto_functionalized_v2`, which Inductor's reinplace pass turns back into an in-place extern
# call on the one buffer (each version has no user after the next step), so the compiled
# backward allocates what eager does. The ops take whole buffers plus offsets and sizes and
# slice inside, so a symbolic N adds no guard (a slice bound check on a symbolic size would).
# Eager calls the impls directly (no dispatcher).
@torch.library.custom_op("compiled_grpo::_linear_logprobs_dw_rows", mutates_args=("dw",))
def _dw_rows_op(dw: Tensor, v0: int, ws: Tensor, cols: int, x: Tensor, r0: int, rows: int,
                accumulate: bool) -> None:
    _dw_rows_impl(dw, v0, ws, cols, x, r0, rows, accumulate)


@torch.library.custom_op("compiled_grpo::_linear_logprobs_dx_acc", mutates_args=("acc",))
def _dx_acc_op(acc: Tensor, ws: Tensor, rows: int, w: Tensor, v0: int, cols: int,
               accumulate: bool) -> None:
    _dx_acc_impl(acc, ws, rows, w, v0, cols, accumulate)


@torch.library.custom_op("compiled_grpo::_linear_logprobs_dx_store", mutates_args=("dx",))
def _dx_store_op(dx: Tensor, r0: int, rows: int, acc: Tensor) -> None:
    _dx_store_impl(dx, r0, rows, acc)


@_dw_rows_op.register_fake
def _(dw, v0, ws, cols, x, r0, rows, accumulate):
    return None


@_dx_acc_op.register_fake
def _(acc, ws, rows, w, v0, cols, accumulate):
    return None


@_dx_store_op.register_fake
def _(dx, r0, rows, acc):
    return None
