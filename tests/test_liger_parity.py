"""Parity with Liger-Kernel 0.8.5 (``LigerFusedLinearGRPOFunction.ppo_loss_fn``) with clamps off.

Liger's loss math is fed our float64 reference log-probs, so loss, metrics and the gradients
w.r.t. hidden and weight (through both loss maths) must agree to float64 rounding. luspo is
excluded: Liger 0.8.5 and TRL 1.16 disagree there and we follow TRL (tested in test_loss_golden).
Liger is a test-only dependency: `.ci/run` installs it with --no-deps.
"""
import itertools
import random
import zlib

import pytest
import torch

import compiled_grpo as cg
from helpers import make_inputs

liger = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss", reason="liger-kernel==0.8.5 is installed by .ci/run")

NO_CLAMPS = dict(log_ratio_clamp=None, kl_input_clamp=None, kl_output_clamp=None)
SPACE = list(itertools.product(
    ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"), ("token", "sequence"), (0.0, 0.04), (None, 1.6),
    (False, True), (None, "token", "seq"), (None, 50)))
CASES = [c for c in SPACE if not (c[1] == "sequence" and c[0] in ("cispo", "sapo"))]
CASES = random.Random(0).sample(CASES, 200)


def case_seed(case) -> int:
    """The inputs' seed of a case: the same in every process (hash() of a str is salted)."""
    return zlib.crc32(repr(case).encode()) % 10_000


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_loss_grads_metrics_match_liger(case):
    loss_type, level, beta, delta, bias_kl, sr_kind, num_items = case
    seed = case_seed(case)
    inp = make_inputs(seed=seed, spread=0.5)
    g = torch.Generator().manual_seed(seed)
    sr = {None: None, "token": torch.rand(3, 7, generator=g, dtype=torch.float64) + 0.5,
          "seq": torch.rand(3, 1, generator=g, dtype=torch.float64) + 0.5}[sr_kind]
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta,
                        use_bias_correction_kl=bias_kl, max_completion_length=9, epsilon_high=eps_high,
                        metrics="basic", **NO_CLAMPS)
    h, w = inp["hidden"], inp["weight"]
    ours = cg.grpo_loss(**inp, sampling_ratio=sr, num_items_in_batch=num_items, config=cfg)
    ours_grads = torch.autograd.grad(ours.loss, (h, w))

    logp = cg.reference_token_logprobs(h, w, inp["token_ids"]).logprobs  # float64, differentiable
    m = inp["mask"].double()
    loss, metrics = liger.LigerFusedLinearGRPOFunction.ppo_loss_fn(
        logp, m, inp["advantages"], m, ref_per_token_logps=inp["ref_logprobs"],
        old_per_token_logps=inp["old_logprobs"], beta=beta, epsilon_low=0.2, epsilon_high=eps_high,
        loss_type=loss_type, max_completion_length=9, importance_sampling_level=level, vllm_is_ratio=sr,
        delta=delta, use_bias_correction_kl=bias_kl, num_items_in_batch=num_items)
    liger_grads = torch.autograd.grad(loss, (h, w))

    torch.testing.assert_close(ours.loss, loss, rtol=1e-11, atol=1e-13)
    for a, b in zip(ours_grads, liger_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    if beta != 0.0:
        torch.testing.assert_close(ours.metrics.kl_ref, metrics[0].double(), rtol=1e-11, atol=1e-13)
    if level == "token":   # sequence level: Liger weighs the clip flags by tokens, TRL (and we) by sequences
        torch.testing.assert_close(ours.metrics.clip_ratio, metrics[-1].double(), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("loss_type", ("grpo", "dapo", "bnpo"))
def test_liger_module_end_to_end_float32(loss_type):
    """The whole LigerFusedLinearGRPOLoss (its own fp32 log-prob streaming) vs ours in fp32."""
    inp = make_inputs(seed=21, dtype=torch.float32, spread=0.5)
    cfg = cg.GRPOConfig(loss_type=loss_type, beta=0.04, temperature=0.9, **NO_CLAMPS)
    h, w = inp["hidden"], inp["weight"]
    ours = cg.grpo_loss(**inp, config=cfg)
    gh, gw = torch.autograd.grad(ours.loss, (h, w))
    mod = liger.LigerFusedLinearGRPOLoss(beta=0.04, compiled=False, loss_type=loss_type, temperature=0.9)
    loss, _ = mod(h, w, inp["token_ids"], inp["mask"].float(), inp["advantages"].float(),
                  ref_per_token_logps=inp["ref_logprobs"].float(), old_per_token_logps=inp["old_logprobs"].float())
    lh, lw = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(ours.loss, loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(gh, lh, rtol=2e-4, atol=1e-6)
    torch.testing.assert_close(gw, lw, rtol=2e-4, atol=1e-6)
