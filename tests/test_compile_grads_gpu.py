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


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_reduce_overhead_grads_equal_eager(mode):
    """torch.compile(mode="reduce-overhead") (CUDA graph trees) of grpo_loss at qwen2.5-0.5b:
    steps with fresh grads, the loss scaled by 1, 0.5 and 0.25 outside the compiled function
    (a trainer's loss / accumulation steps), equal eager's (5e-3 relative, as above) and no graph
    skipped. The fused backward writes a tensor the forward saved (the in-place d_weight scale,
    steps.scale_saved_grads, here with g != 1) and returns it as W's gradient: the graph trees
    replay it without a skip.

    Not tested here, not ours: accumulating micro-batches into one .grad without zeroing under
    reduce-overhead is wrong in torch 2.11's graph trees for any head (the first micro-batch's
    stolen .grad is graph memory the next replay overwrites; a plain log_softmax head gave the
    same 1/3 error at 0.5 + 0.25: pytorch/pytorch#169545, #96693). docs/gradient-modes.md says so."""
    from torch._dynamo.utils import counters

    from bench.compile_grads import _rel
    from bench.shapes import SHAPES, make_inputs
    import compiled_grpo as cg
    x = make_inputs(SHAPES["qwen2.5-0.5b"], torch.device("cuda"), targets="sampled")
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode)

    def fn(h, w):
        return cg.grpo_loss(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs,
                            config=cfg).loss

    def run(f):
        h = x.hidden.detach().clone().requires_grad_()
        w = x.weight.detach().clone().requires_grad_()
        out = []
        for s in (1.0, 0.5, 0.25, 1.0):
            (s * f(h, w)).backward()
            out.append((h.grad.clone(), w.grad.clone()))
            h.grad = w.grad = None
        return out

    torch._dynamo.reset()
    counters.clear()
    got, want = run(torch.compile(fn, fullgraph=True, mode="reduce-overhead")), run(fn)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    errs = [[_rel(a.float(), b.float()) for a, b in zip(g, e)] for g, e in zip(got, want)]
    assert max(map(max, errs)) <= 5e-3, errs   # [step][dX, dW]
