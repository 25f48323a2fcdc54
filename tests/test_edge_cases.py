"""Edge cases and hostile input (issue 15): empty batches, -inf logits, NaN, float masks, dtypes.

Legend: B sequences, T positions, N tokens, H hidden, V vocab. README "Edge cases" states the
decisions these tests hold.
"""
import pytest
import torch

import compiled_grpo as cg
from compiled_grpo.reference import reference_grpo_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")


def _cfg(loss_type, **kw):
    return cg.GRPOConfig(loss_type=loss_type, max_completion_length=4, beta=0.04, entropy_coef=0.01,
                         metrics="with_entropy", **kw)


def _leaves(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _empty_padded(B, T, H=8, V=11):
    hidden, weight = _leaves((B, T, H), (V, H))
    z = torch.zeros(B, T)
    return dict(hidden=hidden, weight=weight, token_ids=torch.zeros(B, T, dtype=torch.long),
                advantages=torch.randn(B), mask=torch.ones(B, T, dtype=torch.bool), old_logprobs=z,
                ref_logprobs=z)


def _empty_packed(S, H=8, V=11):
    hidden, weight = _leaves((0, H), (V, H))
    z = torch.zeros(0)
    return dict(hidden=hidden, weight=weight, token_ids=torch.zeros(0, dtype=torch.long),
                advantages=torch.randn(S), mask=torch.zeros(0, dtype=torch.bool), old_logprobs=z,
                ref_logprobs=z, cu_seqlens=torch.zeros(S + 1, dtype=torch.int32))


def _assert_zero_loss_and_grads(out, inp):
    assert out.loss.item() == 0.0
    gh, gw = torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"]))
    assert gh.shape == inp["hidden"].shape and not gh.any()
    assert gw.shape == inp["weight"].shape and not gw.any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("layout", ["T=0", "B=0", "packed N=0"])
@pytest.mark.parametrize("fn", [cg.grpo_loss, reference_grpo_loss], ids=["ours", "reference"])
def test_empty_batch_gives_zero_loss_and_zero_grads(fn, layout, loss_type):
    inp = {"T=0": lambda: _empty_padded(2, 0), "B=0": lambda: _empty_padded(0, 3),
           "packed N=0": lambda: _empty_packed(2)}[layout]()
    out = fn(**inp, config=_cfg(loss_type))
    _assert_zero_loss_and_grads(out, inp)
    assert out.metrics.num_tokens.item() == 0 and out.metrics.max_advantage.item() == -float("inf")


@pytest.mark.parametrize("layout", ["T=0", "packed N=0"])
def test_empty_batch_under_compile(layout):
    inp = _empty_padded(2, 0) if layout == "T=0" else _empty_packed(2)
    f = torch.compile(cg.grpo_loss, backend="aot_eager", fullgraph=True)
    _assert_zero_loss_and_grads(f(**inp, config=_cfg("grpo")), inp)


def test_empty_token_logprobs():
    hidden, weight = _leaves((0, 8), (11, 8))
    out = cg.token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert not weight.grad.any()
