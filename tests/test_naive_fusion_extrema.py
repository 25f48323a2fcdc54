"""Logits min / max metrics beside the log-probs (lowerings/naive_fusion/extrema.py; the op:
lowerings/linear_logprobs/extrema.py): fused, so no [N, V] buffer is left, with the values and
gradients of the unfused graph (fp32), within 2x eager's error of float64 (bf16); a max that
carries a gradient, or the argmax, stays `logits_users` (test_naive_fusion_left_alone.py).

Legend: B, T, H, V of naive_fusion_harness; the op's chunks lowered to 16 vocab columns.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import lowerings.linear_logprobs.extrema as extrema_op
from naive_fusion_harness import N, check, fusion_on, logp_of, make, nv_buffers, run_case  # noqa: F401 (fusion_on: autouse)
from test_naive_fusion_fused_grad import assert_same, batch
from test_naive_fusion_rows import _garbage, _run_pair


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(extrema_op, "MIN_COLS", 16)
    monkeypatch.setattr(extrema_op, "WS_BYTES", N * 4 * 16)     # V = 53: chunks of 16, 16, 16, 5


def metrics_of_logits(h, w, b, ids):
    """The spelling that was `logits_users`: `.values` and `[0]` of detached min / max."""
    z = h @ w.T
    return logp_of(z, ids), z.detach().min(-1).values, z.detach().max(-1)[0]


def metrics_under_no_grad(h, w, b, ids):
    """Under torch.no_grad(): a whole-tensor max and a keepdim amin; an amax of the detach."""
    z = (h @ w.T + b) / 0.7
    lp = logp_of(z, ids)
    with torch.no_grad():
        top = z.max()
        low = torch.amin(z, dim=-1, keepdim=True)
    return lp, z.detach().amax(-1), top, low


def metrics_before_temperature(h, w, b, ids):
    """The raw logits' extrema, the log-probs of logits / T (a chain node before the logits)."""
    z = F.linear(h, w, b)
    return logp_of(z / 0.7, ids), z.detach().min(-1).values, z.detach().max(-1)[0]


def metrics_of_every_row(h, w, b, ids):
    """A max over every row (a float cast between), the log-probs of the shifted, softcapped
    rows, and those logits' min."""
    z = h @ w.T
    top = z.detach().float().amax(-1)
    z = 30.0 * torch.tanh(z[:, :-1] / 30.0)
    return logp_of(z.float() / 0.9, ids[:, 1:]), top, z.detach().amin(-1)


CASES = [metrics_of_logits, metrics_under_no_grad, metrics_before_temperature, metrics_of_every_row]


@pytest.mark.parametrize("fn", CASES)
def test_logits_metrics_fused(fn):
    """Fused (the metrics' own counter too), no [N, V] buffer, equal to eager (fp32)."""
    sources = check(fn, (1, 0))
    assert counters["compiled_grpo"]["naive_extrema_fusion"] == 1
    assert not counters["compiled_grpo_unfused"] and not nv_buffers(sources)


@pytest.mark.parametrize("fn", [metrics_of_every_row, metrics_before_temperature])
def test_logits_metrics_bf16_against_float64(fn):
    """bf16 head: every output within 2x eager bf16's error of float64 (the user's code on
    float64 inputs), plus a bf16 ulp of the largest logit."""
    h, w, b, ids = make(dtype=torch.bfloat16)
    ref, out, _, _, _ = run_case(fn, h, w, b, ids, grads=False)
    assert counters["compiled_grpo"]["naive_extrema_fusion"] == 1
    gold = fn(*(t.detach().double() for t in (h, w, b)), ids)
    for r, o, g in zip(ref, out, gold):
        assert o.dtype == r.dtype and o.shape == r.shape
        err_e, err_o = ((x.double() - g.double()).abs().max().item() for x in (r, o))
        assert err_o <= 2 * err_e + 2 ** -8 * g.abs().max().item(), (err_o, err_e)


