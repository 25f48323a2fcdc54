"""The row order of the fused-gradient schedule (fused/schedule.py): which rows each row block takes, valid
rows first, as device tensors (no host sync): perm (slot -> row), counts (valid rows a block)
and, for groups of rows of any size, slot (row -> slot); and which block each packed sequence
goes to (pack_sequences: first-fit decreasing; next_fit_sequences: next-fit in order).

Legend: N rows, G blocks of R rows (slots), S packed sequences.
"""

import torch
from torch import Tensor

from lowerings.linear_logprobs.device import next_power_of_2

# Whole sequences into blocks: "ffd" first-fit decreasing (pack_sequences), "next_fit" in order
# (next_fit_sequences). SEQ_PACKING = "next_fit" for A/B runs (bench code sets it).
SEQ_PACKING = "ffd"


def valid_rows_first(row_mask: Tensor) -> tuple[Tensor, Tensor]:
    """perm [N] int64, valid rows first in their original order (a stable device sort, no host
    sync), and count [1] int32, the number of valid rows (the row-masked recompute path,
    recompute/rows.py, and order_rows)."""
    perm = torch.argsort(row_mask.to(torch.uint8), descending=True, stable=True)  # [N]
    return perm, row_mask.sum(dtype=torch.int32).reshape(1)


def order_rows(row_mask: Tensor, block_rows, blocks: int) -> tuple[Tensor, Tensor]:
    """perm [N] int64 and counts [G] int32 (valid rows of each block), no host sync: all valid
    rows first (a stable sort), so blocks are full until the last valid row and later blocks
    are empty. (Whole sequences in a block: order_rows_grouped.)"""
    perm, total = valid_rows_first(row_mask)                               # [N], [1] int32
    start = torch.arange(blocks, device=row_mask.device, dtype=torch.int32) * block_rows
    counts = (total - start).clamp(min=0).clamp(max=block_rows).to(torch.int32)
    return perm, counts


def order_rows_grouped(row_mask: Tensor, row_block: Tensor, blocks: int,
                       block_rows) -> tuple[Tensor, Tensor, Tensor]:
    """The ``plan`` of fused_linear_logprobs for rows that come in groups of any size (whole
    sequences): block b takes the valid rows with row_block == b (at most R of them: the caller
    guarantees it), in row order, in R slots of its own; masked rows take no slot (their outputs
    are the 0 past the last slot, G R). No host sync; sorts and searchsorted, no scatter into
    [G] (Inductor's CPU code for an index_add into a [1] buffer fails its vectorized-store
    assert: G = 1 is common).

    row_mask [N] bool, row_block [N] int64 in [0, G) -> perm [G R] int64 (slot -> row; 0 in the
    slots past a block's rows, never used), counts [G] int32 (valid rows of each block), slot [N]
    int64 in [0, G R] (row -> slot: the outputs' way back)."""
    n, dev = row_mask.shape[0], row_mask.device
    key = row_block * 2 + (~row_mask).to(torch.int64)                                 # [N]
    order = torch.argsort(key, stable=True)                          # [N] rows in slot order
    key_s = key.index_select(0, order)                                                # [N] sorted
    blk = torch.div(key_s, 2, rounding_mode="floor")                                  # [N]
    first = torch.searchsorted(key_s, blk * 2)                # [N] each row's block's first place
    slot_sorted = blk * block_rows + torch.arange(n, device=dev) - first              # [N]
    # masked rows (odd keys) to the one slot past the blocks: perm's extra entry is dropped
    slot_sorted = torch.where(key_s % 2 == 0, slot_sorted, blocks * block_rows)
    perm = torch.zeros(blocks * block_rows + 1, dtype=torch.int64, device=dev).index_copy(
        0, slot_sorted, order)[:blocks * block_rows]                                 # [G R]
    slot = slot_sorted.index_select(0, torch.argsort(order))                          # [N]
    even = torch.arange(blocks, device=dev, dtype=torch.int64) * 2                    # [G]
    counts = (torch.searchsorted(key_s, even + 1) - torch.searchsorted(key_s, even)).to(torch.int32)
    return perm, counts, slot


