"""The forward's vocab split plan (lowerings/linear_logprobs/cuda.fwd_split_plan), shared by the
recompute, row-masked and fused CUDA paths: fixed by (V, tiles, SM count), never by N or the valid
rows (batch invariance: tests/test_batch_invariance_gpu.py checks the bits on the GPU). Pure host
arithmetic: no GPU, no interpreter.

Legend: V vocab, BN/BV the row / vocab tiles, S splits, S0 = cdiv(V, 8192)."""
import inspect

import pytest
import torch
import triton

import lowerings.linear_logprobs.cuda as tk


def _plan(monkeypatch, v, sms, bn=128, bv=256):
    monkeypatch.setattr(tk, "FWD_COLS_PER_SPLIT", 8192)   # the GPU's (another test may patch it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tk, "sm_count", lambda index: sms)
    return tk.fwd_split_plan(v, bn, bv, torch.device("cuda", 0))


@pytest.mark.parametrize("v,sms,want", [
    (151936, 132, (33, 4608)),   # qwen: 16 row blocks x 33 = 4 full waves of 132 SMs
    (128256, 132, (24, 5376)),   # llama3: 3 waves of 5376 columns, not 2 of 8192
])
def test_split_plan(monkeypatch, v, sms, want):
    assert _plan(monkeypatch, v, sms) == want


@pytest.mark.parametrize("v", [75, 32000, 151936, 256000, 262144, 600000])
@pytest.mark.parametrize("sms", [4, 78, 132])
def test_split_plan_covers_vocab(monkeypatch, v, sms):
    """S splits of whole BV tiles cover V once, the last one starting before V (each split's first
    tile has a valid column), S0 <= S <= 2 S0."""
    s, cols = _plan(monkeypatch, v, sms)
    s0 = triton.cdiv(v, 8192)
    assert cols % 256 == 0 and (s - 1) * cols < v <= s * cols
    assert triton.cdiv(v, triton.cdiv(triton.cdiv(v, s0), 256) * 256) <= s <= 2 * s0


def test_split_plan_takes_no_batch_size():
    """Nothing about the batch reaches the plan: its arguments are the shape's and the device's."""
    assert list(inspect.signature(tk.fwd_split_plan).parameters) == ["v", "bn", "bv", "device"]


def test_split_plan_off_cuda():
    """The interpreter tests (CPU tensors) take S0 splits."""
    s, cols = tk.fwd_split_plan(75, 16, 16, torch.device("cpu"))
    s0 = triton.cdiv(75, tk.FWD_COLS_PER_SPLIT)
    assert s == triton.cdiv(75, cols) and s <= s0
