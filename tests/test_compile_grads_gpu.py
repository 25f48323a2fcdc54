"""Compiled against eager gradients on CUDA at the qwen3-8b bench shape, and at two small heads
(skipped without a GPU).

B=8, T=2048 (N=16384, ~40% valid), H=4096, V=151936: several row groups and vocab chunks in every
path, so a launch that Inductor drops or misorders shows as a dX / dW / db error near 1 (the
masked recompute path's dW was 87-91% wrong at 897d288: lowerings/linear_logprobs/launching/traced.py).
Each case compiles with caches off; bench/compile_grads.py has the cases and the tolerance
(5e-3 relative: compiled and eager run the same kernels; only the fused torch ops between them
may round differently). Slow: about a minute of compile per case on an H100."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("case", __import__("bench.compile_grads", fromlist=["CASES"]).CASES)
def test_compiled_grads_equal_eager(case):
    from bench.compile_grads import run_case
    assert run_case(case), case


@pytest.mark.parametrize("shape,case", [("qwen2.5-0.5b", "loss-fused-padded"), ("gemma2-2b", "loss-fused-padded-cap")])
def test_compiled_grads_equal_eager_small_heads(shape, case):
    """Heads whose budget holds no whole dX wave: the blocks' rows come from the forward's row
    search (fused.aligned_rows: 2048 of 2176 rows at H = 896, 1152 of 1280 at gemma2-2b), in the
    compiled graph as in the eager call."""
    from bench.compile_grads import run_case
    assert run_case(case, shape), (shape, case)
