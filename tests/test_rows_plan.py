"""The recompute path's row groups and vocab chunks on CUDA (split_plan.rows_plan, cuda_rows._plan):
host arithmetic, checked on CPU with the SM count given.

Legend: N tokens, H hidden, V vocab, R rows a group, C vocab columns a chunk, G groups.
"""
import pytest
import torch

import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs.recompute import dense
from lowerings.linear_logprobs.recompute import rows as cuda_rows
from lowerings.linear_logprobs.recompute import plan as split_plan

MIB = 1 << 20
HEADS = [(4096, 151936), (4096, 128256), (2304, 256000), (896, 151936), (1024, 151936),
         (1536, 151936), (2048, 151936), (2560, 151936)]


def test_qwen3_8b_head_fills_whole_waves():
    """H100 / H200 (132 SMs), bf16, masked, 60 MiB: one wave of dX tiles (8 x 16), C = 16896 in
    9 chunks: 8 x 66 = 528 dlogits tiles (4 waves), 132 x 16 dW tiles (16 a program)."""
    r, c = split_plan.rows_plan(151936, 4096, 2, 132, 60 * MIB, True)
    assert (r, c) == (1024, 16896)
    assert (r // 128) * (4096 // 256) == 128 and (r // 128) * (c // 256) == 4 * 132
    assert (c // 128) * (4096 // 256) == 16 * 132


@pytest.mark.parametrize("h, v", HEADS)
@pytest.mark.parametrize("sms", [132, 108, 78])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_plan_fits_its_budget_in_whole_tiles(h, v, sms, itemsize):
    budget = 60 * MIB
    r, c = split_plan.rows_plan(v, h, itemsize, sms, budget, True)
    step = max(tuning.TILES[0], tuning.step_tiles(itemsize)[0][0])
    assert r % step == 0 and c % tuning.TILES[1] == 0 and 0 < c <= -(-v // 256) * 256
    assert r * h * (4 + itemsize) + r * c * itemsize <= budget
    # no other R of the search models cheaper (ties: the first)
    cost = split_plan._rows_cost(r, c, v, h, itemsize, sms)
    for other in range(step, budget // (h * (4 + itemsize)) + 1, step):
        oc = split_plan.rows_chunk(other, v, h, itemsize, sms, budget - other * h * (4 + itemsize))
        assert cost <= split_plan._rows_cost(other, oc, v, h, itemsize, sms) + 1e-9
    assert split_plan.rows_plan(v, h, itemsize, sms, budget, True) == (r, c)   # memoized, same


@pytest.mark.parametrize("n, groups, rows", [(16384, 16, 1024), (6415, 7, 1024), (300, 1, 384),
                                             (65536, 16, 4096)])
def test_groups_follow_the_plan_until_the_group_cap(monkeypatch, n, groups, rows):
    """G = cdiv(N, R_plan) row groups, at most tuning.MAX_ROW_GROUPS (then R grows with N, as the
    dense backward's); C the plan's at R_plan, else re-planned for R, and at least the MAX_STEPS
    bound's."""
    monkeypatch.setattr(cuda_rows, "cuda_sms", lambda device: 132)
    g, r, c = cuda_rows._plan(n, 4096, 151936, 2, torch.device("cuda"))
    assert (g, r) == (groups, rows)
    few_steps = -(-(-(-151936 * g // tuning.MAX_STEPS)) // 256) * 256
    assert c >= few_steps and g * -(-151936 // c) <= tuning.MAX_STEPS
    if r == 1024:
        assert c == 16896
    elif r * 4096 * 6 < cuda_rows.ROWS_BYTES:
        assert r * 4096 * 6 + r * c * 2 <= cuda_rows.ROWS_BYTES


def test_off_cuda_keeps_the_budget_rule():
    """Without a CUDA device (interpreter tests, fake-target traces) no SM count to plan for: the
    24 MiB accumulator rule (R = 1536 at H = 4096, N = 16384) and C <= tuning.CHUNK_V."""
    g, r, c = cuda_rows._plan(16384, 4096, 151936, 2, torch.device("cpu"))
    assert (g, r, c) == (11, 1536, 6656)   # C: CHUNK_V grown to MAX_STEPS' 11 x 23 steps
