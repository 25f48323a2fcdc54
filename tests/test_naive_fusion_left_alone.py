"""Tests of lowerings/naive_fusion.py, continued (test_naive_fusion.py has the legend and the
method): code the pass must leave alone, how it is switched on and off and chained with a user's
pass, and the pass on a Dynamo graph of two heads."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import lowerings.naive_fusion as nf
from naive_fusion_harness import V, check, fired, fusion_on, logp_of, make, pass_on_graph  # noqa: F401
from test_naive_fusion import logprob_and_entropy, matmul_T


def logits_returned(h, w, b, ids):
    logits = h @ w.T
    return logp_of(logits, ids), logits


def log_softmax_returned(h, w, b, ids):
    logp_all = (h @ w.T).log_softmax(-1)
    return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), logp_all


def two_ignore_indices(h, w, b, ids):   # one op call has one set of kept targets
    z = (h @ w.T).view(-1, V)
    return (F.cross_entropy(z, ids.view(-1), reduction="none", ignore_index=3),
            F.cross_entropy(z, ids.view(-1), reduction="none", ignore_index=5))


def label_smoothing(h, w, b, ids):   # under a softcap: the logits' sum is no longer linear in h
    return (F.cross_entropy((30.0 * torch.tanh((h @ w.T) / 30.0)).view(-1, V), ids.view(-1), reduction="none",
                            label_smoothing=0.1),)


def float64_code(h, w, b, ids):
    return (logp_of(h.double() @ w.double().T, ids),)


def two_targets(h, w, b, ids):
    logp_all = (h @ w.T).log_softmax(-1)
    return (logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            + logp_all.gather(-1, ids.flip(0).unsqueeze(-1)).squeeze(-1),)


def grad_switch_between(h, w, b, ids):
    """A scale of the logits under torch.no_grad() (the log-probs after it carry no gradient):
    the logits' chain crosses a grad-mode switch. (A no-grad region holding consumers only, or
    nothing of the head's, fuses: tests/test_naive_fusion_spellings.py.)"""
    logits = h @ w.T
    with torch.no_grad():
        logits = logits / 0.9
    return (logp_of(logits, ids) + 0 * h.sum(),)


def broadcast_bias(h, w, b, ids):
    return (logp_of(h @ w.T + b[:1], ids),)


def bias_after_tanh(h, w, b, ids):
    return (logp_of(2.0 * torch.tanh(h @ w.T / 2.0) + b, ids),)


def view_before_inplace(h, w, b, ids):
    """A view of the logits taken before their in-place scale and read after it: it sees the
    write, so the scale stays in place (inplace.py) and the logits with it."""
    logits = h @ w.T
    first = logits[:, :1]
    logits.div_(0.7)
    return logp_of(logits, ids), first * 1.0


def read_before_inplace(h, w, b, ids):
    logits = h @ w.T
    total = logits.sum(-1)          # read before the write
    logits.div_(0.7)
    return logp_of(logits, ids), total


def inplace_on_a_shared_view(h, w, b, ids):
    """The scaled tensor is a view of logits that are also read elsewhere."""
    logits = h @ w.T
    last = logits[:, -1:]
    last.mul_(2.0)
    return logp_of(logits, ids), last.sum(-1)


@pytest.mark.parametrize("fn", [logits_returned, log_softmax_returned, two_ignore_indices,
                                label_smoothing, float64_code, two_targets, grad_switch_between,
                                broadcast_bias, bias_after_tanh, view_before_inplace,
                                read_before_inplace, inplace_on_a_shared_view])
def test_left_alone(fn):
    check(fn, (0, 0))
    unfused = counters["compiled_grpo_unfused"]
    assert sum(unfused.values()) >= 1 and set(unfused) <= set(nf.UNFUSED_REASONS), dict(unfused)


def write_to_the_hidden_copy(h, w, b, ids):
    """A write, between the GEMM and the gather, to the tensor the GEMM read: the fused call
    (where the gather stands) would read the new values. Left alone. (No gradients: autograd
    itself refuses the write to a tensor the GEMM saved.)"""
    hc = h.detach().clone()
    logits = hc @ w.detach().T
    hc.mul_(2.0)
    return logp_of(logits, ids), hc


def write_to_a_temperature(h, w, b, ids):
    t = torch.full((1,), 0.7)     # a tensor the graph made: only the read rule refuses the write
    logits = (h.detach() @ w.detach().T) / t
    t.mul_(2.0)
    return (logp_of(logits, ids),)


@pytest.mark.parametrize("fn", [write_to_the_hidden_copy, write_to_a_temperature])
def test_writes_to_what_the_rewrite_reads_are_left_alone(fn):
    check(fn, (0, 0), grads=False)
    assert counters["compiled_grpo_unfused"]["region"] == 1, dict(counters["compiled_grpo_unfused"])


