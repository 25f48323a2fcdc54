"""The fused forward's split plan (lowerings/linear_logprobs/fused_cuda.fwd_plan, fwd_plan_table):
how many ways a block's forward splits the vocabulary for the block's valid rows, a host rule
the CUDA forward and combine kernels read from a device table. Pure host arithmetic: no GPU,
no interpreter (the kernels reading the table: tests/test_fused_interpret.py).

Legend: nb row blocks of bn rows, V vocab, BV the vocab tile, S splits, S0 = cdiv(V, 8192)."""
import pytest
import torch
import triton

import lowerings.linear_logprobs.cuda as tk
import lowerings.linear_logprobs.fused_cuda as fck


@pytest.mark.parametrize("n,v,sms,want", [
    (2048, 151936, 132, (33, 4608)),   # a full qwen3-8b block: the host's pick (4 waves)
    (271, 151936, 132, (43, 3584)),    # its tail: one wave of 3584 columns, not of 4608
    (1100, 151936, 132, (29, 5376)),   # a block of whole sequences: 2 waves, not 3
    (16, 75, 4, (3, 32)),              # the interpreter tests' tiles of 16 (BV 16, S0 2)
])
def test_fwd_plan(monkeypatch, n, v, sms, want):
    """The splits for a block's valid rows (fwd_plan) as its docstring states, and its table
    (fwd_plan_table): row nb is the plan of nb row blocks, the grid holds every row's
    programs, the buffers every row's splits."""
    bn, bv, cps = (128, 256, 8192) if v > 1000 else (16, 16, 48)
    monkeypatch.setattr(tk, "FWD_COLS_PER_SPLIT", cps)
    assert fck.fwd_plan(n, v, bn, bv, sms) == want
    rows = 2048 if v > 1000 else 48
    plan, programs, splits = fck.fwd_plan_table(rows, v, bn, bv, torch.device("cpu"), sms)
    nb = triton.cdiv(n, bn)
    assert tuple(plan[nb].tolist()) == want and plan.shape == (rows // bn + 1, 2)
    assert programs == max(k * s for k, s in enumerate(plan[:, 0].tolist())) >= nb * want[0]
    assert splits == max(plan[:, 0].tolist()) <= 64


@pytest.mark.parametrize("v", [75, 32000, 151936, 262144, 600000])
@pytest.mark.parametrize("sms", [4, 78, 132])
def test_fwd_plan_covers_every_row(monkeypatch, v, sms):
    """Every split of every row-block count covers its columns once: S splits of whole BV
    tiles, the last one starting before V (each split's first tile has a valid column), S
    within [S0, 64] or S0 past 64 (a vocabulary over 512k columns)."""
    monkeypatch.setattr(tk, "FWD_COLS_PER_SPLIT", 8192)   # the GPU's (another test may patch it)
    bn, bv = 128, 256
    s0 = triton.cdiv(v, 8192)
    for nb in range(0, 18):
        s, cols = fck.fwd_plan(nb * bn, v, bn, bv, sms)
        assert cols % bv == 0 and (s - 1) * cols < v <= s * cols
        assert s <= max(64, s0) and s >= min(s0, triton.cdiv(v, cols))