def test_extrema_op_against_dense():
    """The op alone: logit scale, softcap, temperature, a -inf bias entry (a banned token), and
    16-bit operands multiplied in fp32 (fp32_lm_head), against the dense logits; no rows."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(5, 9, 24, generator=g), torch.randn(53, 24, generator=g)
    b = torch.randn(53, generator=g)
    b[7] = float("-inf")
    for cap in (None, 4.0):
        lo, hi = extrema_op.linear_logits_extrema(h, w, b, temperature=0.8, logit_scale=1.5,
                                                  final_logit_softcapping=cap)
        z = (h @ w.T + b) * 1.5
        z = (z if cap is None else cap * torch.tanh(z / cap)) / 0.8
        torch.testing.assert_close(lo, z.amin(-1))
        torch.testing.assert_close(hi, z.amax(-1))
    hb, wb = h.bfloat16(), w.bfloat16()
    lo, hi = extrema_op.linear_logits_extrema(hb, wb, fp32_lm_head=True)
    z = hb.float() @ wb.float().T
    torch.testing.assert_close(hi, z.amax(-1))
    lo, hi = extrema_op.linear_logits_extrema(h[:0], w)
    assert lo.shape == hi.shape == (0, 9)


def dapo_with_logit_metrics(h, w, b, ids, mask, adv, old, ref):
    """DAPO's loss and the masked means of each row's min / max logit, as metrics."""
    logits = F.linear(h, w, b).float()
    lp = logp_of(logits / 0.9, ids)
    m = mask.float()
    coef = torch.exp(lp - old)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.28) * adv[:, None])
    with torch.no_grad():
        top = torch.where(mask, logits.max(-1).values, 0.0).sum() / m.sum()
        low = torch.where(mask, logits.min(-1).values, 0.0).sum() / m.sum()
    return (per_token * m).sum() / m.sum(), top, low


def test_metrics_beside_a_loss_whose_masked_rows_are_skipped():
    """The loss keeps the fused schedule and skips the masked rows (nan hidden states there never
    reach the loss or gradients); the metrics, masked by the user, equal eager's on the clean rows."""
    clean = batch()
    dirty = _garbage(clean, ~clean[4])
    clean = (clean[0].detach().masked_fill(~clean[4][..., None], 0.0).requires_grad_(), *clean[1:])
    want, got, gold, out = _run_pair(dapo_with_logit_metrics, clean, dirty)
    assert counters["compiled_grpo"]["naive_extrema_fusion"] == 1
    assert dict(counters["compiled_grpo_rows"]) == {"masked": 1}
    assert dict(counters["compiled_grpo_gradient"]) == {"fused": 1}
    assert_same(want, got, gold)
    torch.testing.assert_close(torch.stack(out[1:]),
                               torch.stack(dapo_with_logit_metrics(*clean)[1:]).detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_metrics_fused_cuda(dtype, monkeypatch):
    """CUDA, 4 x 1024 tokens, H = 512, V = 32000 (the default chunks): the DAPO loss with the
    metrics, fused, loss and gradients within 2x eager's error of float64, the metrics too."""
    monkeypatch.setattr(extrema_op, "MIN_COLS", 256)
    monkeypatch.setattr(extrema_op, "WS_BYTES", 256 << 20)
    args = batch(dtype=dtype, device="cuda", b=4, t=1024, h=512, v=32000)
    want, got, gold, out = _run_pair(dapo_with_logit_metrics, args, args)
    assert counters["compiled_grpo"]["naive_extrema_fusion"] == 1
    assert dict(counters["compiled_grpo_gradient"]) == {"fused": 1}
    assert_same(want, got, gold)
    eager = dapo_with_logit_metrics(*args)[1:]
    gold_m = dapo_with_logit_metrics(*(t.detach().double() if torch.is_tensor(t) and t.is_floating_point()
                                       else t for t in args))[1:]
    for e, o, g in zip(eager, out[1:], gold_m):
        assert abs(o.double() - g) <= 2 * abs(e.double() - g) + 1e-6 * abs(g)
