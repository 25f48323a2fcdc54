"""grpo_loss (the op's CPU path, float64) against the literal transcription in helpers.golden_loss."""
import itertools

import zlib

import pytest
import torch

import compiled_grpo as cg
from helpers import golden_loss, make_inputs

PAIRS = [(lt, lvl) for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
         for lvl in ("token", "sequence")]
NO_CLAMPS = dict(log_ratio_clamp=None, kl_input_clamp=None, kl_output_clamp=None)


def _extreme(inp):
    """Push a few valid log-ratios and ref gaps past the clamps (30 > 20 nats)."""
    old, ref, mask = inp["old_logprobs"].clone(), inp["ref_logprobs"].clone(), inp["mask"]
    old[0, 0] -= 30.0
    ref[0, 0] += 25.0
    idx = mask[1].nonzero()
    if len(idx):
        old[1, idx[0, 0]] += 30.0
        ref[1, idx[0, 0]] -= 25.0
    return dict(inp, old_logprobs=old, ref_logprobs=ref)


def _compare(inp, cfg, **kw):
    h, w = inp["hidden"], inp["weight"]
    ours = cg.grpo_loss(**inp, config=cfg, **kw)
    gh, gw = torch.autograd.grad(ours.loss, (h, w))
    gold, gold_tok = golden_loss(**inp, cfg=cfg, **kw)
    rh, rw = torch.autograd.grad(gold, (h, w))
    torch.testing.assert_close(ours.loss, gold, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.per_token_loss, gold_tok.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-12)
    return ours


@pytest.mark.parametrize("loss_type,level", PAIRS)
@pytest.mark.parametrize("beta,delta,clamps", list(itertools.product((0.0, 0.04), (None, 1.5), (True, False))))
def test_matrix(loss_type, level, beta, delta, clamps):
    inp = _extreme(make_inputs(seed=zlib.crc32(f"{loss_type}-{level}".encode()) % 1000, spread=0.5))
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta,
                        max_completion_length=9, epsilon_high=5.0 if loss_type == "cispo" else 0.28,
                        **({} if clamps else NO_CLAMPS))
    _compare(inp, cfg)


@pytest.mark.parametrize("estimator", ("k1", "k2", "k3"))
@pytest.mark.parametrize("bias_correction", (False, True))
@pytest.mark.parametrize("level", ("token", "sequence"))
def test_kl_estimators(estimator, bias_correction, level):
    inp = _extreme(make_inputs(seed=3))
    cfg = cg.GRPOConfig(beta=0.1, kl_estimator=estimator, use_bias_correction_kl=bias_correction,
                        importance_sampling_level=level)
    _compare(inp, cfg)


@pytest.mark.parametrize("loss_type", ("grpo", "dapo", "luspo", "cispo"))
def test_extras(loss_type):
    """2-D advantages, sampling ratio, bias, temperature, entropy bonus, num_items_in_batch."""
    inp = make_inputs(seed=4, adv_2d=True)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(inp["weight"].shape[0], generator=g, dtype=torch.float64, requires_grad=True)
    sr = torch.rand(3, 7, generator=g, dtype=torch.float64) + 0.5
    cfg = cg.GRPOConfig(loss_type=loss_type, temperature=0.7, entropy_coef=0.01, beta=0.02,
                        epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    ours = _compare(inp, cfg, bias=bias, sampling_ratio=sr, num_items_in_batch=40)
    assert ours.entropy is not None and ours.entropy.shape == (3, 7)
    # the bias gradient matches too
    gb = torch.autograd.grad(cg.grpo_loss(**inp, config=cfg, bias=bias, sampling_ratio=sr, num_items_in_batch=40).loss, bias)[0]
    rb = torch.autograd.grad(golden_loss(**inp, cfg=cfg, bias=bias, sampling_ratio=sr, num_items_in_batch=40)[0], bias)[0]
    torch.testing.assert_close(gb, rb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale,cap", [(0.5, None), (1.0, 0.5), (3.0, 1.5)])
def test_logit_scale_and_softcapping(scale, cap):
    """Model scalings (HF order: scale, cap, temperature) with bias, entropy bonus and KL; caps
    small enough that tanh saturates on these logits (|z| up to ~3)."""
    inp = make_inputs(seed=10)
    bias = torch.randn(inp["weight"].shape[0], generator=torch.Generator().manual_seed(11),
                       dtype=torch.float64, requires_grad=True)
    cfg = cg.GRPOConfig(temperature=0.7, logit_scale=scale, final_logit_softcapping=cap, beta=0.04,
                        entropy_coef=0.01)
    _compare(inp, cfg, bias=bias)
    gb = torch.autograd.grad(cg.grpo_loss(**inp, config=cfg, bias=bias).loss, bias)[0]
    rb = torch.autograd.grad(golden_loss(**inp, cfg=cfg, bias=bias)[0], bias)[0]
    torch.testing.assert_close(gb, rb, rtol=1e-9, atol=1e-12)


def test_sampling_ratio_per_sequence():
    inp = make_inputs(seed=6)
    sr = torch.tensor([[0.5], [1.0], [2.0]], dtype=torch.float64)
    _compare(inp, cg.GRPOConfig(loss_type="grpo"), sampling_ratio=sr)


def test_num_items_tensor_equals_int():
    inp = make_inputs(seed=7)
    cfg = cg.GRPOConfig()
    a = cg.grpo_loss(**inp, config=cfg, num_items_in_batch=50).loss
    b = cg.grpo_loss(**inp, config=cfg, num_items_in_batch=torch.tensor(50)).loss
    c = cg.grpo_loss(**inp, config=cfg).loss * inp["mask"].sum() / 50
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=1e-12, atol=0)


def test_grad_divisor_scales_gradient_not_value():
    inp = make_inputs(seed=8)
    h = inp["hidden"]
    base = cg.grpo_loss(**inp, config=cg.GRPOConfig(loss_type="dapo"))
    scaled = cg.grpo_loss(**inp, config=cg.GRPOConfig(loss_type="dapo", grad_divisor=1000.0))
    torch.testing.assert_close(scaled.loss, base.loss, rtol=0, atol=0)
    g0 = torch.autograd.grad(base.loss, h)[0]
    g1 = torch.autograd.grad(scaled.loss, h)[0]
    n = inp["mask"].sum().double()
    torch.testing.assert_close(g1, g0 * n / 1000.0, rtol=1e-10, atol=1e-14)


def test_on_policy_ratio_is_exactly_one():
    inp = make_inputs(seed=9, dtype=torch.float32)
    with torch.no_grad():
        old = cg.token_logprobs(inp["hidden"], inp["weight"], inp["token_ids"], mask=inp["mask"]).logprobs
    cfg = cg.GRPOConfig(metrics="basic")
    out = cg.grpo_loss(**dict(inp, old_logprobs=old), config=cfg)
    on = cg.grpo_loss(**dict(inp, old_logprobs=None), config=cfg)
    assert out.metrics.ratio_new_old.item() == 1.0
    assert out.metrics.ratio_new_old_squared_sum.item() == inp["mask"].sum().item()
    torch.testing.assert_close(out.loss, on.loss, rtol=0, atol=0)
