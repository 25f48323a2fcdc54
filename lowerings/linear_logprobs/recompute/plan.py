"""The forward's vocab split plan and the fused path's block rows, for every CUDA path
(recompute, row-masked, fused), and the row-masked recompute backward's row groups and vocab
chunks (rows_plan): host arithmetic on ints, fixed by the head (V, H, the operands' itemsize),
the tiles and the SM count, never by N (batch invariance).

Legend: V vocab, H hidden, R block rows, S vocab splits, BN / BV the forward's row / vocab
tiles, S0 = cdiv(V, FWD_COLS_PER_SPLIT).

The tiles come from tuning.py, read at call time (a patch or a sweep there reaches the plans);
recompute/dense.py imports this module, never the reverse.
"""
from typing import Optional

import torch

from lowerings.linear_logprobs import tuning as _tune
from lowerings.linear_logprobs.device import cdiv, cuda_sms, size_hint

FWD_COLS_PER_SPLIT = 8192   # fewest splits S0 = cdiv(V, 8192); see fwd_split_plan for the pick


def fwd_split_plan(v: int, h: int, itemsize: int, bn: int, bv: int,
                   device: torch.device) -> tuple[int, int]:
    """(S, columns per split) of every CUDA forward (recompute, row-masked, fused): balanced
    splits of whole BV tiles, fixed by the model's head (V, H, the operands' itemsize), the tiles
    and the device's SM count, never by N or the valid rows. That is batch invariance: a row's
    statistics are the same S partial sums merged in one order (_combine_kernel) whatever batch,
    mask, packing or path it came with, so old log-probs from a separate call give an
    on-policy ratio of exactly 1.
    The S, of S0 = cdiv(V, FWD_COLS_PER_SPLIT) .. 2 S0, is the one whose forward grid best fills
    its last wave for the fused path's default blocks (block_plan): a grid of cdiv(R, BN) x S
    programs of equal length on one program a SM. H100 / H200 (132 SMs), V = 151936:
    H = 4096, R = 2048: S = 33, 4 full waves of 4608-column programs; qwen3-4b (H = 2560:
    1664-row blocks, whole dX waves) S = 20, 2 waves of 260 programs where S = 33 ran 3.25 waves
    in 4. Off CUDA (the interpreter tests, fake-target traces) S0."""
    v, h = size_hint(v), size_hint(h)   # a fake tensor's symbolic sizes (traced host code): hints
    sms = cuda_sms(device)
    if not sms:
        s0 = cdiv(v, FWD_COLS_PER_SPLIT)
        cols = cdiv(cdiv(v, s0), bv) * bv
        return cdiv(v, cols), cols
    return block_plan(v, h, itemsize, bn, bv, sms)[:2]


# The fused path's blocks the split plan is made for: GRPOConfig.fused_workspace_mib's default
# workspace (a test ties the two), at a batch longer than one block.
PLAN_WS_BYTES = 640 << 20
# A block's fixed cost in rows' worth (its dW read-modify-write, its launches, its partial row
# tiles): the plan's tie-break between fuller last waves and fewer, larger blocks.
BLOCK_COST_ROWS = 128


