"""Edge cases and hostile input (issue 15): empty batches, -inf logits, NaN, float masks, dtypes.

Legend: B sequences, T positions, N tokens, H hidden, V vocab. docs/errors-and-edge-cases.md states the
decisions these tests hold.
"""
import pytest
import torch

import compiled_grpo as cg
from compiled_grpo.reference import reference_grpo_loss
from helpers import DEVICES

# every loss type the float64 reference covers (reference_grpo_loss has no vespo: tests/test_trl_options.py)
EDGE_LOSS_TYPES = tuple(t for t in cg.config.LOSS_TYPES if t != "vespo")


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


@pytest.mark.parametrize("loss_type", EDGE_LOSS_TYPES)
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


def _banned_inputs(kind, dtype=torch.float64, N=6, H=8, V=40, seed=1):
    """hidden [N, H], weight [V, H], bias [V], ids [N] where tokens 0, 5 and 16..31 (two whole
    16-column chunks when CHUNK_V = 16: a row's first chunk may be all -inf) have logit -inf:
    by a -inf bias, a -inf weight row (hidden > 0), or a weight row whose logit overflows."""
    hidden, weight, bias = (t.detach() for t in _leaves((N, H), (V, H), (V,), dtype=dtype, seed=seed))
    banned = torch.tensor([0, 5] + list(range(16, 32)))
    if kind == "bias":
        bias[banned] = -torch.inf
    else:
        hidden = hidden.abs() + 0.1                     # every logit of a negative row is negative
        weight[banned] = -torch.inf if kind == "weight_inf" else -torch.finfo(dtype).max
    ids = torch.randint(33, V, (N,), generator=torch.Generator().manual_seed(seed))
    return [t.requires_grad_() for t in (hidden, weight, bias)] + [ids]


@pytest.mark.parametrize("kind", ["bias", "weight_inf", "weight_overflow"])
@pytest.mark.parametrize("chunk", [16, 4096])
def test_minus_inf_logits_give_finite_values_and_grads(monkeypatch, kind, chunk):
    from lowerings.linear_logprobs import cpu
    monkeypatch.setattr(cpu, "CHUNK_V", chunk)
    hidden, weight, bias, ids = _banned_inputs(kind)
    outs = []
    for fn in (cg.token_logprobs, cg.reference_token_logprobs):
        out = fn(hidden, weight, ids, bias, with_entropy=True)
        loss = (out.logprobs * 0.7 + out.entropy * 1.3 + out.lse * 0.1).sum()
        outs.append((out.logprobs, out.entropy, out.lse) + torch.autograd.grad(loss, (hidden, weight, bias)))
    for a, r in zip(*outs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)
    assert not outs[0][4][16:32].any()                  # dW rows of banned tokens are 0


@pytest.mark.parametrize("kind", ["bias", "weight_overflow"])
def test_minus_inf_logits_in_grpo_loss(kind):
    hidden, weight, bias, ids = _banned_inputs(kind, dtype=torch.float32, N=12)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    args = (hidden.view(2, 6, -1), weight, ids.view(2, 6).masked_fill(~mask, 5), torch.tensor([1.0, -1.0]), mask)
    kw = dict(bias=bias, config=cg.GRPOConfig(entropy_coef=0.1, metrics="with_entropy"))
    ours = cg.grpo_loss(*args, **kw)
    gold = reference_grpo_loss(*args, **kw)
    compiled = torch.compile(cg.grpo_loss, backend="aot_eager", fullgraph=True)(*args, **kw)
    for out in (ours, compiled):
        grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
        assert torch.isfinite(out.loss) and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(ours.loss, gold.loss)
    torch.testing.assert_close(ours.entropy, gold.entropy)


