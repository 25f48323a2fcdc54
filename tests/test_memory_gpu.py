"""The CUDA bounds of docs/gradient-modes.md asserted at the qwen3-8b head (H = 4096,
V = 151936, bf16, B = 8 x T = 2048, ~60% of the positions valid; one [N, V] bf16 tensor would
be 4.6 GiB): the peak allocated beyond the inputs and the gradients the backward returns, in
every gradient mode and path, eager and compiled.

  recompute paths (token_logprobs, grpo_loss recompute, packed): one row group's fp32 dX
      accumulator (tuning.DX_GROUP_BYTES) + the dlogits workspace (tuning.WS_BYTES) + SLACK
  fused (and auto, which is fused here): fused_workspace_mib + the dX step's split partials
      (fused/blocks.DX_SPLIT_BYTES) + SLACK
  + the [N]-sized per-token vectors of the loss (PER_TOKEN_FLOATS a token) in every mode.
"""
import pytest
import torch

import compiled_grpo as cg
import lowerings.linear_logprobs.tuning as tuning
from test_linear_logprobs_gpu import _peak_beyond_grads   # one fwd + bwd beyond inputs and grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLACK = 64 << 20          # xg [R, H], the per-block vectors, cuBLAS / allocator rounding
PER_TOKEN_FLOATS = 64     # the loss's [N] tensors (ratios, KL, masks, the per-token gradient)
B, T, H, V = 8, 2048, 4096, 151936


def _inputs(packed: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * (2 / H ** 0.5)).bfloat16()
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    lens = (torch.rand(B, device="cuda", generator=g) * T * 1.2).long().clamp(1, T)
    mask = torch.arange(T, device="cuda")[None, :] < lens[:, None]
    adv = torch.randn(B, device="cuda", generator=g)
    if packed:
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        x, ids = x[mask], ids[mask]
        mask = torch.ones_like(ids, dtype=torch.bool)
        return x, w, ids, adv, mask, dict(cu_seqlens=cu)
    return x, w, ids, adv, mask, {}


CASES = [("token_logprobs", False, False), ("recompute", False, False), ("recompute", True, False),
         ("fused", False, False), ("fused", True, False), ("auto", False, False),
         ("recompute", False, True), ("fused", False, True)]


@pytest.mark.parametrize("mode,packed,compiled", CASES,
                         ids=[f"{m}{'-packed' if p else ''}{'-compiled' if c else ''}" for m, p, c in CASES])
def test_qwen3_8b_head_within_the_documented_bound(mode, packed, compiled):
    from lowerings.linear_logprobs.fused import blocks
    torch._dynamo.reset()
    x, w, ids, adv, mask, kw = _inputs(packed)
    x, w = x.requires_grad_(), w.requires_grad_()
    with torch.no_grad():
        old = cg.token_logprobs(x, w, ids, mask=mask, **kw).logprobs
    cfg = cg.GRPOConfig(beta=0.0, gradient_mode="auto" if mode == "token_logprobs" else mode)

    def loss_fn(x, w):
        if mode == "token_logprobs":
            out = cg.token_logprobs(x, w, ids, mask=mask, with_entropy=True, **kw)
            return (out.logprobs * adv.mean()).sum() + out.entropy.sum()
        return cg.grpo_loss(x, w, ids, adv, mask, old, config=cfg, **kw).loss

    extra = _peak_beyond_grads(torch.compile(loss_fn) if compiled else loss_fn, x, w)
    n = ids.numel()
    if mode in ("fused", "auto"):
        bound = cfg.fused_workspace_mib * 2**20 + blocks.DX_SPLIT_BYTES
    else:
        bound = tuning.DX_GROUP_BYTES + tuning.WS_BYTES
    bound += SLACK + PER_TOKEN_FLOATS * 4 * n
    print(f"{mode}{' packed' if packed else ''}{' compiled' if compiled else ''}: "
          f"{extra / 2**20:.0f} MiB beyond inputs + grads (bound {bound / 2**20:.0f})")
    assert extra <= bound, (extra / 2**20, bound / 2**20)
