"""The pass's fused-gradient rewrite (lowerings/naive_fusion/separable.py): a compiled step whose
loss sums per-token terms of the naive log-probs gets the fused schedule (the loss's gradient
formed in the forward's row blocks, no backward GEMM recompute); any other loss keeps the
recompute op, the reason counted. Every case: the compiled loss and gradients against the same
code run eagerly (unfused) in the same dtype.

Legend: B sequences, T tokens, H hidden, V vocab.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import lowerings.naive_fusion as nf
from lowerings.naive_fusion import separable
from naive_fusion_harness import fusion_on  # noqa: F401 (autouse: the pass on, caches off)

B, T, H, V = 3, 11, 24, 53


def batch(seed=0, dtype=torch.float32, device="cpu", bias=False, b=B, t=T, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(b, t, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 3 / math.sqrt(h)).to(device, dtype).requires_grad_()
    bb = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    ids = torch.randint(0, v, (b, t), generator=g).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.3).to(device)
    mask[:, 0] = True
    adv = torch.randn(b, generator=g).to(device)
    with torch.no_grad():   # near the policy's own log-probs, as in a GRPO step (ratios ~1)
        lp = logprobs(hid, w, bb, ids)
    old = lp + (0.3 * torch.randn(b, t, generator=g)).to(device)
    ref = lp + (0.3 * torch.randn(b, t, generator=g)).to(device)
    return hid, w, bb, ids, mask, adv, old, ref


def logprobs(h, w, b, ids, temperature=0.9):
    logits = F.linear(h, w, b).float() / temperature                     # [B, T, V]
    return logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def dapo(h, w, b, ids, mask, adv, old, ref):
    """TRL's DAPO loss with a k3 KL (bench/dapo.py's math)."""
    lp = logprobs(h, w, b, ids)
    coef = torch.exp(lp - old)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.28) * adv[:, None])
    d = ref - lp
    per_token = per_token + 0.04 * (torch.exp(d) - d - 1)
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def grpo_seq_mean(h, w, b, ids, mask, adv, old, ref):
    """GRPO's per-sequence mean, then the batch mean; on-policy ratio lp - lp.detach() (TRL's
    old_per_token_logps = per_token_logps.detach()); an entropy bonus of the same logits."""
    logits = (h @ w.T).float()
    logp_all = logits.log_softmax(-1)
    lp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    coef = torch.exp(lp - lp.detach())
    per_token = -coef * adv.unsqueeze(1) - 0.01 * ent
    m = mask.float()
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def cross_entropy_sum(h, w, b, ids, mask, adv, old, ref):
    """An SFT-style masked token sum of cross-entropy over flattened rows."""
    z = F.linear(h, w, b).view(-1, w.shape[0])
    nll = F.cross_entropy(z, ids.view(-1), reduction="none")
    return (nll * mask.view(-1)).sum() / B


def trl_fp32_dapo(h, w, b, ids, mask, adv, old, ref):
    """TRL 1.16's selective_log_softmax on fp32 logits (CPU): gather - a per-row logsumexp loop,
    (lp + lse) - lse after the rewrite, the lse's gradient cancelling (separable._cancel_lse)."""
    from trl.trainer.utils import selective_log_softmax
    lp = selective_log_softmax(F.linear(h, w, b).float(), ids, temperature=0.9)
    coef = torch.exp(lp - old)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.28) * adv[:, None])
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def gspo(h, w, b, ids, mask, adv, old, ref):
    """GSPO: a sequence's ratio is exp of its mean log-ratio, a nonlinear function of a sum."""
    lp = logprobs(h, w, b, ids)
    m = mask.float()
    seq = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    coef = torch.exp(seq)
    return -(torch.min(coef * adv[:, None], coef.clamp(0.8, 1.2) * adv[:, None]) * m).sum() / m.sum()


def lp_normalized(h, w, b, ids, mask, adv, old, ref):
    """A normalizer computed from the log-probs (detached): not a constant of the loss."""
    lp = logprobs(h, w, b, ids)
    return (lp * mask).sum() / lp.detach().abs().sum()


def returns_logprobs(h, w, b, ids, mask, adv, old, ref):
    lp = logprobs(h, w, b, ids)
    return (lp * mask).sum(), lp


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def masked_sum(h, w, b, ids, mask, adv, old, ref):
    lp = (h @ w.T).float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum()


def run(fn, args, dynamic=False):
    """(eager loss, grads), (compiled loss, grads), (float64 loss, grads), Inductor's sources."""
    params = [t for t in args[:3] if t is not None]
    want = _loss(fn(*args))
    want_g = torch.autograd.grad(want, params)
    gold_args = [t.detach().double().requires_grad_(t.requires_grad)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    gold = _loss(fn(*gold_args))
    gold_g = torch.autograd.grad(gold, [t for t in gold_args[:3] if t is not None])
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)

    def step():
        got = _loss(compiled(*args))
        return got, torch.autograd.grad(got, params)

    (got, got_g), sources = run_and_get_code(step)
    return (want, want_g), (got, got_g), (gold, gold_g), sources


def assert_same(want, got, gold, floor=1e-6):
    """Ours within 2x eager's error of the float64 result (relative, by norm), loss and grads."""
    for e, o, ref in zip((want[0], *want[1]), (got[0], *got[1]), (gold[0], *gold[1])):
        assert o.dtype == e.dtype and o.shape == e.shape
        scale = ref.norm().clamp(min=1e-30)
        err_e, err_o = ((x.double() - ref).norm() / scale for x in (e, o))
        assert err_o <= 2 * err_e + floor, (err_o.item(), err_e.item())


