"""The CPU body's row groups (lowerings/linear_logprobs/cpu.py): a workspace bounded by rows as
well as vocab columns, correct in eager mode, under gradcheck and under torch.compile with a
dynamic N that is smaller (empty groups) or larger than the one traced.

Legend: N tokens, H hidden, V vocab, C = CHUNK_V columns, G row groups. CHUNK_V and WS_BYTES are
lowered so tiny shapes take several groups and chunks (V=37: chunks of 16, 16, 5)."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lowerings.linear_logprobs.cpu as torch_impl
from lowerings.linear_logprobs import _linear_logprobs_op, linear_logprobs


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(torch_impl, "CHUNK_V", 16)
    monkeypatch.setattr(torch_impl, "WS_BYTES", 16 * 16 * 4)   # 16 rows a group (fp32), 8 (fp64)


def _make(n, dtype, h=8, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((n, h), (v, h), (v,)))
    return x, w, torch.randint(0, v, (n,), generator=g), b


def _golden(x, w, ids, b, temperature):
    z = (x.double() @ w.double().T + b.double()) / temperature                      # [N, V]
    lse = z.logsumexp(-1)
    return z.gather(-1, ids[:, None])[:, 0] - lse, lse - (z.softmax(-1) * z).sum(-1), lse


def _loss(x, w, ids, b, row_mask=None):
    out = linear_logprobs(x, w, ids, b, temperature=0.7, with_entropy=True, row_mask=row_mask)
    return (out.logprobs * 2.0 + out.entropy * 0.1 + out.lse * 0.01).sum()


def test_row_spans_cover_n():
    for n in (0, 1, 15, 16, 17, 40, 1000):
        groups = torch_impl._row_spans(n, 37, torch.float32)
        assert groups[0][0] == 0 and sum(r for _, r in groups) == n
        assert all(r0 + r == nxt for (r0, r), (nxt, _) in zip(groups, groups[1:]))
        assert len(groups) == min(torch_impl.MAX_ROW_GROUPS, max(1, -(-n // 16)))


@pytest.mark.parametrize("n", [5, 16, 40])
def test_values_and_grads_match_golden(n):
    x, w, ids, b = (t.requires_grad_() if t.is_floating_point() else t for t in _make(n, torch.float64))
    out = linear_logprobs(x, w, ids, b, temperature=0.7, with_entropy=True)
    gold = _golden(x, w, ids, b, 0.7)
    for a, r in zip(out, gold):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    ours = torch.autograd.grad(_loss(x, w, ids, b), (x, w, b))
    lp, ent, lse = gold
    want = torch.autograd.grad((lp * 2.0 + ent * 0.1 + lse * 0.01).sum(), (x, w, b))
    for a, r in zip(ours, want):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_row_mask():
    x, w, ids, b = (t.requires_grad_() if t.is_floating_point() else t for t in _make(20, torch.float64, h=3, v=19))
    mask = torch.arange(20) % 3 != 1
    torch.autograd.gradcheck(lambda x, w, b: _loss(x, w, ids, b, mask), (x, w, b))


def test_compile_dynamic_n_smaller_and_larger_than_traced():
    """Traced at N=40 (3 groups of 14 rows from the hint); N=9 leaves groups empty, N=70 makes
    them 24 rows (memory grows as N / G, the values stay right); one frame for all."""
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(_loss, backend=cnt, fullgraph=True)
    for n in (40, 9, 70):
        x, w, ids, b = _make(n, torch.float32, seed=n)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(ids, 0)
        x, w, b = (t.requires_grad_() for t in (x, w, b))
        with torch._dynamo.config.patch(error_on_recompile=n != 40):
            loss = fn(x, w, ids, b)
        grads = torch.autograd.grad(loss, (x, w, b))
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
        lp, ent, lse = _golden(xr, wr, ids, br, 0.7)
        ref = (lp * 2.0 + ent * 0.1 + lse * 0.01).sum()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
        for a, r in zip(grads, torch.autograd.grad(ref, (xr, wr, br))):
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-5)
    assert cnt.frame_count == 1


def test_opcheck_dynamic():
    x, w, ids, b = (t.requires_grad_() if t.is_floating_point() else t for t in _make(20, torch.float32))
    torch.library.opcheck(_linear_logprobs_op, (x, w, ids, b, 0.7, False, True),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
