"""The lm_head precision contract (GRPOConfig.fp32_lm_head / token_logprobs(fp32_lm_head=)), on CPU
and, where present, CUDA."""
import pytest
import torch

import compiled_grpo as cg
from compiled_grpo.reference import reference_token_logprobs
from helpers import DEVICES



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["token_logprobs", "recompute", "fused"])
def test_fp32_lm_head_is_the_fp32_upcast(mode, device):
    """fp32_lm_head on bf16 inputs is the same computation as the caller casting hidden, weight
    and bias to fp32 (Fast-LLM / TRL's cast_lm_head_to_fp32): equal values, and the grads equal
    the fp32 call's grads cast to bf16, in bf16."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 5, 8, 19
    h32, w32, b32 = (torch.randn(*s, generator=g).to(device) for s in ((B, T, H), (V, H), (V,)))
    h16, w16, b16 = (t.bfloat16() for t in (h32, w32, b32))
    ids = torch.randint(0, V, (B, T), generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(device)
    adv = torch.randn(B, generator=g).to(device)

    def run(h, w, b, fp32):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        if mode == "token_logprobs":
            out = cg.token_logprobs(*leaves[:2], ids, leaves[2], mask=mask, fp32_lm_head=fp32,
                                    with_entropy=True)
            val = (out.logprobs + out.entropy).sum()
        else:
            cfg = cg.GRPOConfig(beta=0.0, entropy_coef=0.01, fp32_lm_head=fp32, gradient_mode=mode)
            val = cg.grpo_loss(leaves[0], leaves[1], ids, adv, mask, bias=leaves[2], config=cfg).loss
        return val.detach(), torch.autograd.grad(val, leaves)

    v16, g16 = run(h16, w16, b16, True)
    v32, g32 = run(h16.float(), w16.float(), b16.float(), False)
    assert torch.equal(v16, v32)
    for a, b in zip(g16, g32):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.bfloat16())


def _inputs(device, dtype, seed=0, B=2, T=6, H=16, V=37):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 2).to(dtype).to(device)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 3).to(dtype).to(device)
    b = torch.randn(V, generator=g).to(dtype).to(device)
    ids = torch.randint(0, V, (B, T), generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(device)
    return h, w, b, ids, mask, torch.randn(B, generator=g).to(device)


def _run(mode, h, w, b, ids, mask, adv, **kw):
    """(log-probs, entropy, loss or sum) and the grads of hidden, weight, bias."""
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    if mode == "reference":
        out = reference_token_logprobs(*leaves[:2], ids, leaves[2], mask=mask, with_entropy=True,
                                       temperature=0.8, **kw)
        lp, ent, val = out.logprobs, out.entropy, (out.logprobs + 0.3 * out.entropy).sum()
    elif mode == "token_logprobs":
        out = cg.token_logprobs(*leaves[:2], ids, leaves[2], mask=mask, with_entropy=True,
                                temperature=0.8, **kw)
        lp, ent, val = out.logprobs, out.entropy, (out.logprobs + 0.3 * out.entropy).sum()
    else:
        cfg = cg.GRPOConfig(beta=0.0, entropy_coef=0.01, gradient_mode=mode, temperature=0.8,
                            metrics="with_entropy", **kw)
        out = cg.grpo_loss(leaves[0], leaves[1], ids, adv, mask, bias=leaves[2], config=cfg)
        lp, ent, val = out.logprobs, out.entropy, out.loss
    return lp.detach(), ent.detach(), torch.autograd.grad(val, leaves)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["token_logprobs", "recompute", "fused"])
def test_round_logits_is_the_rounded_reference(mode, device):
    """round_logits on bf16 inputs: the logits rounded to bf16 (after the GEMM and after the bias)
    before the fp32 softmax, the logits gradient rounded before dX / dW: as the materializing
    reference with the same roundings, and not as the fp32-logits default (the option acts)."""
    h, w, b, ids, mask, adv = _inputs(device, torch.bfloat16)
    lp_ref, ent_ref, _ = _run("reference", h, w, b, ids, mask, adv, round_logits=True)
    lp_fp32, _, _ = _run("reference", h, w, b, ids, mask, adv)
    lp, ent, grads = _run(mode, h, w, b, ids, mask, adv, round_logits=True)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=2e-5)
    assert (lp_ref - lp_fp32).abs().max() > 1e-3
    if mode == "token_logprobs":   # the same scalar as the reference: its grads
        _, _, ref_grads = _run("reference", h, w, b, ids, mask, adv, round_logits=True)
        for got, ref in zip(grads, ref_grads):
            assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["token_logprobs", "recompute", "fused"])
@pytest.mark.parametrize("round_logits", [False, True])
def test_lm_head_dtype_keeps_fp32_grads(mode, device, round_logits):
    """lm_head_dtype=bf16 on fp32 inputs (TRL's head under autocast): the values of the bf16-cast
    inputs' call, bitwise; the grads in fp32, accumulated in fp32: on CPU the straight-through
    reference to fp32 rounding, where the bf16 call's grads carry bf16's (about 100x more); on
    CUDA the logits gradient is 16-bit (the workspace has the operands' dtype), so to its
    rounding."""
    h, w, b, ids, mask, adv = _inputs(device, torch.float32, seed=1)
    kw = dict(round_logits=round_logits)
    lp, ent, grads = _run(mode, h, w, b, ids, mask, adv, lm_head_dtype=torch.bfloat16, **kw)
    lp16, ent16, grads16 = _run(mode, *(t.bfloat16() for t in (h, w, b)), ids, mask, adv, **kw)
    assert torch.equal(lp, lp16) and torch.equal(ent, ent16)
    _, _, ref = _run("reference", h, w, b, ids, mask, adv, lm_head_dtype=torch.bfloat16, **kw)
    for got, got16, r in zip(grads, grads16, ref):
        assert got.dtype == torch.float32
        if mode != "token_logprobs":   # a different scalar from the reference's
            continue
        cpu = device == "cpu" or round_logits   # round_logits: the reference rounds them too
        assert _rel(got, r) < (1e-5 if cpu else 1e-2)
        if device == "cpu":
            assert _rel(got16, r) > 10 * _rel(got, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_round_logits_grads_are_the_rounded_model(device, softcap):
    """The drop-in's setting under TRL's bf16 (fp32 leaves, lm_head_dtype=bf16, round_logits):
    each gradient path's dX / dW against the float64 reference with the same roundings (the
    logits and their gradient rounded to bf16, exact sums). The fused path's dlogits pass must
    recompute the forward's rounded logits exactly: storing them as d = z - max in fp16 (the
    default path's workspace) put its grads 4.8e-5 off where recompute's are 7e-8 (H100,
    bench/probes/trl_head_probe.py), which moved the TRL drop-in's grad_norm 7e-5 off TRL's."""
    h, w, _, ids, mask, adv = _inputs(device, torch.float32, seed=2, B=4, T=40, H=32, V=48)
    kw = dict(round_logits=True, lm_head_dtype=torch.bfloat16, final_logit_softcapping=softcap)
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    lp = reference_token_logprobs(hh, ww, ids, mask=mask, temperature=0.8, **kw).logprobs
    # dapo, beta 0, on-policy: d loss / d lp = -adv / n_valid at the valid tokens
    (-(adv.double()[:, None] * lp * mask).sum() / mask.sum()).backward()
    errs = {}
    for mode in ("recompute", "fused"):
        leaves = [t.clone().requires_grad_() for t in (h, w)]
        cfg = cg.GRPOConfig(loss_type="dapo", beta=0.0, gradient_mode=mode, temperature=0.8, **kw)
        cg.grpo_loss(*leaves, ids, adv, mask, config=cfg).loss.backward()
        errs[mode] = [_rel(t.grad, r) for t, r in zip(leaves, (hh.grad, ww.grad))]
    for e_fused, e_rec in zip(errs["fused"], errs["recompute"]):
        assert e_fused <= 2 * e_rec + 1e-6, errs


def test_lm_head_dtype_rejects_other_dtypes():
    h, w, b, ids, mask, adv = _inputs("cpu", torch.float32)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        cg.token_logprobs(h, w, ids, lm_head_dtype=torch.int8)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        cg.GRPOConfig(lm_head_dtype=torch.float64)