@pytest.mark.parametrize("fn,bias", [(dapo, False), (dapo, True), (grpo_seq_mean, False),
                                     (cross_entropy_sum, True), (trl_fp32_dapo, True)],
                         ids=["dapo", "dapo-bias", "grpo-seq-mean-entropy", "cross-entropy-sum",
                              "trl-fp32-selective-log-softmax"])
def test_separable_loss_takes_the_fused_schedule(fn, bias, monkeypatch):
    """Fused: counted, the op's recompute backward gone from the compiled graphs (the block steps
    instead), loss and gradients equal eager's (fp32: 1e-5). A small workspace: several blocks."""
    monkeypatch.setattr(separable, "WORKSPACE_MIB", 16 * V * 4 / 2**20)   # 16-row blocks: 3
    want, got, gold, sources = run(fn, batch(bias=bias))
    assert dict(counters["compiled_grpo_gradient"]) == {"fused": 1}
    code = "\n".join(sources)
    assert "fused_block_forward" in code and "fused_block_backward" in code
    assert "linear_logprobs_backward" not in code and "linear_logprobs_cpu_backward" not in code
    assert_same(want, got, gold)


@pytest.mark.parametrize("fn,reason", [(gspo, "not_separable"), (lp_normalized, "not_separable"),
                                       (returns_logprobs, "no_loss")])
def test_other_losses_keep_the_recompute_op(fn, reason):
    want, got, gold, sources = run(fn, batch())
    assert dict(counters["compiled_grpo_gradient"]) == {reason: 1}
    assert counters["compiled_grpo"]["naive_logprob_fusion"] == 1
    assert "fused_block_forward" not in "\n".join(sources)
    assert_same(want, got, gold)


def test_no_gradient_keeps_the_recompute_op():
    """Under no_grad no output takes a gradient (no_loss); a frozen head and hidden states take
    none (no_grad)."""
    args = batch()
    with torch.no_grad():
        torch.compile(dapo, fullgraph=True)(*args)
    assert counters["compiled_grpo_gradient"]["no_loss"] == 1
    torch._dynamo.reset()
    frozen = [t.detach() if i < 2 else t for i, t in enumerate(args)]
    torch.compile(dapo, fullgraph=True)(*frozen)
    assert counters["compiled_grpo_gradient"]["no_grad"] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("fn", [masked_sum, dapo], ids=["matmul", "linear-float-temperature"])
def test_dynamic_shapes_one_graph_for_several_lengths(device, fn):
    """dynamic=True: a symbolic N plans G as a step of plan.COMPILED_BLOCKS with static R, as
    grpo_loss's compiled fused mode does: three lengths, one frame, every one fused and equal to
    eager within 2x its error of float64. (dapo's temperature, a float default argument, reaches
    the graph as a symbolic float: z / t = (h / t) @ W.T, match._sym_float.)"""
    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=cnt, dynamic=True, fullgraph=True)
    for t in (9, 13, 17):
        args = batch(t=t, seed=t, device=device)
        params = list(args[:2])
        got = compiled(*args)
        got = (got, torch.autograd.grad(got, params))
        want = fn(*args)
        want = (want, torch.autograd.grad(want, params))
        gold_args = [x.detach().double().requires_grad_(x.requires_grad) if x is not None and x.is_floating_point()
                     else x for x in args]
        gold = fn(*gold_args)
        gold = (gold, torch.autograd.grad(gold, gold_args[:2]))
        assert_same(want, got, gold)
    assert cnt.frame_count == 1
    assert dict(counters["compiled_grpo_gradient"]) == {"fused": 1}


def test_switched_off():
    """FUSED_GRADIENT = False: the log-prob rewrite alone (the recompute op), nothing counted."""
    nf.FUSED_GRADIENT = False
    try:
        want, got, gold, sources = run(dapo, batch())
    finally:
        nf.FUSED_GRADIENT = True
    assert not counters["compiled_grpo_gradient"]
    assert "fused_block_forward" not in "\n".join(sources)
    assert_same(want, got, gold)


def test_gradient_through_other_paths_is_kept():
    """A loss with a second gradient path (an auxiliary term of hidden, a learnable coefficient):
    the attach passes the incoming gradient on to the loss's own graph."""
    h, w, b, ids, mask, adv, old, ref = batch()
    scale = torch.tensor(0.7, requires_grad=True)

    def fn(h, w, scale, ids, mask):
        lp = logprobs(h, w, None, ids)
        return scale * (lp * mask).sum() / mask.sum() + 1e-2 * h.square().mean() + scale.square()

    want, got, gold, _ = run(fn, (h, w, scale, ids, mask))
    assert counters["compiled_grpo_gradient"]["fused"] == 1
    assert_same(want, got, gold)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_schedule_cuda_real_shape(dtype):
    """On CUDA at a shape with several row blocks and vocab tiles (4 x 1024 tokens, V = 32000):
    the compiled step with the pass against the same code eagerly (unfused: bf16 logits cast to
    fp32, as the naive code rounds them) and against it in float64; ours within 2x eager's error
    of the float64 loss and gradients."""
    args = batch(dtype=dtype, device="cuda", b=4, t=1024, h=512, v=32000)
    separable.WORKSPACE_MIB, keep = 1024 * 32000 * 4 / 2**20, separable.WORKSPACE_MIB   # 4 blocks
    try:
        want, got, gold, _ = run(dapo, args)
    finally:
        separable.WORKSPACE_MIB = keep
    assert counters["compiled_grpo_gradient"]["fused"] == 1
    assert_same(want, got, gold)
