"""Numerical guards: clamps (Liger fork PR "clamp log-ratio and k3 KL"), inf/NaN at masked positions,
the all-masked batch."""
import pytest
import torch

import compiled_grpo as cg
from helpers import make_inputs


@pytest.mark.parametrize("sign", (1.0, -1.0))
def test_kl_of_log_ratio_200_is_bounded_with_clamps_and_inf_without(sign):
    p = torch.zeros(1, 4)
    ref = p + sign * 200.0
    mask = torch.ones(1, 4, dtype=torch.bool)
    kl = cg.kl_penalty(p, ref, mask).kl
    assert torch.isfinite(kl).all() and (kl.abs() <= 10.0).all()
    assert (kl == 10.0).all()  # both signs saturate: exp(20) - 21 and exp(-20) + 19 exceed 10
    raw = cg.kl_penalty(p, ref, mask, input_clamp=None, output_clamp=None).kl
    if sign > 0:
        assert torch.isinf(raw).all()  # exp(200) overflows float32
    else:
        torch.testing.assert_close(raw, torch.full_like(raw, 199.0))


@pytest.mark.parametrize("level", ("token", "sequence"))
def test_log_ratio_200_gives_finite_loss_and_grads_with_clamps_only(level):
    inp = make_inputs(dtype=torch.float32, seed=1)
    inp["old_logprobs"] = inp["old_logprobs"].float() - 200.0  # log-ratio +200 everywhere
    inp["ref_logprobs"] = inp["ref_logprobs"].float() + 200.0
    on = cg.GRPOConfig(beta=0.04, importance_sampling_level=level)
    out = cg.grpo_loss(**inp, config=on)
    grads = torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"]))
    assert torch.isfinite(out.loss) and all(torch.isfinite(g).all() for g in grads)
    off = cg.GRPOConfig(beta=0.04, importance_sampling_level=level, log_ratio_clamp=None, kl_input_clamp=None,
                        kl_output_clamp=None)
    assert not torch.isfinite(cg.grpo_loss(**inp, config=off).loss)


@pytest.mark.parametrize("loss_type", ("grpo", "dapo", "cispo", "sapo", "luspo"))
def test_inf_nan_at_masked_positions_never_reach_loss_or_grads(loss_type):
    inp = make_inputs(dtype=torch.float32, seed=2, adv_2d=True)
    masked = ~inp["mask"]
    assert masked.any()
    inf, nan = torch.tensor(float("inf")), torch.tensor(float("nan"))
    inp["old_logprobs"] = torch.where(masked, -inf, inp["old_logprobs"].float())
    inp["ref_logprobs"] = torch.where(masked, nan, inp["ref_logprobs"].float())
    inp["advantages"] = torch.where(masked, nan, inp["advantages"].float())
    inp["token_ids"] = torch.where(masked, -100, inp["token_ids"])  # padding ids are fine where masked
    sr = torch.where(masked, inf, torch.ones(3, 7))
    cfg = cg.GRPOConfig(loss_type=loss_type, beta=0.04, metrics="with_entropy", entropy_coef=0.01,
                        epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    out = cg.grpo_loss(**inp, sampling_ratio=sr, config=cfg)
    grads = torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"]))
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.isfinite(out.per_token_loss).all() and (out.per_token_loss[masked] == 0).all()
    for name, value in out.metrics._asdict().items():
        if isinstance(value, torch.Tensor):
            assert torch.isfinite(value), name


@pytest.mark.parametrize("loss_type", ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"))
def test_all_masked_batch_gives_zero_loss_and_zero_grads(loss_type):
    inp = make_inputs(dtype=torch.float32, seed=3)
    inp["mask"] = torch.zeros(3, 7, dtype=torch.bool)
    cfg = cg.GRPOConfig(loss_type=loss_type, beta=0.04, max_completion_length=7, entropy_coef=0.1,
                        metrics="with_entropy")
    out = cg.grpo_loss(**inp, config=cfg)
    gh, gw = torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"]))
    assert out.loss.item() == 0.0
    assert (gh == 0).all() and (gw == 0).all()
    assert out.metrics.num_tokens.item() == 0
    assert out.metrics.max_advantage.item() == -float("inf") and out.metrics.min_advantage.item() == float("inf")


@pytest.mark.parametrize("loss_type,level", (("dapo", "token"), ("dapo", "sequence"), ("cispo", "token"),
                                              ("sapo", "token")))
def test_nan_advantage_of_a_fully_masked_sequence(loss_type, level):
    inp = make_inputs(dtype=torch.float32, seed=4)
    inp["mask"] = inp["mask"].clone()
    inp["mask"][2] = False
    inp["advantages"] = inp["advantages"].float().clone()
    inp["advantages"][2] = float("nan")  # zero-variance group normalized by std 0
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, metrics="basic",
                        epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    out = cg.grpo_loss(**inp, config=cfg)
    gh, gw = torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"]))
    assert torch.isfinite(out.loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert (gh[2] == 0).all()
    assert torch.isfinite(out.metrics.advantage) and torch.isfinite(out.metrics.max_advantage)
