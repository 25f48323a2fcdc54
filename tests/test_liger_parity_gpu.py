"""Parity with Liger-Kernel 0.8.5's loss math on CUDA (skipped without a GPU): grpo_loss's
default CUDA path (the fused-gradient blocks' Triton kernels, in float32) over every case of
test_liger_parity.py's sampled config space, against Liger's ``ppo_loss_fn`` in float64 fed the
same inputs' exact log-probs. The CPU twin checks the loss math to float64 rounding; this one
checks that the kernels and the block schedule carry it, at float32 tolerances. The cases run in
one process, so they also cover more configs than Dynamo's recompile limit (fused.py's compiled
per-block gradient then runs eagerly for the later ones)."""
import pytest
import torch

import compiled_grpo as cg
from compiled_grpo import fused as F
from helpers import make_inputs
from test_liger_parity import CASES, NO_CLAMPS, case_seed, liger

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_fused_path_matches_liger(case):
    loss_type, level, beta, delta, bias_kl, sr_kind, num_items = case
    seed = case_seed(case)
    inp = make_inputs(seed=seed, spread=0.5, device="cuda")          # float32 on CUDA
    g = torch.Generator().manual_seed(seed)
    sr = {None: None, "token": torch.rand(3, 7, generator=g) + 0.5, "seq": torch.rand(3, 1, generator=g) + 0.5}[sr_kind]
    sr = None if sr is None else sr.cuda()
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta,
                        use_bias_correction_kl=bias_kl, max_completion_length=9, epsilon_high=eps_high,
                        metrics="basic", **NO_CLAMPS)
    assert F.use_fused(inp["hidden"], inp["weight"], None, cfg, None, None, inp["old_logprobs"])
    ours = cg.grpo_loss(**inp, sampling_ratio=sr, num_items_in_batch=num_items, config=cfg)
    ours_grads = torch.autograd.grad(ours.loss, (inp["hidden"], inp["weight"]))

    h64, w64 = (inp[k].detach().double().requires_grad_() for k in ("hidden", "weight"))
    logp = cg.reference_token_logprobs(h64, w64, inp["token_ids"]).logprobs
    m = inp["mask"].double()
    d = lambda t: None if t is None else t.double()  # noqa: E731
    loss, metrics = liger.LigerFusedLinearGRPOFunction.ppo_loss_fn(
        logp, m, d(inp["advantages"]), m, ref_per_token_logps=d(inp["ref_logprobs"]),
        old_per_token_logps=d(inp["old_logprobs"]), beta=beta, epsilon_low=0.2, epsilon_high=eps_high,
        loss_type=loss_type, max_completion_length=9, importance_sampling_level=level,
        vllm_is_ratio=d(sr), delta=delta, use_bias_correction_kl=bias_kl, num_items_in_batch=num_items)
    liger_grads = torch.autograd.grad(loss, (h64, w64))

    # the loss sums terms of either sign (~1 each): fp32 rounding is absolute at that scale
    torch.testing.assert_close(ours.loss.double(), loss, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("dX", "dW"), ours_grads, liger_grads):
        assert _rel(a, b) < 1e-4, (name, _rel(a, b))
    if beta != 0.0:
        assert _rel(ours.metrics.kl_ref, metrics[0].double()) < 1e-4
    if level == "token":   # sequence level: Liger weighs the clip flags by tokens, TRL (and we) by sequences
        torch.testing.assert_close(ours.metrics.clip_ratio.double(), metrics[-1].double(), rtol=0, atol=1e-6)
