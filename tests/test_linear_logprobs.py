"""CPU tests of compiled_grpo::linear_logprobs: values vs a float64 golden that materializes the
logits, fp64 gradcheck, opcheck (static and dynamic), frozen head, fullgraph compile, dynamic N.

Legend: N tokens, H hidden, V vocab. Shapes are tiny and CHUNK_V is lowered so the multi-chunk
path (V not a multiple of the chunk) runs in every test."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lowerings.linear_logprobs.cpu as torch_impl
from lowerings.linear_logprobs import linear_logprobs
from lowerings.linear_logprobs import _linear_logprobs_backward_op, _linear_logprobs_op


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_impl, "CHUNK_V", 16)   # V=37 -> chunks of 16, 16, 5


def golden(h, w, ids, b=None, temperature=1.0, scale=1.0, cap=None):
    """float64 reference that materializes z; returns (logprobs, entropy, lse)."""
    z = h.double() @ w.double().T                                          # [N, V]
    if b is not None:
        z = z + b.double()
    z = z * scale                                     # HF's order: scale, softcap, temperature
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    z = z / temperature
    lse = z.logsumexp(-1)
    lp = z.gather(-1, ids[:, None])[:, 0] - lse
    ent = lse - (z.softmax(-1) * z).sum(-1)
    return lp, ent, lse


def make(n=6, h=8, v=37, dtype=torch.float64, bias=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    ids = torch.randint(0, v, (n,), generator=g)
    return x, w, ids, b


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_fp32(temperature, bias):
    x, w, ids, b = make(dtype=torch.float32, bias=bias, scale=2.0)
    out = linear_logprobs(x.view(2, 3, -1), w, ids.view(2, 3), b, temperature=temperature,
                          with_entropy=True)
    ref = golden(x, w, ids, b, temperature)
    assert out.logprobs.shape == (2, 3) and out.logprobs.dtype == torch.float32
    for got, want in zip(out, ref):
        torch.testing.assert_close(got.reshape(-1).double(), want, rtol=1e-5, atol=1e-5)


def test_entropy_none_and_large_offsets():
    x, w, ids, b = make(dtype=torch.float32)
    b = b + 1e4            # logits near 1e4: a naive exp overflows, the online max must not
    out = linear_logprobs(x, w, ids, b)
    assert out.entropy is None
    lp, _, lse = golden(x, w, ids, b)
    torch.testing.assert_close(out.logprobs.double(), lp, rtol=0, atol=2e-3)  # fp32 ulp at 1e4
    b = b - 2e4            # all-negative logits
    lp, ent, _ = golden(x, w, ids, b)
    out = linear_logprobs(x, w, ids, b, with_entropy=True)
    torch.testing.assert_close(out.logprobs.double(), lp, rtol=0, atol=2e-3)
    torch.testing.assert_close(out.entropy.double(), ent, rtol=0, atol=2e-3)


def test_bf16_inputs_upcast():
    x, w, ids, b = make(dtype=torch.bfloat16, n=4, h=32, v=50)
    out = linear_logprobs(x, w, ids, b, with_entropy=True)
    for got, want in zip(out, golden(x, w, ids, b)):   # golden on the same bf16 values
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck(with_entropy, temperature):
    x, w, ids, b = make(n=4, h=5)
    x, w, b = (t.requires_grad_() for t in (x, w, b))

    def f(x, w, b):
        out = linear_logprobs(x, w, ids, b, temperature=temperature, with_entropy=with_entropy)
        return tuple(t for t in out if t is not None)
    assert torch.autograd.gradcheck(f, (x, w, b))


# logit_scale / final_logit_softcapping: a scale alone, a cap alone (3, on logits of std ~3 at
# scale=2: many saturate) and both; fp32 values and fp64 gradcheck of all three outputs.
SCALINGS = [(0.5, None), (1.0, 3.0), (1.7, 2.0)]


@pytest.mark.parametrize("scale,cap", SCALINGS)
def test_scale_and_softcap(scale, cap):
    x, w, ids, b = make(dtype=torch.float32, scale=2.0)
    kw = dict(temperature=0.7, with_entropy=True, logit_scale=scale, final_logit_softcapping=cap)
    out = linear_logprobs(x, w, ids, b, **kw)
    for got, want in zip(out, golden(x, w, ids, b, 0.7, scale, cap)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    x, w, ids, b = make(n=4, h=5, scale=2.0)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    mask = torch.tensor([True, False, True, True])

    def f(x, w, b):
        return tuple(linear_logprobs(x, w, ids, b, row_mask=mask, **kw))
    assert torch.autograd.gradcheck(f, (x, w, b))


def test_scale_and_softcap_opcheck():
    x, w, ids, b = make(dtype=torch.float32)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    args = (x, w, ids, b, 0.7, False, True, None, 0.5, 30.0)
    torch.library.opcheck(_linear_logprobs_op, args, test_utils=utils)
    lp, ent, lse = (t.detach() for t in _linear_logprobs_op(*args))
    g = torch.randn_like(lp)
    torch.library.opcheck(_linear_logprobs_backward_op,
                          (x.detach(), w.detach(), ids, b.detach(), lse, ent, g, g, g, 0.7, False,
                           True, True, True, True, None, 0.5, 30.0),
                          test_utils=utils[:1] + utils[2:])


def test_grads_match_golden_autograd():
    x, w, ids, b = make()
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    g = torch.randn(3, 6, dtype=torch.float64)
    out = linear_logprobs(x, w, ids, b, temperature=0.7, with_entropy=True)
    (sum((o * gi).sum() for o, gi in zip(out, g))).backward()
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = golden(x, w, ids, b, 0.7)
    (sum((o * gi).sum() for o, gi in zip(ref, g))).backward()
    for a, r in zip(got, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_frozen_weight_no_dw_and_none_grads():
    x, w, ids, b = make()
    x.requires_grad_()
    out = linear_logprobs(x, w, ids, b, with_entropy=True)
    out.logprobs.sum().backward()           # entropy and lse grads arrive as None
    assert w.grad is None and b.grad is None
    xr = x.detach().clone().requires_grad_()
    golden(xr, w, ids, b)[0].sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)


def test_backward_op_skips_unneeded_grads():
    x, w, ids, b = make()
    lp, ent, lse = _linear_logprobs_op(x, w, ids, b, 1.0, False, True)
    g = torch.ones_like(lp)
    dx, dw, db = _linear_logprobs_backward_op(x, w, ids, b, lse, ent, g, g, g, 1.0, False, True,
                                              True, False, False)
    assert dx.shape == x.shape and dw.numel() == 0 and db.numel() == 0


@pytest.mark.parametrize("with_entropy", [False, True])
def test_opcheck(with_entropy):
    x, w, ids, b = make(dtype=torch.float32)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_linear_logprobs_op, (x, w, ids, b, 0.7, False, with_entropy),
                          test_utils=utils)
    torch.library.opcheck(_linear_logprobs_op, (x, w, ids, None, 1.0, True, with_entropy),
                          test_utils=utils)
    lp, ent, lse = (t.detach() for t in _linear_logprobs_op(x, w, ids, b, 0.7, False, True))
    g = torch.randn_like(lp)
    torch.library.opcheck(_linear_logprobs_backward_op,
                          (x.detach(), w.detach(), ids, b.detach(), lse, ent, g, g, g, 0.7, False,
                           with_entropy, True, True, True), test_utils=utils[:1] + utils[2:])


def _loss(x, w, ids, b):
    out = linear_logprobs(x, w, ids, b, temperature=0.7, with_entropy=True)
    return (out.logprobs * 2.0 + out.entropy * 0.1 + out.lse * 0.01).sum()


def test_compile_fullgraph_one_frame_and_dynamic_n():
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(_loss, backend=cnt, fullgraph=True)
    for n in (6, 9, 13):
        x, w, ids, b = make(n=n, dtype=torch.float32, seed=n)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(ids, 0)
        x, w, b = (t.requires_grad_() for t in (x, w, b))
        with torch._dynamo.config.patch(error_on_recompile=n != 6):
            loss = fn(x, w, ids, b)
        loss.backward()
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
        lp, ent, lse = golden(xr, wr, ids, br, 0.7)
        ref = (lp * 2.0 + ent * 0.1 + lse * 0.01).sum()
        ref.backward()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
        for a, r in zip((x, w, b), (xr, wr, br)):
            torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-5)
    assert cnt.frame_count == 1


def test_row_mask_opcheck_and_gradcheck():
    """row_mask: opcheck of both ops with it, fp64 gradcheck through it; padded rows give 0
    outputs and 0 d_hidden rows whatever their incoming grads (the CPU body computes them and
    zeroes them; CUDA skips them, tests/test_linear_logprobs_gpu.py)."""
    x, w, ids, b = make(dtype=torch.float32)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.4
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_linear_logprobs_op, (x, w, ids, b, 0.7, False, True, mask),
                          test_utils=utils)
    lp, ent, lse = (t.detach() for t in _linear_logprobs_op(x, w, ids, b, 0.7, False, True, mask))
    assert not lp[~mask].any() and not ent[~mask].any() and not lse[~mask].any()
    g = torch.randn_like(lp)
    torch.library.opcheck(_linear_logprobs_backward_op,
                          (x.detach(), w.detach(), ids, b.detach(), lse, ent, g, g, g, 0.7, False,
                           True, True, True, True, mask), test_utils=utils[:1] + utils[2:])
    dx, _, _ = _linear_logprobs_backward_op(x.detach(), w.detach(), ids, b.detach(), lse, ent, g,
                                            g, g, 0.7, False, True, True, True, True, mask)
    assert not dx[~mask].any()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))

    def f(x, w, b):
        out = linear_logprobs(x, w, ids, b, temperature=0.7, with_entropy=True, row_mask=mask)
        return out.logprobs, out.entropy, out.lse
    torch.autograd.gradcheck(f, (x64, w64, b64))


def test_backward_hidden_without_grad_and_no_bias():
    """d_hidden and d_bias both unneeded: the backward op's two [0] outputs must be distinct
    tensors (a custom op's outputs may not alias), on the CPU body as on CUDA."""
    x, w, ids, _ = make()
    w.requires_grad_()
    linear_logprobs(x, w, ids, with_entropy=True).logprobs.sum().backward()
    wr = w.detach().clone().requires_grad_()
    golden(x, wr, ids, None)[0].sum().backward()
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-10, atol=1e-12)


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The launchers' host-side cdiv / next_power_of_2 (recompute/dense.py: triton's are ConstexprFunctions,
    ~6 us a host call) give triton's values, and cdiv takes a SymInt (a traced row count)."""
    import triton

    from lowerings.linear_logprobs.recompute import dense
    for a in (0, 1, 15, 16, 17, 271, 2048, 151936):
        for b in (1, 16, 64, 128, 256, 8192):
            assert dense.cdiv(a, b) == triton.cdiv(a, b)
    for n in (1, 2, 3, 38, 64, 65, 1000):
        assert dense.next_power_of_2(n) == triton.next_power_of_2(n)
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    s = shape_env.create_unbacked_symint()
    assert str(dense.cdiv(s, 128)) == str((s + 127) // 128)