def dx_wave_rows(h: int, itemsize: int, sms: int) -> int:
    """Rows whose fused dX step fills whole waves: floor(SMs / H blocks) row tiles of the step's
    BLOCK_M (H100 / H200, H = 4096, bf16: 8 x 128 = 1024)."""
    bm, bh = _tune.step_tiles(itemsize)[0][:2]
    return max(1, sms // cdiv(h, bh)) * bm


def _fwd_cost(rows: int, v: int, s: int, bn: int, bv: int, sms: int) -> tuple[float, int, int]:
    """(cost a row, S, columns a split) of a block of `rows` rows with S vocab splits: the
    forward grid's makespan (waves of equal programs, one a SM) over the ideal of its programs
    spread evenly, plus BLOCK_COST_ROWS / rows."""
    cols = cdiv(cdiv(v, s), bv) * bv
    s_eff = cdiv(v, cols)
    row_tiles = cdiv(rows, bn)
    makespan = cdiv(row_tiles * s_eff, sms) * cols
    return makespan * sms / (row_tiles * v) + BLOCK_COST_ROWS / rows, s_eff, cols


def block_rows(budget: int, v: int, h: int, itemsize: int, bn: int, bv: int, sms: int,
               splits: Optional[tuple[int, int]] = None) -> int:
    """The rows R <= budget (a multiple of BN, budget >= BN) of the fused path's blocks when the
    batch is longer than one block: whole dX waves where the budget holds one (dx_wave_rows);
    else the multiple of BN in (budget / 2, budget] costing least a row (_fwd_cost) under the
    split plan `splits` (S, cols), or jointly with S when None (block_plan). Host arithmetic on
    ints: a trace calls it as a constant of specialized sizes (fused.aligned_rows)."""
    wave = dx_wave_rows(h, itemsize, sms)
    if budget >= wave:
        return budget // wave * wave
    s_range = range(splits[0], splits[0] + 1) if splits else \
        range(cdiv(v, FWD_COLS_PER_SPLIT), 2 * cdiv(v, FWD_COLS_PER_SPLIT) + 1)
    # least cost, then the most rows
    best = min((_fwd_cost(r, v, s, bn, bv, sms)[0], -r) for r in range(budget, budget // 2, -bn)
               for s in s_range)
    return -best[1]


def block_plan(v: int, h: int, itemsize: int, bn: int, bv: int, sms: int) -> tuple[int, int, int]:
    """(S, columns a split, R): the split plan and the rows of the fused path's default blocks
    (PLAN_WS_BYTES of [R, V] workspace), chosen together (block_rows, _fwd_cost). Memoized."""
    key = (v, h, itemsize, bn, bv, sms, FWD_COLS_PER_SPLIT, PLAN_WS_BYTES, BLOCK_COST_ROWS)
    if key not in _SPLIT_PLANS:
        budget = max(bn, PLAN_WS_BYTES // (cdiv(v, 64) * 64 * itemsize) // bn * bn)
        r = block_rows(budget, v, h, itemsize, bn, bv, sms)
        s0 = cdiv(v, FWD_COLS_PER_SPLIT)
        _, s, cols = min(_fwd_cost(r, v, s, bn, bv, sms) for s in range(s0, 2 * s0 + 1))
        _SPLIT_PLANS[key] = (s, cols, r)
    return _SPLIT_PLANS[key]


_SPLIT_PLANS: dict[tuple, tuple[int, int, int]] = {}


# The recompute path's row groups and vocab chunks (recompute/rows.py): a cost model in K steps of
# one GEMM tile (128 x 256 x 64 for bf16) on one SM. Each (group, chunk) step runs three grids:
# the dlogits tiles (K = H), the dX tiles (K = the chunk's columns, then an fp32 read-modify-write
# of the accumulator) and the persistent dW tiles (K = the group's rows, then dW's read-modify-
# write); each grid takes its waves (ceil(tiles / SMs)) times a tile's K steps plus its epilogue,
# in K steps (H100, qwen3-8b bench, bench/results/recompute_plan_h100_*.txt):
ROWS_EPILOGUE = {"dlogits": 8, "dx": 13, "dw": 7}
# (Fitted while the dlogits grid ran one program a tile. Its persistent grid now overlaps part of
# that epilogue; the plans of the qwen3-8b, llama3-8b, qwen3-0.6b and gemma2-2b heads are the same
# for a dlogits epilogue of 3 to 8 K steps, so the constant stays as measured.)
# A (group, chunk) step's host time in K steps (its three launches and small ops, ~90 us in an
# eager step through fast_launch): a step takes the longer of its GPU and host times, so small
# heads, whose steps are short, take fewer, longer chunks.
ROWS_HOST_STEP = 120
ROWS_MAX_CHUNKS = 64  # chunk counts searched


def _rows_cost(r: int, c: int, v: int, h: int, itemsize: int, sms: int) -> float:
    """Modeled time a row (K-step units) of the recompute backward with row groups of r rows and
    vocab chunks of c columns (the last chunk holds the rest)."""
    bn, bv, bk = _tune.TILES[:3]
    (gm, gh, gk, *_), (wc, wh, wk, *_) = _tune.step_tiles(itemsize)
    e = ROWS_EPILOGUE
    total = 0
    for cols, count in ((c, v // c), (v % c, 1)):
        if cols == 0 or count == 0:
            continue
        dl = cdiv(cdiv(r, bn) * cdiv(cols, bv), sms) * (cdiv(h, bk) + e["dlogits"])
        dx = cdiv(cdiv(r, gm) * cdiv(h, gh), sms) * (cdiv(cols, gk) + e["dx"])
        dw = cdiv(cdiv(cols, wc) * cdiv(h, wh), sms) * (cdiv(r, wk) + e["dw"])
        total += count * max(dl + dx + dw, ROWS_HOST_STEP)
    return total / r


def rows_chunk(r: int, v: int, h: int, itemsize: int, sms: int, ws_bytes: int) -> int:
    """C, the recompute backward's vocab columns a chunk for row groups of r rows: of the chunk
    counts k = 1 .. ROWS_MAX_CHUNKS, C = cdiv(V, k) in whole BV tiles within ws_bytes of
    workspace [r, C], the one of least modeled cost (_rows_cost); BV when none fits."""
    bv = _tune.TILES[1]
    fits = [cdiv(cdiv(v, k), bv) * bv for k in range(1, ROWS_MAX_CHUNKS + 1)]
    fits = [c for c in fits if r * c * itemsize <= ws_bytes]
    if not fits:
        return bv
    return min(fits, key=lambda c: (_rows_cost(r, c, v, h, itemsize, sms), -c))


def rows_plan(v: int, h: int, itemsize: int, sms: int, budget: int,
              gathered: bool) -> tuple[int, int]:
    """(R, C) of the recompute backward on CUDA: row groups of R rows (whole row tiles of the
    logits and dX grids) and vocab chunks of C columns whose fp32 dX accumulator [R, H], gathered hidden rows
    [R, H] (the row-masked path: `gathered`) and dlogits workspace [R, C] fit `budget` bytes,
    of least modeled cost a row (_rows_cost: the three grids' waves and epilogues, the dW
    read-modify-write a group). H100 / H200, qwen3-8b head, bf16, masked, 60 MiB: R = 1024
    (the dX grid one wave of 128 tiles), C = 16896 (9 chunks; dlogits 4 waves, dW 16 tiles a
    program). Memoized; fixed by the head, the dtype and the device, never by N."""
    key = (v, h, itemsize, sms, budget, gathered, _tune.TILES, _tune.step_tiles(itemsize),
           tuple(ROWS_EPILOGUE.values()), ROWS_HOST_STEP)
    if key not in _ROWS_PLANS:
        step = max(_tune.TILES[0], _tune.step_tiles(itemsize)[0][0])   # whole row tiles of both
        row_bytes = h * (4 + itemsize * gathered)
        best = None
        for r in range(step, max(step, budget // row_bytes) + 1, step):
            c = rows_chunk(r, v, h, itemsize, sms, budget - r * row_bytes)
            cost = _rows_cost(r, c, v, h, itemsize, sms)
            if best is None or cost < best[0]:
                best = (cost, r, c)
        _ROWS_PLANS[key] = best[1:]
    return _ROWS_PLANS[key]


_ROWS_PLANS: dict[tuple, tuple[int, int]] = {}
