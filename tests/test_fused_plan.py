"""The forward's vocab split plan (lowerings/linear_logprobs/split_plan.fwd_split_plan), shared by the
recompute, row-masked and fused CUDA paths: fixed by the head (V, H, itemsize), the tiles and the
SM count, never by N or the valid rows (batch invariance: tests/test_batch_invariance_gpu.py checks
the bits on the GPU), and chosen with the fused path's block rows (split_plan.block_plan) so that a
block's forward grid fills its last wave. Pure host arithmetic: no GPU, no interpreter.

Legend: V vocab, H hidden, R block rows, BN/BV the row / vocab tiles, S splits,
S0 = cdiv(V, 8192)."""
import inspect

import pytest
import torch
import triton

import lowerings.linear_logprobs.recompute.plan as sp


def _plan(monkeypatch, v, sms, h=4096, bn=128, bv=256):
    monkeypatch.setattr(sp, "FWD_COLS_PER_SPLIT", 8192)   # the GPU's (another test may patch it)
    monkeypatch.setattr(sp, "cuda_sms", lambda device: sms)
    return sp.fwd_split_plan(v, h, 2, bn, bv, torch.device("cuda", 0))


# (V, H) -> (S, columns a split, the default block's R), bf16, 132 SMs (H100 / H200)
PLANS = {
    (151936, 4096): (33, 4608, 2048),   # qwen3-8b: 16 row tiles x 33 = 4 full waves
    (128256, 4096): (24, 5376, 2048),   # llama3-8b: 3 waves of 5376 columns, not 2 of 8192
    (151936, 2560): (20, 7680, 1664),   # qwen3-4b: whole dX waves (13 row tiles x 10 H blocks);
                                        # 13 x 20 = 260 of 264 slots where S = 33 filled 429 of 528
    (151936, 896): (33, 4608, 2048),    # qwen2.5-0.5b: 2048 of the budget's 2176 rows (17 x 33
                                        # programs ran 4.25 waves in 5)
    (256000, 2304): (44, 5888, 1152),   # gemma2-2b: 9 row tiles x 44 = 3 full waves
}


@pytest.mark.parametrize("v,h", list(PLANS))
def test_split_plan(monkeypatch, v, h):
    s, cols, r = PLANS[v, h]
    assert _plan(monkeypatch, v, 132, h=h) == (s, cols)
    assert sp.block_plan(v, h, 2, 128, 256, 132) == (s, cols, r)


@pytest.mark.parametrize("v,h", list(PLANS))
def test_default_blocks_fill_forward_waves(v, h):
    """The default block's forward grid, cdiv(R, BN) x S programs, wastes under 4% of its waves
    (2.7% at qwen3-4b, whose R is whole dX waves; 0.1% at qwen)."""
    s, cols, r = sp.block_plan(v, h, 2, 128, 256, 132)
    waves = triton.cdiv(triton.cdiv(r, 128) * s, 132)
    assert waves * 132 * cols <= 1.04 * triton.cdiv(r, 128) * v


def test_plan_workspace_is_grpo_configs_default():
    """The plan is made for the fused path's default workspace."""
    import compiled_grpo as cg
    assert sp.PLAN_WS_BYTES == int(cg.GRPOConfig().fused_workspace_mib * 2**20)


@pytest.mark.parametrize("budget", [1280, 2176, 2560, 4096])
@pytest.mark.parametrize("v,h", list(PLANS))
def test_block_rows_fit_the_budget(v, h, budget):
    """Any workspace budget (a multiple of 128): R <= budget, a multiple of 128, more than half
    of it unless whole dX waves (a multiple of the wave) take it."""
    splits = sp.block_plan(v, h, 2, 128, 256, 132)[:2]
    r = sp.block_rows(budget, v, h, 2, 128, 256, 132, splits)
    wave = sp.dx_wave_rows(h, 2, 132)
    assert r <= budget and r % 128 == 0
    assert r % wave == 0 if budget >= wave else 2 * r > budget


