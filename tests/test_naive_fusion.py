"""Tests of lowerings/naive_fusion.py: the pre-grad pass that rewrites a user's naive log-prob /
entropy / cross_entropy code into `linear_logprobs` under torch.compile(backend="inductor").

Legend: B=3, T=7, H=24, V=53, N=B*T=21. N*V = 1113 is a number no other buffer of these tests
has (N*H=504, V*H=1272, N*CHUNK_V=336), so "no buffer of N*V elements" is a sharp check. CHUNK_V
of the CPU body is lowered to 16 so that its own chunks are [N, 16], never [N, V].

Each case compiles the naive code with fullgraph=True, asserts the counters fired, compares loss
and grads (hidden, weight, bias) with the same naive code run eagerly, and reads the forward and
backward sources from run_and_get_code for N*V-sized allocations. Inductor's caches are off in
every test: a cache hit skips the pass (research/inductor-apis.md §2b).
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import lowerings.linear_logprobs.cpu as torch_impl
import lowerings.linear_logprobs.op as op_module
import lowerings.naive_fusion as nf

B, T, H, V = 3, 7, 24, 53
N = B * T
PLACEHOLDER_OP = (op_module.__doc__ or "").startswith("TEMPORARY")


@pytest.fixture(autouse=True)
def fusion_on(monkeypatch):
    monkeypatch.setattr(torch_impl, "CHUNK_V", 16)     # V=53 -> chunks of 16, 16, 16, 5
    previous = inductor_config.pre_grad_custom_pass
    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        nf.enable_naive_logprob_fusion()
        try:
            yield
        finally:
            nf.disable_naive_logprob_fusion()
            inductor_config.pre_grad_custom_pass = previous
    torch._dynamo.reset()


def fired():
    c = counters["compiled_grpo"]
    return c["naive_logprob_fusion"], c["naive_entropy_fusion"]


def make(dtype=torch.float32, bias=True, frozen=False, seed=0, ignore=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 3).to(device, dtype)
    w.requires_grad_(not frozen)
    b = torch.randn(V, generator=g).to(device, dtype).requires_grad_() if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        ids[0, :3] = -100        # cross_entropy's default ignore_index
    return h, w, b, ids.to(device)


def loss_of(outs):
    """A loss touching every output with distinct fixed weights, so every grad path is checked."""
    g = torch.Generator().manual_seed(1)
    return sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)


_ALLOC = re.compile(r"empty_strided(?:_cpu|_cuda)?\(\(([^)]*)\)")
_NV_LITERAL = re.compile(rf"(?<![\w.]){N * V}L?(?![\w.])")


def nv_buffers(sources):
    """Allocations of N*V elements, and loops/sizes spelling N*V, in Inductor output code."""
    hits = []
    for src in sources:
        for dims in _ALLOC.findall(src):
            sizes = [d.strip() for d in dims.split(",") if d.strip()]
            if all(s.isdigit() for s in sizes) and math.prod(int(s) for s in sizes) == N * V:
                hits.append(f"empty_strided(({dims}))")
        hits += _NV_LITERAL.findall(src)
    return hits


def run_case(fn, h, w, b, ids, grads=True):
    """Compile `fn`, run fwd (+ bwd); return (eager outs, compiled outs, eager grads,
    compiled grads, sources)."""
    params = [t for t in (h, w, b) if t is not None and t.requires_grad]
    ref = fn(h, w, b, ids)
    ref_grads = torch.autograd.grad(loss_of(ref), params, allow_unused=True) if grads else ()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)

    def step():
        out = compiled(h, w, b, ids)
        return out, (torch.autograd.grad(loss_of(out), params, allow_unused=True) if grads else ())

    (out, got_grads), sources = run_and_get_code(step)
    return ref, out, ref_grads, got_grads, sources


def check(fn, expect, make_kw=(), grads=True, rtol=1e-5, atol=1e-5):
    h, w, b, ids = make(**dict(make_kw))
    ref, out, ref_grads, got_grads, sources = run_case(fn, h, w, b, ids, grads)
    assert fired() == expect
    assert len(sources) == (2 if grads else 1)
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=rtol, atol=atol)
    for r, o in zip(ref_grads, got_grads):
        assert (r is None) == (o is None)
        if r is not None:
            torch.testing.assert_close(o, r, rtol=rtol, atol=atol)
    return sources


def logp_of(logits, ids):
    return logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


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
    if hits and PLACEHOLDER_OP:
        pytest.xfail("lowerings.linear_logprobs is still the TEMPORARY placeholder that "
                     "materializes the logits")
    assert not hits, hits


CUDA_CASES = [logprob_and_entropy, cross_entropy, trl_style_shifted, float_before]


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
    assert not nv_buffers(sources) or PLACEHOLDER_OP


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

def logits_returned(h, w, b, ids):
    logits = h @ w.T
    return logp_of(logits, ids), logits


def log_softmax_returned(h, w, b, ids):
    logp_all = (h @ w.T).log_softmax(-1)
    return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), logp_all


def mean_cross_entropy(h, w, b, ids):
    return (F.cross_entropy((h @ w.T).view(-1, V), ids.view(-1)).reshape(1),)


def label_smoothing(h, w, b, ids):
    return (F.cross_entropy((h @ w.T).view(-1, V), ids.view(-1), reduction="none",
                            label_smoothing=0.1),)


def float64_code(h, w, b, ids):
    return (logp_of(h.double() @ w.double().T, ids),)


def two_targets(h, w, b, ids):
    logp_all = (h @ w.T).log_softmax(-1)
    return (logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            + logp_all.gather(-1, ids.flip(0).unsqueeze(-1)).squeeze(-1),)


def inplace_between(h, w, b, ids):
    logits = h @ w.T
    h2 = h.detach().clone()
    h2.mul_(2)
    return logp_of(logits, ids), h2


def broadcast_bias(h, w, b, ids):
    return (logp_of(h @ w.T + b[:1], ids),)


def bias_after_tanh(h, w, b, ids):
    return (logp_of(2.0 * torch.tanh(h @ w.T / 2.0) + b, ids),)


@pytest.mark.parametrize("fn", [logits_returned, log_softmax_returned, mean_cross_entropy,
                                label_smoothing, float64_code, two_targets, inplace_between,
                                broadcast_bias, bias_after_tanh])
def test_left_alone(fn):
    check(fn, (0, 0))


# --- installation ---------------------------------------------------------------------------

class UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return b"user-pass-v1"


def test_enable_disable_idempotent():
    nf.disable_naive_logprob_fusion()
    assert inductor_config.pre_grad_custom_pass is None
    nf.disable_naive_logprob_fusion()                     # disabling twice is harmless
    assert inductor_config.pre_grad_custom_pass is None
    nf.enable_naive_logprob_fusion()
    installed = inductor_config.pre_grad_custom_pass
    nf.enable_naive_logprob_fusion()
    assert inductor_config.pre_grad_custom_pass is installed
    assert nf.is_naive_logprob_fusion_enabled()
    assert isinstance(installed, CustomGraphPass) and isinstance(installed.uuid(), bytes)
    nf.disable_naive_logprob_fusion()
    assert inductor_config.pre_grad_custom_pass is None and not nf.is_naive_logprob_fusion_enabled()
    with nf.naive_logprob_fusion():
        assert nf.is_naive_logprob_fusion_enabled()
        with nf.naive_logprob_fusion():                   # nested: the outer one owns it
            pass
        assert nf.is_naive_logprob_fusion_enabled()
    assert inductor_config.pre_grad_custom_pass is None


@pytest.mark.parametrize("kind", ["custom_graph_pass", "plain_callable"])
def test_chains_with_user_pass(kind):
    nf.disable_naive_logprob_fusion()
    user = UserPass()
    calls = []
    user_pass = user if kind == "custom_graph_pass" else (lambda graph: calls.append(1))
    inductor_config.pre_grad_custom_pass = user_pass
    nf.enable_naive_logprob_fusion()
    nf.enable_naive_logprob_fusion()
    chained = inductor_config.pre_grad_custom_pass
    assert chained is not user_pass and nf.is_naive_logprob_fusion_enabled()
    # A uuid only when every chained pass has one (else Inductor must bypass its caches).
    assert (chained.uuid() is not None) == (kind == "custom_graph_pass")
    check(matmul_T, (1, 0))
    assert (user.calls if kind == "custom_graph_pass" else len(calls)) >= 1
    nf.disable_naive_logprob_fusion()
    assert inductor_config.pre_grad_custom_pass is user_pass
    inductor_config.pre_grad_custom_pass = None


def test_disabled_pass_does_not_fire():
    nf.disable_naive_logprob_fusion()
    check(matmul_T, (0, 0))


# --- the rewritten Dynamo graph itself (no Inductor: fast, and shows what the pass emits) ---

def dynamo_graph(fn, *args):
    rec = torch._dynamo.testing.EagerAndRecordGraphs()
    torch.compile(fn, backend=rec, fullgraph=True)(*args)
    return rec.graphs[0]


def op_names(gm):
    skip = {"placeholder", "output"}
    return [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op not in skip]


def test_pass_on_dynamo_graph_two_heads():
    """Policy and reference heads in one graph: two rewrites; nothing of the naive chain left,
    and a graph that still runs and matches."""
    h, w, b, ids = make()
    w_ref = w.detach() + 0.01

    def fn(h, w, w_ref, b, ids):
        lp, ent = logprob_and_entropy(h, w, b, ids)
        with torch.no_grad():
            ref_lp = logp_of(h @ w_ref.T, ids)
        return lp - ref_lp, ent

    gm = dynamo_graph(fn, h, w, w_ref, b, ids)
    assert nf.naive_logprob_fusion_pass(gm.graph) == 2
    gm.recompile()
    names = op_names(gm)
    assert names.count("fused_linear_logprobs") == 2, names
    for naive in ("log_softmax", "exp", "matmul", "linear", "gather", "sum", "truediv"):
        assert naive not in names, names
    by_name = {"L_h_": h, "L_w_": w, "L_w_ref_": w_ref, "L_b_": b, "L_ids_": ids}
    got = gm(*[by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    for g, r in zip(got, fn(h, w, w_ref, b, ids)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert fired() == (2, 1)
