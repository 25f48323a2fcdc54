"""Tile addressing shared by every kernel of linear_logprobs: the grouped program order
(_swizzle), the device-side valid-row count (_valid_rows), and operands read as zero-filled
tiles through TMA descriptors or masked pointer loads (_desc, _tile).
"""
import triton
import triton.language as tl

# Launch arguments that change from one row block to the next but not the code: a block's count
# pointer (counts.narrow(0, b, 1), 16-byte aligned at every other b) and the dW steps' block
# position (n_later, final: each 1 at one block). Specialized, they made Triton compile the fused
# path's 9 kernels 24 times for 8 row blocks, 10 of them the Gluon dW step (counted with
# launching/precompile.py's capture), for nothing: count is one scalar load, the others two flags.
VARYING_PTRS = ("count_ptr",)
DW_VARYING = ("n_later", "final")


@triton.jit
def _swizzle(n_blocks, n_other, GROUP_N: tl.constexpr):
    """1-D program id -> (row block, other index), GROUP_N row blocks at a time. The ~132
    resident programs then share GROUP_N row blocks of X and ~132/GROUP_N column tiles of W
    (16 MiB + 8 * 2 MiB at GROUP_N=16, BV=256: inside the 50 MB L2) instead of each streaming
    its own 1 MiB of X rows from HBM for every vocab tile (forward 45 -> 41 ms on H200)."""
    return _swizzle_id(tl.program_id(0), n_blocks, n_other, GROUP_N)


@triton.jit
def _swizzle_id(pid, n_blocks, n_other, GROUP_N: tl.constexpr):
    """_swizzle of a given tile id (persistent kernels walk several)."""
    width = GROUP_N * n_other
    first = (pid // width) * GROUP_N
    size = tl.minimum(n_blocks - first, GROUP_N)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _valid_rows(count_ptr, row0, n_rows, HAS_COUNT: tl.constexpr):
    """Rows [0, n_rows) from row0 of a valid-first order, of which the first count (a device
    int32 scalar) are valid: clamp(count - row0, 0, n_rows); n_rows without a count."""
    if HAS_COUNT:
        return tl.minimum(tl.maximum(tl.load(count_ptr) - row0, 0), n_rows)
    else:
        return n_rows


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b (fp32 acc) in tl.dot's input_precision DOT_PREC, or "tf32x2": b's fp32 values
    are exact in TF32 (bf16 values: fp32_lm_head over a bf16 head, tuning.gradient_precision), so
    of 3xTF32's products a_big b_big + a_big b_small + a_small b_big the middle one is zero.
    a_big is a rounded to TF32's 10 significand bits (+ half an ulp of TF32, then the low 13
    bits cleared: the carry rounds up into the exponent as it should), a_small = a - a_big
    (exact); two TF32 products, the small one first: 3xTF32's value at two thirds of its MMAs.
    a and b finite (the logits gradient and the operands)."""
    if DOT_PREC == "tf32x2":
        bits = a.to(tl.int32, bitcast=True)
        a_big = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)     # -8192: 0xFFFFE000
        acc = tl.dot(a - a_big, b, acc, input_precision="tf32")
        return tl.dot(a_big, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _desc(ptr, rows, cols, stride, USE_TMA: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """A [rows, cols] row-major operand (row stride `stride`) read in [BR, BC] tiles that are
    zero outside it: a TMA descriptor of that shape (its zero fill does the masking) or the
    pointer itself (_tile masks)."""
    if USE_TMA:
        return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[stride, 1],
                                         block_shape=[BR, BC])
    else:
        return ptr


@triton.jit
def _tile(src, r0, c0, rows, cols, stride, USE_TMA: tl.constexpr, BR: tl.constexpr,
          BC: tl.constexpr):
    """Tile [r0 : r0 + BR, c0 : c0 + BC] of a _desc operand, zero outside [rows, cols]."""
    if USE_TMA:
        return src.load([r0, c0])
    else:
        r = r0 + tl.arange(0, BR)
        c = c0 + tl.arange(0, BC)
        return tl.load(src + r.to(tl.int64)[:, None] * stride + c[None, :],
                       mask=(r < rows)[:, None] & (c < cols)[None, :], other=0.0)
