"""The harness of the naive-fusion tests (test_naive_fusion.py, test_naive_fusion_left_alone.py):
the pass switched on around each test (autouse `fusion_on`, imported by each test module), tiny
inputs, and `check`, which compiles a case, compares it with eager and returns Inductor's sources
(the legend and method: test_naive_fusion.py's docstring)."""
import math
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import lowerings.linear_logprobs.cpu as torch_impl
import lowerings.linear_logprobs.op  # noqa: F401 (registers torch.ops.compiled_grpo.linear_logprobs)
import lowerings.naive_fusion as nf

B, T, H, V = 3, 7, 24, 53
N = B * T


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


def pass_on_graph(fn, edit=None):
    """(the (op, target) list of fn's Dynamo graph before naive_logprob_fusion_pass, the graph
    module after it), the pass's graph run on make()'s inputs and checked equal to fn's.
    edit(graph), if given, changes Dynamo's graph first (another torch release's spelling)."""
    graphs = []

    def backend(gm, example):
        if edit is not None:
            edit(gm.graph)
        before = [(n.op, n.target) for n in gm.graph.nodes]
        nf.naive_logprob_fusion_pass(gm.graph)
        gm.recompile()
        graphs.append((before, gm))
        return gm.forward
    torch._dynamo.reset()
    h, w, b, ids = make()
    out = torch.compile(fn, backend=backend, fullgraph=True)(h, w, b, ids)
    for o, r in zip(out, fn(h, w, b, ids)):
        torch.testing.assert_close(o, r)
    return graphs[0]


def logp_of(logits, ids):
    return logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