def next_fit_blocks(num_sequences: int, num_rows: int, block_rows: int, max_seqlen: int) -> int:
    """A bound on the blocks that next-fit or any first-fit fills (host ints): both put at least
    k = R // max_seqlen sequences in every block but the last (a block of fewer has room for
    any sequence), and any two neighbouring blocks hold more than R rows (else the second's
    first sequence had fit the first; first-fit: any two blocks): G <= cdiv(S, k) and
    G <= 2 cdiv(N, R) - 1."""
    k = max(1, block_rows // max_seqlen)
    return max(1, min(-(-num_sequences // k), 2 * -(-num_rows // block_rows) - 1))


def pack_sequences(cu_seqlens: Tensor, block_rows: int, blocks: int) -> Tensor:
    """[S] int64: the row block of each packed sequence, first-fit decreasing: the sequences
    longest first (a stable device sort), each to the first block whose rows still hold it.
    Whole sequences in fewer blocks than next-fit in order leaves (each filled block costs a
    read-modify-write of dW and ends its GEMMs in a partial wave): 8 sequences of U[1, 2048]
    tokens into 2048-row blocks take the bound of ceil(total / R) where next-fit often takes
    one or two more. The blocks' sequences need not be neighbours: order_rows_grouped keeps
    each block's rows in row order, so their sequence ids stay sorted. Sequential over S in
    one program (first_fit_blocks: a Triton kernel on CUDA; a loop on CPU), after the sort, no
    host sync. The caller bounds every length by R and launches G blocks at least
    next_fit_blocks' bound; SEQ_PACKING = "next_fit" takes next_fit_sequences.

    cu_seqlens [S + 1] int32/int64 (0, ..., N) -> [S] int64 in [0, G)."""
    if SEQ_PACKING == "next_fit":
        return next_fit_sequences(cu_seqlens, block_rows, blocks)
    cu = cu_seqlens.to(torch.int64)                                                   # [S + 1]
    lengths = cu[1:] - cu[:-1]                                                        # [S]
    order = torch.argsort(lengths, descending=True, stable=True)                      # [S]
    blk = first_fit_blocks(lengths.index_select(0, order), int(block_rows), int(blocks))  # [S]
    return blk.index_select(0, torch.argsort(order))      # back to sequence order (a gather)


FIRST_FIT_CHUNK = 128   # _first_fit_kernel's lengths a load


@torch.library.custom_op("compiled_grpo::first_fit_blocks", mutates_args=())
def first_fit_blocks(lengths: Tensor, block_rows: int, blocks: int) -> Tensor:
    """[S] int64: sequence i = 0, 1, ... (lengths [S] in this order) to the first of `blocks`
    blocks of block_rows rows that still holds its rows (clamped to the last block). An opaque
    op (a sequential loop has no graph to trace): _first_fit_kernel on CUDA, a Python loop over
    the host copy on CPU."""
    out = torch.empty_like(lengths, dtype=torch.int64)                                # [S]
    if lengths.device.type == "cuda":
        from lowerings.linear_logprobs.kernels.fused_block import _first_fit_kernel
        if lengths.numel():
            _first_fit_kernel[(1,)](lengths, out, lengths.numel(), block_rows, blocks,
                                    BLOCK_G=next_power_of_2(max(blocks, 2)),
                                    CHUNK=FIRST_FIT_CHUNK)
        return out
    fill, got = [0] * blocks, []
    for n in lengths.tolist():
        got.append(next((j for j in range(blocks) if fill[j] + n <= block_rows), blocks - 1))
        fill[got[-1]] += n
    return out.copy_(torch.tensor(got, dtype=torch.int64))


@first_fit_blocks.register_fake
def _(lengths, block_rows, blocks):
    return torch.empty_like(lengths, dtype=torch.int64)


def next_fit_sequences(cu_seqlens: Tensor, block_rows, blocks: int) -> Tensor:
    """[S] int64: the row block of each packed sequence, next-fit in order (a block takes the
    following sequences while their rows fit its R), on the device with no host sync and no
    sequential loop: nxt[i] = the largest t with cu[t] <= cu[i] + R (the block that starts at
    sequence i ends before t), and the blocks' first sequences nxt^j(0), j < G, by doubling
    (log2 G gathers of [S + 1]). The caller bounds every length by R (max_seqlen) and launches
    G >= the blocks filled (next_fit_blocks); blocks past the last sequence stay empty.

    cu_seqlens [S + 1] int32/int64 (0, ..., N) -> [S] int64 in [0, G)."""
    cu = cu_seqlens.to(torch.int64)                                                   # [S + 1]
    n_seq = cu.shape[0] - 1
    step = torch.arange(1, n_seq + 2, device=cu.device).clamp(max=n_seq)          # [S + 1]
    # a sequence longer than R (excluded by the caller) still moves on, so the chain ends at S
    nxt = torch.maximum(torch.searchsorted(cu, cu + block_rows, right=True) - 1, step)
    first = cu.new_zeros(1)                                                           # [1]
    while first.shape[0] < blocks:   # first holds nxt^j(0), j < m; jump is nxt^m
        first = torch.cat([first, nxt.index_select(0, first)])
        nxt = nxt.index_select(0, nxt)
    first = first[:blocks]                                  # [G] non-decreasing, S once all placed
    seqs = torch.arange(n_seq, device=cu.device)                                      # [S]
    return torch.searchsorted(first, seqs, right=True) - 1