def tensordot_head(h, w, b, ids):   # a GEMM spelling the pass does not know (einsum it does)
    return (logp_of(torch.tensordot(h, w, dims=([2], [1])), ids),)


def hand_written_log_softmax(h, w, b, ids):
    """max, exp, sum written out: no log_softmax / logsumexp for the pass to see."""
    z = h @ w.T
    m = z.amax(-1, keepdim=True)
    return (z.gather(-1, ids[..., None])[..., 0] - (m.squeeze(-1) + (z - m).exp().sum(-1).log()),)


class _HandSoftmax(torch.autograd.Function):
    """A trainer's own log-softmax with a hand-written backward (Dynamo: a subgraph)."""

    @staticmethod
    def forward(ctx, z, ids):
        p = z.softmax(-1)
        ctx.save_for_backward(p, ids)
        return p.log().gather(-1, ids[..., None])[..., 0]

    @staticmethod
    def backward(ctx, g):
        p, ids = ctx.saved_tensors
        return (-p * g[..., None]).scatter_add(-1, ids[..., None], g[..., None]), None


def autograd_function_head(h, w, b, ids):
    return (_HandSoftmax.apply(h @ w.T, ids),)


def logits_max_with_gradient(h, w, b, ids):
    """A row max that carries a gradient (to its argmax) beside the log-probs: the extrema op has
    none, so the logits stay (counted; detached min / max metrics fuse:
    test_naive_fusion_extrema.py)."""
    z = h @ w.T
    return logp_of(z, ids), z.max(-1).values


@pytest.mark.parametrize("fn,reason", [(logits_returned, "logits_users"),
                                       (logits_max_with_gradient, "logits_users"),
                                       (float64_code, "gemm_unmatched"),
                                       (grad_switch_between, "region"), (tensordot_head, "no_gemm"),
                                       (hand_written_log_softmax, "unrecognized"),
                                       (autograd_function_head, "unrecognized")])
def test_unfused_reason_counted_and_logged_once(fn, reason, caplog, monkeypatch):
    """A log-prob graph the pass leaves unfused is counted by why and logged, once a reason a
    process: a torch upgrade that changes how Dynamo records a spelling shows up, never a silent
    loss of the fusion."""
    monkeypatch.setattr(nf.unfused, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=nf.__name__):
        check(fn, (0, 0))
        first = [r for r in caplog.records if reason in r.getMessage()]
        torch._dynamo.reset()
        check(fn, (0, 0))
    assert counters["compiled_grpo_unfused"][reason] == 2, dict(counters["compiled_grpo_unfused"])
    assert len(first) == 1 and len([r for r in caplog.records if reason in r.getMessage()]) == 1


def inplace_scale_and_logits_returned(h, w, b, ids):
    logits = h @ w.T
    logits.div_(0.7)
    return logp_of(logits, ids), logits


def sliced_log_softmax_returned(h, w, b, ids):
    return (F.log_softmax(h @ w.T, dim=-1)[:, :-1],)


def legacy_nll_of_sliced_log_softmax(h, w, b, ids):
    """Two respellings (the view taken of the logits, then nll_loss(log_softmax) as
    cross_entropy) that no rewrite uses (the legacy reduce= argument): both put back."""
    return (F.nll_loss(F.log_softmax(h @ w.T, dim=-1).view(-1, V), ids.view(-1), reduce=False),)


def arange_indexed_beside_the_log_probs(h, w, b, ids):
    logp = torch.log_softmax(h @ w.T, dim=-1).view(-1, V)
    return logp[torch.arange(logp.shape[0]), ids.view(-1)], logp


def categorical_probs_returned(h, w, b, ids):
    """Categorical's log_prob and entropy (both respelled) and its normalized logits returned:
    the [N, V] log-probs are needed, nothing fuses, both respellings are put back."""
    d = torch.distributions.Categorical(logits=h @ w.T)
    return d.log_prob(ids), d.entropy(), d.logits


def complement_of(fill, stop=V, logits_returned=False):
    """-softplus(logsumexp(where(arange(stop) == ids, fill, z[..., :stop])) - z_t)."""
    def f(h, w, b, ids):
        z = F.linear(h, w, b).float()
        zt = z.gather(-1, ids[..., None]).squeeze(-1)
        others = torch.logsumexp(torch.where(torch.arange(stop) == ids[..., None], fill, z[..., :stop]), -1)
        return (-F.softplus(others - zt),) + ((z,) if logits_returned else ())
    return f


@pytest.mark.parametrize("fn", [inplace_scale_and_logits_returned, sliced_log_softmax_returned,
                                legacy_nll_of_sliced_log_softmax, arange_indexed_beside_the_log_probs,
                                categorical_probs_returned, complement_of(float("-inf"), logits_returned=True)])
