"""How many row blocks of how many rows the fused schedule (schedule.py) runs for N token-level
rows: grpo_loss's fused mode (compiled_grpo/fused.py) and the naive-fusion pass's fused-gradient
rewrite (lowerings/naive_fusion/separable.py) plan alike.

R, the rows of a block, is what the workspace budget holds (one block's [R, V] logits), whole
kernel tiles, and on CUDA whole dX waves (schedule.block_align); G = cdiv(N, R) blocks, at most
MAX_BLOCKS. For a symbolic N (torch.compile under dynamic shapes) R is the budget's and G a step
of COMPILED_BLOCKS, so that a dynamic N rarely recompiles (compiled_blocks); a static one, eager or
compiled, gets the exact plan (device.is_static).
"""
from typing import Optional

from torch import Tensor

from lowerings.linear_logprobs.device import cdiv, size_hint
from lowerings.linear_logprobs.fused import schedule as _op

ROW_ALIGN = 128          # block rows: a whole number of the kernels' 128-row tiles ...
MIN_ROWS = 16            # ... or of 16 when the workspace budget is smaller (tests, tiny heads)
MAX_BLOCKS = 64          # bound on the unrolled loop (compiled graph size); past it R grows
COMPILED_BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # block counts inside torch.compile
CPU_BLOCK_ROWS = 2048     # token-level block rows at most off CUDA (V = 151936 fp32: the budget's ~1k)
WORKSPACE_MIB = 640.0     # the default budget of one block's [R, V] logits (GRPOConfig.fused_workspace_mib)


def budget_rows(hidden: Tensor, weight: Tensor, workspace_mib: float, vocab_rows: int) -> int:
    """R of a workspace budget of ``workspace_mib`` for a head of ``vocab_rows`` (V, or under
    tensor parallelism the largest shard's): workspace / (V * element size), whole tiles."""
    rows = int(workspace_mib * 2**20) // _op.ws_row_bytes(hidden, weight, vocab_rows)
    align = ROW_ALIGN if rows >= ROW_ALIGN else MIN_ROWS
    return max(MIN_ROWS, rows // align * align)


def compiled_blocks(units, per_block: int) -> Optional[int]:
    """For a symbolic size (torch.compile under dynamic shapes): the smallest G of COMPILED_BLOCKS
    (steps of ~1.5x) whose G blocks of per_block rows (or whole sequences) hold ``units``, None
    past MAX_BLOCKS. Each comparison is a shape guard, so the graph recompiles only when the size
    crosses one of these steps: the eager count, cdiv(units, per_block), would recompile at every
    multiple of the budget (8 row counts of qwen3-8b's 2048-row blocks already reach Dynamo's recompile
    limit, past which the loss runs uncompiled). The blocks past the last valid row are empty:
    their kernels exit on the device count."""
    for g in COMPILED_BLOCKS:
        if g * per_block >= units:
            return g
    return None


def token_blocks(hidden: Tensor, weight: Tensor, budget: int, n, symbolic: bool) -> tuple[int, int]:
    """(G, R) for n token-level rows (any row may be valid) under a budget of ``budget`` rows
    (budget_rows): several blocks of whole dX waves where the budget holds one, else of forward
    waves (schedule.block_align); symbolic (n a symbol of a dynamic-shape compile): static R = the
    budget and G a step of COMPILED_BLOCKS (static block shapes under a dynamic n)."""
    if hidden.device.type != "cuda":
        # The CPU body computes every row of a block, valid or not (the Triton kernels stop at
        # the device count), and a compiled graph's blocks have the budget's R rows (static
        # under dynamic N): at a small vocab ~1M rows for a batch of 32 (bench.tp's cpu-tiny,
        # V = 128: 7 s a call). CPU_BLOCK_ROWS bounds R there; N plays no part (no guard).
        budget = min(budget, CPU_BLOCK_ROWS)
    align = ROW_ALIGN if budget >= ROW_ALIGN else MIN_ROWS
    plan = _op.block_align(hidden, weight, budget // align * align)   # None off CUDA
    if plan is not None and size_hint(n) > budget:   # (block_align's docstring)
        align = plan
    budget = budget // align * align
    blocks = compiled_blocks(n, budget) if symbolic else None
    if blocks is not None:   # static R and G: static block shapes under dynamic N
        return blocks, budget
    blocks = min(MAX_BLOCKS, max(1, cdiv(size_hint(n), budget)))
    return blocks, cdiv(cdiv(n, blocks), align) * align
