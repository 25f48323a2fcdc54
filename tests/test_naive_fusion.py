"""Tests of lowerings/naive_fusion.py: the pre-grad pass that rewrites a user's naive log-prob /
entropy / cross_entropy code into `linear_logprobs` under torch.compile(backend="inductor").

Legend: B=3, T=7, H=24, V=53, N=B*T=21. N*V = 1113 is a number no other buffer of these tests
has (N*H=504, V*H=1272, N*CHUNK_V=336), so "no buffer of N*V elements" is a sharp check. CHUNK_V
of the CPU body is lowered to 16 so that its own chunks are [N, 16], never [N, V].

Each case compiles the naive code with fullgraph=True, asserts the counters fired, compares loss
and grads (hidden, weight, bias) with the same naive code run eagerly, and reads the forward and
backward sources from run_and_get_code for N*V-sized allocations. Inductor's caches are off in
every test: a cache hit skips the pass (research/inductor-apis.md §2b). The harness (the
autouse fixture, make, check) is in naive_fusion_harness.py; the cases the pass must leave
alone and its on / off / chaining tests in test_naive_fusion_left_alone.py.
"""
import pytest
import torch
import torch.nn.functional as F

import lowerings.naive_fusion as nf
from naive_fusion_harness import (B, H, T, V, check, fired,  # noqa: F401
                                  fusion_on, logp_of, make, nv_buffers, run_case)


# --- spellings: each returns a tuple of per-token outputs -----------------------------------

def matmul_T(h, w, b, ids):
    return (logp_of(h @ w.T, ids),)


def functional_linear(h, w, b, ids):
    lp = F.log_softmax(F.linear(h, w), dim=-1)
    return (torch.gather(lp, 2, ids[..., None])[..., 0],)


def torch_matmul_t(h, w, b, ids):
    return (torch.log_softmax(torch.matmul(h, w.t()), -1).gather(-1, ids.unsqueeze(-1))[..., 0],)


def float_before(h, w, b, ids):
    return (logp_of(h.float() @ w.float().T, ids),)


def float_after(h, w, b, ids):
    return (logp_of((h @ w.T).float(), ids),)


def to_float32_after(h, w, b, ids):
    return (logp_of(F.linear(h, w).to(torch.float32), ids),)


def temperature_div(h, w, b, ids):
    return (logp_of(h @ w.T / 0.7, ids),)


def temperature_mul(h, w, b, ids):
    return (logp_of((h @ w.T) * (1 / 0.7), ids),)


def bias_linear(h, w, b, ids):
    return (logp_of(F.linear(h, w, b) / 0.7, ids),)


def bias_add_after_scale(h, w, b, ids):
    return (logp_of((h @ w.T) / 0.7 + b, ids),)


def cross_entropy(h, w, b, ids):
    logits = (h @ w.T).float()
    return (-F.cross_entropy(logits.view(-1, V), ids.view(-1), reduction="none").view(B, T),)


def cross_entropy_2d(h, w, b, ids):
    logits = h.reshape(-1, H) @ w.T
    return (-F.cross_entropy(logits, ids.reshape(-1), reduction="none"),)


def entropy_softmax(h, w, b, ids):
    logits = h @ w.T
    return (-(torch.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1),)


def entropy_exp(h, w, b, ids):
    logp_all = (h @ w.T).log_softmax(-1)
    return (-(logp_all.exp() * logp_all).sum(dim=-1),)


def logprob_and_entropy(h, w, b, ids):
    logits = F.linear(h, w, b) / 0.9
    logp_all = logits.log_softmax(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), ent


def logprob_and_entropy_2d(h, w, b, ids):
    return logprob_and_entropy(h.reshape(-1, H), w, b, ids.reshape(-1))


def trl_style_shifted(h, w, b, ids):
    """TRL: logits of every position, drop the last, keep the completion, / temperature."""
    logits = (h @ w.T)[:, :-1, :]
    logits = logits[:, -4:] / 0.7
    return (logp_of(logits, ids[:, -4:]),)


def flat_view_then_log_softmax(h, w, b, ids):
    """verl-style: flatten tokens first, gather on [N, V]."""
    logits = (h @ w.T).float().view(-1, V)
    return (logp_of(logits, ids.view(-1)),)


def gather_minus_logsumexp(h, w, b, ids):
    logits = F.linear(h, w, b)
    lp = logits.gather(-1, ids.unsqueeze(-1)) - logits.logsumexp(-1, keepdim=True)
    return (lp.squeeze(-1),)


def entropy_lse_minus_pz(h, w, b, ids):
    logits = h @ w.T / 0.7
    return (torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1),)


def z_loss_only(h, w, b, ids):
    return (torch.logsumexp(h @ w.T, dim=-1) ** 2,)


def gemma_softcap(h, w, b, ids):
    """HF Gemma 2: logits / cap, tanh, * cap; then TRL's / temperature (cap 2: logits of std ~3
    saturate)."""
    logits = (h @ w.T) / 2.0
    logits = torch.tanh(logits) * 2.0
    return (logp_of(logits / 0.7, ids),)


