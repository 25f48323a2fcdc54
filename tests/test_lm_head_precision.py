"""The lm_head precision contract (GRPOConfig.fp32_lm_head / token_logprobs(fp32_lm_head=)), on CPU
and, where present, CUDA."""
import pytest
import torch

import compiled_grpo as cg

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
