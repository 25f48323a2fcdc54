"""Batch invariance on the GPU (tests/batch_invariance.py states the property), at the qwen3-8b
head (H = 4096, V = 151936, bf16): B = 16 sequences of T = 1024 positions (N = 16384, right
padded, lengths 1..T), each sequence alone against the whole batch, its halves, single rows
(N = 1), no mask, packed, grpo_loss fused / recompute, eager and compiled. Also the forward's
split plan at N = 1 and N = 16384 is one plan, and two runs are bitwise equal."""
import pytest
import torch

from tests.batch_invariance import make_batch, mismatches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape,precision", [
    ((16, 1024, 4096, 151936), {}), ((8, 300, 896, 151936), {}),
    # the TRL drop-in's setting under bf16: fp32 leaves multiplied in bf16, logits rounded
    ((8, 300, 896, 151936), dict(round_logits=True, lm_head_dtype=torch.bfloat16)),
    # gemma2's softcap: the fused path's exp-scaled forward stores e (1 - y^2), its own variant
    ((8, 300, 2304, 256000), dict(final_logit_softcapping=30.0)),
    # fp32_lm_head over a bf16 head: one TF32 product in the logits GEMMs (tuning.logits_precision)
    ((8, 300, 896, 151936), dict(fp32_lm_head=True))],
    ids=["qwen3-8b", "qwen2.5-0.5b", "qwen2.5-0.5b-round-logits", "gemma2-2b-softcap",
         "qwen2.5-0.5b-fp32-lm-head"])
def test_rows_bitwise_independent_of_the_batch_gpu(shape, precision):
    b, t, h, v = shape
    torch._dynamo.reset()
    batch = make_batch(b, t, h, v, torch.float32 if "lm_head_dtype" in precision else torch.bfloat16, "cuda")
    out = mismatches(*batch, **precision)
    assert out and all(n == 0 for n in out.values()), {k: n for k, n in out.items() if n}


def test_deterministic_gpu():
    import compiled_grpo as cg
    hidden, weight, ids, mask, _ = make_batch(4, 512, 1024, 32000, torch.bfloat16, "cuda", seed=3)
    runs = [cg.token_logprobs(hidden, weight, ids, mask=mask, with_entropy=True) for _ in range(2)]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert torch.equal(runs[0].entropy, runs[1].entropy)