def scaled_softcap_entropy(h, w, b, ids):
    """A scaled head (Cohere's logit_scale) with bias, `c * z.tanh()`, log-prob and entropy."""
    logits = F.linear(h, w, b) * 0.5
    logits = 1.5 * (logits / 1.5).tanh()
    logp_all = (logits / 0.9).log_softmax(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), ent


SPELLINGS = [
    (matmul_T, (1, 0)), (functional_linear, (1, 0)), (torch_matmul_t, (1, 0)),
    (float_before, (1, 0)), (float_after, (1, 0)), (to_float32_after, (1, 0)),
    (temperature_div, (1, 0)), (temperature_mul, (1, 0)), (bias_linear, (1, 0)),
    (bias_add_after_scale, (1, 0)), (cross_entropy, (1, 0)), (cross_entropy_2d, (1, 0)),
    (entropy_softmax, (0, 1)), (entropy_exp, (0, 1)), (logprob_and_entropy, (1, 1)),
    (logprob_and_entropy_2d, (1, 1)), (trl_style_shifted, (1, 0)),
    (flat_view_then_log_softmax, (1, 0)), (gather_minus_logsumexp, (1, 0)),
    (entropy_lse_minus_pz, (1, 1)), (z_loss_only, (1, 0)), (gemma_softcap, (1, 0)),
    (scaled_softcap_entropy, (1, 1)),
]


FROZEN = [(f, e) for f, e in SPELLINGS if f in (matmul_T, bias_linear, cross_entropy,
                                                 logprob_and_entropy)]


@pytest.mark.parametrize("fn,expect,frozen",
                         [(f, e, False) for f, e in SPELLINGS] + [(f, e, True) for f, e in FROZEN],
                         ids=[f.__name__ for f, _ in SPELLINGS] + [f"{f.__name__}-frozen_w"
                                                                  for f, _ in FROZEN])
def test_spelling(fn, expect, frozen):
    sources = check(fn, expect, make_kw={"frozen": frozen, "ignore": "cross" in fn.__name__})
    hits = nv_buffers(sources)
    assert not hits, hits


CUDA_CASES = [logprob_and_entropy, cross_entropy, trl_style_shifted, float_before]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("fn", CUDA_CASES, ids=[f.__name__ for f in CUDA_CASES])
def test_spelling_cuda(fn):
    expect = dict(SPELLINGS)[fn]
    sources = check(fn, expect, make_kw={"device": "cuda", "ignore": fn is cross_entropy},
                    rtol=1e-4, atol=1e-4)
    assert not nv_buffers(sources), nv_buffers(sources)


def test_inference_no_grad():
    with torch.no_grad():
        sources = check(logprob_and_entropy, (1, 1), grads=False)
    assert not nv_buffers(sources), nv_buffers(sources)


def test_checker_sees_naive_logits():
    """The N*V check is not vacuous: without the pass the naive graph allocates [B, T, V]."""
    nf.disable_naive_logprob_fusion()
    sources = check(logprob_and_entropy, (0, 0))
    assert nv_buffers(sources)


def test_module_lm_head_and_dynamic_t():
    head = torch.nn.Linear(H, V, bias=True)
    h, _, _, ids = make()
    h = h.detach()

    def fn(h, ids):
        return logp_of(head(h) / 0.7, ids)

    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    torch._dynamo.mark_dynamic(h, 1)
    torch._dynamo.mark_dynamic(ids, 1)
    torch.testing.assert_close(compiled(h, ids), fn(h, ids), rtol=1e-5, atol=1e-5)
    h2, ids2 = h[:, :5].contiguous(), ids[:, :5].contiguous()
    torch.testing.assert_close(compiled(h2, ids2), fn(h2, ids2), rtol=1e-5, atol=1e-5)
    assert fired() == (1, 0)


def test_bf16_three_way():
    """bf16 naive code keeping bf16 logits: the result is bf16 like the naive one, and at least
    as close to a float64 reference (err(ours) <= 2 err(naive) + floor)."""
    h, w, b, ids = make(dtype=torch.bfloat16, bias=False)

    def fn(h, w, b, ids):
        logits = h @ w.T
        logp_all = logits.log_softmax(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), ent

    ref64 = fn(h.double(), w.double(), None, ids)
    naive = fn(h, w, None, ids)
    ours = torch.compile(fn, backend="inductor", fullgraph=True)(h, w, None, ids)
    assert fired() == (1, 1)
    for r, n, o in zip(ref64, naive, ours):
        assert o.dtype == n.dtype == torch.bfloat16
        err_naive, err_ours = (n.double() - r).abs().max(), (o.double() - r).abs().max()
        assert err_ours <= 2 * err_naive + 1e-3, (err_ours, err_naive)


def test_bf16_fp32_lm_head():
    h, w, b, ids = make(dtype=torch.bfloat16, bias=False)
    ref, out, ref_grads, got_grads, _ = run_case(float_before, h, w, b, ids)
    assert fired() == (1, 0) and out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    for r, o in zip(ref_grads, got_grads):
        assert o.dtype == torch.bfloat16
        torch.testing.assert_close(o.float(), r.float(), rtol=2e-2, atol=2e-2)


# --- graphs that must be left alone ---------------------------------------------------------