def _loss_inputs(dtype=torch.float32):
    hidden, weight = _leaves((2, 5, 8), (11, 8), dtype=dtype)
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    return dict(hidden=hidden, weight=weight, token_ids=ids, advantages=torch.tensor([1.0, -0.5]),
                mask=torch.ones(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("where", ["weight", "bias", "bias+inf"])
def test_nan_in_lm_head_is_reported_in_eager_cpu(where):
    inp = _loss_inputs()
    bias = torch.zeros(11)
    if where == "weight":
        inp["weight"] = inp["weight"].detach().clone()
        inp["weight"][3, 2] = float("nan")
    else:
        bias[7] = float("nan") if where == "bias" else float("inf")
    name = where.rstrip("+inf")
    with pytest.raises(ValueError, match=f"{name} holds NaN"):
        cg.grpo_loss(**inp, bias=bias)
    with pytest.raises(ValueError, match=f"{name} holds NaN"):
        cg.token_logprobs(inp["hidden"], inp["weight"], inp["token_ids"], bias)


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")])
def test_mask_other_than_0_1_is_rejected(value):
    inp = _loss_inputs()
    inp["mask"] = inp["mask"].float()
    inp["mask"][1, 2] = value
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        cg.grpo_loss(**inp)
    with pytest.raises(ValueError, match="mask must be bool"):
        cg.token_logprobs(inp["hidden"], inp["weight"], inp["token_ids"], mask=inp["mask"])
    f = torch.compile(cg.grpo_loss, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        f(**inp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_0_1_masks_of_any_dtype_equal_the_bool_mask(dtype):
    inp = _loss_inputs()
    inp["mask"][1, 3:] = False
    ref = cg.grpo_loss(**inp).loss
    assert cg.grpo_loss(**dict(inp, mask=inp["mask"].to(dtype))).loss == ref


@pytest.mark.parametrize("h_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float64)])
def test_mixed_dtypes_compute_in_the_promoted_type(h_dtype, w_dtype):
    """The GEMM runs in promote_types(hidden, weight) (fp32 at least on CPU), grads in each input's dtype."""
    inp = _loss_inputs()
    h = inp["hidden"].detach().to(h_dtype).requires_grad_()
    w = inp["weight"].detach().to(w_dtype).requires_grad_()
    out = cg.grpo_loss(**dict(inp, hidden=h, weight=w), config=cg.GRPOConfig(metrics="with_entropy"))
    gh, gw = torch.autograd.grad(out.loss, (h, w))
    assert gh.dtype == h_dtype and gw.dtype == w_dtype
    cd = torch.promote_types(torch.promote_types(h_dtype, w_dtype), torch.float32)
    assert out.logprobs.dtype == cd
    h_up, w_up = h.detach().to(cd).requires_grad_(), w.detach().to(cd).requires_grad_()
    gold = reference_grpo_loss(**dict(inp, hidden=h_up, weight=w_up), config=cg.GRPOConfig(metrics="with_entropy"))
    torch.testing.assert_close(out.loss, gold.loss.to(out.loss.dtype))
    for g, r in zip((gh, gw), torch.autograd.grad(gold.loss, (h_up, w_up))):
        torch.testing.assert_close(g, r.to(g.dtype))


@pytest.mark.parametrize("h,v", [(0, 11), (8, 0)])
def test_empty_hidden_or_vocab_size_is_an_error(h, v):
    with pytest.raises(ValueError, match="H >= 1 and V >= 1"):
        cg.token_logprobs(torch.randn(3, h), torch.randn(v, h), torch.zeros(3, dtype=torch.long))


def test_one_token_vocab():
    inp = _loss_inputs()
    inp["weight"] = inp["weight"][:1].detach().requires_grad_()
    inp["token_ids"] = torch.zeros_like(inp["token_ids"])
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics="with_entropy", entropy_coef=0.1))
    assert not out.logprobs.any() and not out.entropy.any()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.loss, (inp["hidden"], inp["weight"])))


@pytest.mark.parametrize("garbage,dtype,temperature", [(1e4, torch.float32, 1.0), (3e38, torch.float32, 1.0),
                                                       (1e3, torch.float16, 1.0), (1e2, torch.float32, 1e-4)])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_garbage_hidden_at_masked_rows_never_reaches_the_grads(garbage, dtype, temperature, compiled, device):
    """Masked rows' hidden states (finite but huge) change nothing: log-probs and dX / dW / db equal
    those of the same batch with zeros there (the recompute backward zeroes a padded row's
    dlogits; its saved lse is 0, so exp(z - 0) overflowed and inf * 0 made NaN grads)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 6, 8, 13
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    clean = torch.randn(B, T, H, generator=g)
    hidden0 = torch.where(mask[..., None], clean, 0).to(dtype)
    hidden1 = torch.where(mask[..., None], clean, garbage).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden0, hidden1, weight, bias, ids, mask = (t.to(device) for t in (hidden0, hidden1, weight, bias, ids, mask))

    def f(h, w, b):
        out = cg.token_logprobs(h, w, ids, b, mask=mask, with_entropy=True, temperature=temperature)
        return (out.logprobs.sum() + 0.1 * out.entropy.sum() + 0.01 * out.lse.sum()), out.logprobs

    fn = torch.compile(f, backend="inductor", fullgraph=True) if compiled else f
    results = []
    for h in (hidden0, hidden1):
        leaves = [t.clone().requires_grad_() for t in (h, weight, bias)]
        loss, lp = fn(*leaves)
        results.append((lp.detach(), *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a)


def test_high_entropy_mask_keeps_the_quantile_token_in_float64():
    """The quantile is formed in fp32 (as TRL's) and compared in fp32: one valid fp64 token at
    top_quantile 0.5 is kept (compared in fp64 against its own fp32 rounding it was dropped)."""
    ent = torch.tensor([[0.1 + 1e-12, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    assert cg.high_entropy_mask(ent, mask, top_quantile=0.5).tolist() == [[True, False]]


@pytest.mark.parametrize("kw,what", [(dict(temperature=1e-40), "logit_scale / temperature"),
                                     (dict(logit_scale=1e38), "logit_scale / temperature"),
                                     (dict(final_logit_softcapping=1e-39),
                                      "logit_scale / final_logit_softcapping")])
def test_logit_scale_factors_that_overflow_fp32_are_rejected(kw, what):
    """s / T (and s / c, c / T) past 2^100 would overflow fp32 logits (NaN everywhere): GRPOConfig
    and token_logprobs raise a ValueError naming the factor."""
    with pytest.raises(ValueError, match=what):
        cg.GRPOConfig(**kw)
    h, w = _leaves((2, 3, 4), (5, 4))
    args = {"temperature": kw.get("temperature", 1.0), "logit_scale": kw.get("logit_scale", 1.0),
            "final_logit_softcapping": kw.get("final_logit_softcapping")}
    with pytest.raises(ValueError, match=what):
        cg.token_logprobs(h, w, torch.zeros(2, 3, dtype=torch.long), **args)


def test_tp_group_that_is_not_usable_is_named():
    """A tp_group that is no ProcessGroup, or a group in a process without
    init_process_group, raises a ValueError naming tp_group (not torch's default-group error)."""
    import torch.distributed as dist
    h, w = _leaves((2, 3, 4), (5, 4))
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="tp_group must be a torch.distributed ProcessGroup"):
        cg.token_logprobs(h, w, ids, tp_group=3)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="tp_group needs torch.distributed initialized"):
            cg.token_logprobs(h, w, ids, tp_group=dist.ProcessGroup(dist.HashStore(), 0, 1))


@pytest.mark.parametrize("what", ["old", "ref", "adv"])
@pytest.mark.parametrize("val", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs_at_valid_positions_one_policy_in_every_mode(what, val):
    """docs/errors-and-edge-cases.md: NaN in old / ref log-probs or advantages at a valid position makes the
    loss NaN; +-inf follow the formulas as TRL's code does (ratio 0 or inf, then the clips and
    clamps). Either way the same loss in the recompute and fused modes, and no error."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 5, 8, 19
    h, w = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    adv, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) - 3
    ref = old.clone()
    {"old": old, "ref": ref, "adv": adv}[what].view(-1)[1] = val
    losses = [cg.grpo_loss(h, w, ids, adv, mask, old, ref,
                           config=cg.GRPOConfig(beta=0.04, gradient_mode=m)).loss for m in ("recompute", "fused")]
    torch.testing.assert_close(losses[0], losses[1], equal_nan=True)
    if val != val:
        assert losses[0].isnan()
