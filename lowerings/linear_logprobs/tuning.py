"""The tile tables, workspace budgets and operand switches both CUDA paths launch with (the
recompute path, recompute/; the fused path, fused/), and the tile and precision choices made
from them. One module that every launcher and plan reads at call time, so a tuning run or an
interpreter test sets an attribute here (`monkeypatch.setattr(tuning, "TILES", ...)`) and every
reader sees it. Torch only, no triton import.

Legend: N rows, H hidden, V vocab, R rows a group, C vocab columns a backward step.
"""
import torch
from torch import Tensor

# Tiles of the logits GEMM: (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages). Overridable for
# the interpreter tests (tiles of 16) and for tuning runs (set the attribute, as the sweeps do).
TILES = (128, 256, 64, 8, 3)
# Tiles of the masked and fused paths' two GEMM steps (dX, dW: recompute/rows.py, fused/blocks.py),
# (BLOCK_M, BLOCK_H, BLOCK_K, num_warps, num_stages) by operand size in bytes (tuning runs set
# the attributes, as bench.kernels.rows --sweep; the interpreter tests patch them).
GEMM_TILES = {2: (128, 256, 64, 8, 3), 4: (128, 128, 32, 8, 3), 8: (64, 64, 32, 4, 2)}  # dX step
DW_TILES = dict(GEMM_TILES)                                                             # dW step
# fp32 operands (fp32 inputs, fp32_lm_head): the products in 3xTF32 (each operand split into a
# tf32 head and tail, three tensor-core products: fp32-accurate to a few ulp), not IEEE fp32
# FMAs (20.0 s a qwen3-8b step on H200, bench/results/lm_head_precision_h200.txt). Their tiles
# take half the BLOCK_K (see tiles()); "ieee" restores the FMA products.
FP32_DOT = "tf32x3"
GROUP_N = 16                # row blocks per program group (L2 reuse, see kernels.tiles._swizzle)
COMBINE_TILE = (32, 4)      # the splits' merge (_combine_kernel): (BLOCK_R, num_warps), fixed
CHUNK_V = 6144              # backward vocab columns a step: workspace R * CHUNK_V elements
# Budget of the backward's fp32 dX accumulator, one row group of R = cdiv(N, G) rows (see
# _row_groups): 32 MiB is 2048 rows at H=4096. Raising it gives fewer groups (fewer roundings
# of dW) for more memory.
DX_GROUP_BYTES = 32 << 20
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
TMA = "1"
# The dW steps' epilogue through TMA (kernels.dw._dw_tile, TMA_OUT): the old dW is added by the L2
# (a bulk reduce-add) instead of loaded by the program. False keeps the load-add-store epilogue.
DW_TMA_OUT = True
# The recompute op's CUDA bodies inside a torch.compile trace (op.py): False (default) one opaque
# custom op a body (compiled_grpo::linear_logprobs_cuda / _cuda_backward), which runs eager's
# launches at run time; its fake traces those launches (shapes, and the precompile workers'
# kernels). True: each Triton launch a node of the traced graph (launching/traced.py's
# triton_launch), ~35 us of custom-op dispatch a launch more than eager's ~1000 a step: the compiled
# recompute step at qwen2.5-0.5b took 67.8 against 33.4 ms eager (H200, bench.probes.compile_gap).
# Caches key on the traced program: compile with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 after a change.
TRACE_LAUNCHES = False


def tiles(x: Tensor, prec: str = "") -> tuple:
    """TILES for x's operand dtype: 4-byte operands take half the BLOCK_K, so a pipeline stage
    holds the bytes of the 16-bit one (the 16-bit tiles in fp32 need 272 KiB of shared memory).
    BLOCK_N and BLOCK_V stay: the vocab split plan, the fused path's zoff tiles and the dlogits
    pass follow them. One-product TF32 dots (prec "tf32", logits_precision) read their fp32
    operands from shared memory: 3 stages beside the fused forward's and the dlogits kernel's
    128 KiB epilogue tile are more than a block has, so 2 (BLOCK_K unchanged)."""
    bn, bv, bk, warps, stages = TILES
    if x.element_size() == 4:
        bk = max(16, bk // 2)
        if prec == "tf32":
            stages = min(stages, 2)
    return bn, bv, bk, warps, stages


def step_tiles(itemsize: int) -> tuple[tuple, tuple]:
    """(GEMM_TILES, DW_TILES) entries of the dX / dW steps for operands of `itemsize` bytes."""
    size = min(8, max(2, itemsize))
    return GEMM_TILES[size], DW_TILES[size]


def logits_precision(prec: str, exact_tf32: bool) -> str:
    """The logits GEMM's precision: "tf32" where its fp32 operands hold bf16 values (exact_tf32,
    op.upcast_lm_head): 8-bit significands are exact in TF32, so 3xTF32's two tail products
    multiply zeros; one product, the same accuracy (not its bits: another summation order)."""
    return "tf32" if exact_tf32 and prec == FP32_DOT else prec


def gradient_precision(prec: str, exact_tf32: bool) -> str:
    """The dX / dW GEMMs' precision (kernels.tiles._dot): "tf32x2" where the second operand (W,
    X's rows) holds bf16 values and the first is the fp32 logits gradient: 3xTF32's product of
    the second's tail is zero, two products remain. Callers whose X is scaled (the exp-scaled
    backward) pass exact_tf32 False."""
    return "tf32x2" if exact_tf32 and prec == FP32_DOT else prec


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`: FP32_DOT for fp32, tf32 (ignored by
    16-bit dots) otherwise."""
    return FP32_DOT if dtype == torch.float32 else "tf32"