@pytest.mark.parametrize("v", [75, 32000, 151936, 256000, 262144, 600000])
@pytest.mark.parametrize("sms", [4, 78, 132])
@pytest.mark.parametrize("h", [64, 896, 4096, 8192])
def test_split_plan_covers_vocab(monkeypatch, v, sms, h):
    """S splits of whole BV tiles cover V once, the last one starting before V (each split's first
    tile has a valid column), S0 <= S <= 2 S0."""
    s, cols = _plan(monkeypatch, v, sms, h=h)
    s0 = triton.cdiv(v, 8192)
    assert cols % 256 == 0 and (s - 1) * cols < v <= s * cols
    assert triton.cdiv(v, triton.cdiv(triton.cdiv(v, s0), 256) * 256) <= s <= 2 * s0


def test_split_plan_takes_no_batch_size():
    """Nothing about the batch reaches the plan: its arguments are the head's and the device's."""
    assert list(inspect.signature(sp.fwd_split_plan).parameters) == ["v", "h", "itemsize", "bn", "bv",
                                                                     "device"]


def test_split_plan_off_cuda():
    """The interpreter tests (CPU tensors) take S0 splits."""
    s, cols = sp.fwd_split_plan(75, 32, 2, 16, 16, torch.device("cpu"))
    s0 = triton.cdiv(75, sp.FWD_COLS_PER_SPLIT)
    assert s == triton.cdiv(75, cols) and s <= s0


def test_block_align_eager_and_traced(monkeypatch):
    """fused.block_align on (fake) CUDA heads: whole dX waves where the budget holds one, else
    the forward's fullest waves, eager or traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import lowerings.linear_logprobs.fused.schedule as lf
    from lowerings.linear_logprobs import device
    monkeypatch.setitem(device._SMS, 0, 132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sp, "FWD_COLS_PER_SPLIT", 8192)
    with FakeTensorMode():
        head = lambda h: (torch.empty(64, h, device="cuda:0", dtype=torch.bfloat16),  # noqa: E731
                          torch.empty(151936, h, device="cuda:0", dtype=torch.bfloat16))
        small, wide = head(896), head(2560)
    assert lf.block_align(*small, 2176) == 2048
    assert lf.block_align(*wide, 2176) == 1664
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lf.block_align(*small, 2176) == 2048
    assert lf.block_align(*wide, 2176) == 1664


def test_aligned_rows_in_a_dynamic_trace(monkeypatch):
    """The search inside torch.compile(fullgraph=True, dynamic=True), where H, V and the budget
    are symbolic: the eager rows (qwen2.5-0.5b: 2048 of 2176), no graph break, and another head
    recompiles (the sizes are specialized) instead of reusing rows chosen for the first."""
    import lowerings.linear_logprobs.fused.schedule as lf
    from lowerings.linear_logprobs import device
    monkeypatch.setitem(device._SMS, 0, 132)
    monkeypatch.setattr(sp, "FWD_COLS_PER_SPLIT", 8192)
    heads = [(896, 151936, 2176), (896, 4 * 151936, 512)]
    with monkeypatch.context() as m:   # the eager answers; Dynamo itself needs a CUDA-less torch.cuda
        m.setattr(torch.cuda, "is_available", lambda: True)
        want = [lf.aligned_rows(h, v, b, 2, 132, 0) for h, v, b in heads]
        plans = {(v, h): sp.fwd_split_plan(v, h, 2, 128, 256, torch.device("cuda", 0)) for h, v, _ in heads}
    monkeypatch.setattr(sp, "fwd_split_plan", lambda v, h, *args: plans[(v, h)])
    frames = []

    def count(gm, example_inputs):
        frames.append(gm)
        return gm

    @torch.compile(fullgraph=True, dynamic=True, backend=count)
    def rows(x, w):
        budget = (640 << 20) // (w.shape[0] * 2) // 128 * 128   # [R, V] bf16 in 640 MiB
        r = lf.aligned_rows(x.shape[-1], w.shape[0], budget, 2, 132, 0)
        return x.new_zeros(budget // r * r)

    x, w = torch.empty(4, 896), torch.empty(151936, 1)
    assert want[0] == 2048 and rows(x, w).shape[0] == 2048 and rows(torch.empty(9, 896), w).shape[0] == 2048
    assert len(frames) == 1
    assert rows(x, torch.empty(4 * 151936, 1)).shape[0] == want[1] and len(frames) == 2
