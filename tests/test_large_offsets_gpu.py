"""Past 2^31 elements (docs/errors-and-edge-cases.md): B = 16, T = 8192, V = 151936 (N V = 2.0e10) on the
GPU, where the interpreter tests cannot go. Only two sequences (the first and the last) carry
an advantage, so the batch's gradient is theirs alone; the same two sequences as a batch of two
are the reference: their log-probs must be the same bits (batch invariance), their dX rows and
dW equal to fp32 rounding of the different row grouping, every other row's dX exactly 0. Also
the log-probs of the last rows against an fp32 logits reference (the largest offsets)."""
import pytest
import torch

import compiled_grpo as cg

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_past_int32_offsets(mode):
    _padded(mode)


def _padded(mode):
    b, t, h, v = 16, 8192, 128, 151936
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(b, t, h, generator=g) * 2).bfloat16().cuda()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).bfloat16().cuda()
    ids = torch.randint(0, v, (b, t), generator=g).cuda()
    lens = torch.randint(t // 2, t + 1, (b,), generator=g)
    lens[-1] = t
    mask = (torch.arange(t)[None, :] < lens[:, None]).cuda()
    adv = torch.zeros(b, device="cuda")
    adv[0], adv[-1] = 1.0, -0.5
    cfg = cg.GRPOConfig(loss_type="grpo", gradient_mode=mode)
    pick = torch.tensor([0, b - 1], device="cuda")

    def run(x, ids_, mask_, adv_):
        x = x.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        with torch.no_grad():
            old = cg.token_logprobs(x, w, ids_, mask=mask_).logprobs
        r = cg.grpo_loss(x, w, ids_, adv_, mask_, old, config=cfg)
        r.loss.backward()
        return r, x.grad, w.grad, old

    r, dx, dw, old = run(hidden, ids, mask, adv)
    r2, dx2, dw2, old2 = run(hidden[pick], ids[pick], mask[pick], adv[pick])
    assert torch.isfinite(r.loss) and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    m2 = mask[pick]
    assert torch.equal(r.logprobs[pick][m2], r2.logprobs[m2])     # batch invariance, bitwise
    assert torch.equal(old[pick][m2], old2[m2]) and torch.equal(r.logprobs[mask], old[mask])
    # the grpo mean over sequences: the batch of 16 divides by 16, the pair by 2
    assert _rel(dw * (b / 2), dw2) < 2e-2 and _rel(dx[pick] * (b / 2), dx2) < 2e-2
    rest = torch.ones(b, dtype=torch.bool, device="cuda")
    rest[pick] = False
    assert not dx[rest].any()
    # the last sequence's last rows against fp32 logits (the largest row offsets)
    xs, ys = hidden[-1, -64:].float(), ids[-1, -64:]
    ref = torch.log_softmax(xs @ weight.float().T, -1).gather(1, ys[:, None])[:, 0]
    torch.testing.assert_close(r.logprobs[-1, -64:], ref, rtol=0, atol=2e-3)
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, adv=adv, cfg=cfg, logprobs=r.logprobs,
                dx=dx, dw=dw)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_past_int32_offsets_packed(mode):
    """The same batch packed (cu_seqlens, only the valid tokens: N ~ 98k, N V = 1.5e10): the
    log-probs the same bits as the padded batch's (and token_logprobs' on the packed rows), the
    gradients equal to the padded batch's within the row grouping's fp32 rounding."""
    pad = _padded(mode)
    mask, ids, w = pad["mask"], pad["ids"], pad["weight"]
    lens = mask.sum(1)
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    x = pad["hidden"][mask].detach().requires_grad_()                       # [N_valid, H]
    wg = w.detach().requires_grad_()
    ids_p = ids[mask]
    with torch.no_grad():
        old = cg.token_logprobs(x, wg, ids_p, cu_seqlens=cu).logprobs
    assert x.shape[0] * w.shape[0] > 2**31
    r = cg.grpo_loss(x, wg, ids_p, pad["adv"], torch.ones_like(ids_p, dtype=torch.bool), old,
                     cu_seqlens=cu, config=pad["cfg"])
    r.loss.backward()
    assert torch.equal(r.logprobs, pad["logprobs"][mask]) and torch.equal(old, r.logprobs)
    assert _rel(x.grad, pad["dx"][mask]) < 2e-2 and _rel(wg.grad, pad["dw"]) < 2e-2