def test_unused_respellings_are_undone(fn):
    """An in-place scale made out of place, a view taken of the logits, nll_loss read as
    cross_entropy, arange indexing read as a gather, Categorical's gather through
    broadcast_tensors (normalize.py), none of them then used by a rewrite (the logits or all log-probs returned, a legacy reduce=): put back as the user wrote
    them, the same ops in the same order; results equal, nothing counted."""
    check(fn, (0, 0))
    assert not counters["compiled_grpo"]["naive_respelled"] and not counters["compiled_grpo"]["naive_inplace_scale"]
    before, after = pass_on_graph(fn)
    assert [(n.op, n.target) for n in after.graph.nodes] == before


def clamped_entropy(min_):
    def f(h, w, b, ids):
        lp = F.log_softmax(h @ w.T, dim=-1)
        return (-(torch.clamp(lp, min=min_) * F.softmax(lp, dim=-1)).sum(-1),)
    return f


def broadcast_gather(ids_shape):
    def f(h, w, b, ids):
        lp = F.log_softmax(h @ w.T, dim=-1)
        idx = ids[..., None] if ids_shape == "rows" else ids[:1, :, None]   # [1, T, 1] broadcasts
        v, pmf = torch.broadcast_tensors(idx, lp)
        return (pmf.gather(-1, v[..., :1]).squeeze(-1),)
    return f


@pytest.mark.parametrize("fn,expect", [(clamped_entropy(torch.finfo(torch.float32).min), (0, 1)),
                                       (clamped_entropy(-30.0), (0, 0)),
                                       (broadcast_gather("rows"), (1, 0)),
                                       (broadcast_gather("broadcast"), (0, 0))])
def test_categorical_respelling_only_where_it_is_the_same(fn, expect):
    """Categorical's clamp of the log-probs is the identity only at finfo.min (a clamp at -30
    moves real log-probs), and its broadcast_tensors only when the index already has the
    log-probs' leading shape (a [1, T, 1] index is broadcast over the batch: a gather of other
    rows' targets). Results equal the unfused graph's either way."""
    check(fn, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fn", [complement_of(-30.0), complement_of(float("-inf"), stop=V - 5)])
def test_complement_respelling_only_where_it_is_the_same(fn):
    """The complement's log-sum-exp is the other logits' only when its fill vanishes under exp
    (-inf or finfo.min: -30 does not) and its vocab is all of V: left alone otherwise, results
    equal the unfused graph's."""
    check(fn, (0, 0), rtol=1e-4, atol=1e-4)
    assert not counters["compiled_grpo"]["naive_respelled"]


def test_cross_entropy_of_transposed_square_logits_is_left_alone():
    """N == V: z.transpose(0, 1) is [V, N], shaped like [N, V] logits but not them; the pass
    must not read it as per-token cross_entropy. Results equal eager's."""
    from naive_fusion_harness import H, run_case
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(V, H, generator=g).requires_grad_(), torch.randn(V, H, generator=g).requires_grad_()
    ids = torch.randint(0, V, (V,), generator=g)

    def square(h, w, b, ids):
        return (F.cross_entropy((h @ w.T).transpose(0, 1), ids, reduction="none"),)
    ref, out, ref_grads, got_grads, _ = run_case(square, h, w, None, ids)
    assert fired() == (0, 0)
    for r, o in zip([*ref, *ref_grads], [*out, *got_grads]):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_a_failing_respelling_check_costs_the_edit_not_the_compile(monkeypatch):
    """A bug in a normalize.py check (here: it raises) leaves the user's spelling as it is: the
    compile succeeds, the results equal eager's, the in-place scale is not made out of place."""
    from lowerings.naive_fusion import normalize

    def broken(x, depth=12):
        raise RuntimeError("a matcher bug")
    monkeypatch.setattr(normalize, "_from_gemm", broken)
    check(inplace_scale_and_logits_returned, (0, 0))
    assert counters["compiled_grpo"]["naive_inplace_scale"] == 0


def test_fused_graph_counts_nothing_unfused():
    check(matmul_T, (1, 0))
    assert not counters["compiled_grpo_unfused"]


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
    assert names.count("linear_logprobs_call") == 2, names
    for naive in ("log_softmax", "exp", "matmul", "linear", "gather", "sum", "truediv"):
        assert naive not in names, names
    by_name = {"L_h_": h, "L_w_": w, "L_w_ref_": w_ref, "L_b_": b, "L_ids_": ids}
    got = gm(*[by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    for g, r in zip(got, fn(h, w, w_ref, b, ids)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert fired() == (2, 1)
