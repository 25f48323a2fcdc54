"""Property tests (hypothesis): random shapes and configs against the float64 golden transcription."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compiled_grpo as cg
from helpers import golden_loss, make_inputs

CONFIGS = st.fixed_dictionaries({
    "loss_type": st.sampled_from(("grpo", "bnpo", "dr_grpo", "dapo", "luspo")),
    "importance_sampling_level": st.sampled_from(("token", "sequence")),
    "beta": st.sampled_from((0.0, 0.04, 0.5)),
    "kl_estimator": st.sampled_from(("k1", "k2", "k3")),
    "delta": st.sampled_from((None, 1.3, 3.0)),
    "epsilon_low": st.floats(0.0, 0.5),
    "epsilon_high": st.floats(0.0, 0.5),
    "temperature": st.floats(0.3, 2.0),
    "use_bias_correction_kl": st.booleans(),
})


@settings(max_examples=40, deadline=None)
@given(cfg=CONFIGS, B=st.integers(1, 4), T=st.integers(1, 9), V=st.integers(2, 300), seed=st.integers(0, 2**16))
def test_random_config_and_shape_matches_golden(cfg, B, T, V, seed):
    config = cg.GRPOConfig(max_completion_length=T + 2, **cfg)
    inp = make_inputs(B=B, T=T, H=8, V=V, seed=seed, spread=0.5)
    ours = cg.grpo_loss(**inp, config=config)
    gold, _ = golden_loss(**inp, cfg=config)
    gh, gw = torch.autograd.grad(ours.loss, (inp["hidden"], inp["weight"]))
    rh, rw = torch.autograd.grad(gold, (inp["hidden"], inp["weight"]))
    torch.testing.assert_close(ours.loss, gold, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-12)



# --- The op and grpo_loss against the float64 reference (issue 15) --------------------------
# Shapes that are multiples of no tile (V, H, T drawn freely; CHUNK_V and the CPU body's row-group
# budget WS_BYTES drawn too, so chunk and group boundaries fall anywhere), one-token and empty
# sequences, all-masked rows, packed inputs. Examples are capped per test: the whole file runs in
# ~5-10 s on 2 cores.
from contextlib import ExitStack  # noqa: E402
from unittest import mock  # noqa: E402

import lowerings.linear_logprobs.cpu as torch_impl  # noqa: E402
from lowerings.linear_logprobs import linear_logprobs  # noqa: E402

DTYPES = st.sampled_from((torch.float64, torch.float32, torch.bfloat16))
# (rtol, atol) of values and of grads: the CPU body computes bf16 in fp32 (exact products), so
# only its grads carry bf16's rounding (they come back in the inputs' dtype).
TOL = {torch.float64: ((1e-9, 1e-11), (1e-9, 1e-10)), torch.float32: ((1e-4, 2e-5), (1e-4, 1e-4)),
       torch.bfloat16: ((1e-4, 2e-5), (1e-2, 1e-2))}
TILES = dict(chunk=st.sampled_from((7, 16, 4096)), group_rows=st.sampled_from((3, 5, None)))


def _tiles(chunk, group_rows):
    """CHUNK_V = chunk and WS_BYTES for row groups of about group_rows rows (fp32; None: one group)."""
    stack = ExitStack()
    stack.enter_context(mock.patch.object(torch_impl, "CHUNK_V", chunk))
    if group_rows is not None:
        stack.enter_context(mock.patch.object(torch_impl, "WS_BYTES", group_rows * chunk * 4))
    return stack


def _leaf(t):
    return None if t is None else t.detach().double().requires_grad_()


@settings(max_examples=150, deadline=None)
@given(N=st.integers(0, 40), H=st.integers(1, 20), V=st.integers(2, 90), dtype=DTYPES, bias=st.booleans(),
       temperature=st.floats(0.5, 2.0), with_entropy=st.booleans(), p_mask=st.sampled_from((0.0, 0.5, 1.0)),
       seed=st.integers(0, 2**16), **TILES)
def test_op_matches_float64_reference(N, H, V, dtype, bias, temperature, with_entropy, p_mask, seed, chunk,
                                      group_rows):
    g = torch.Generator().manual_seed(seed)
    x, w = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in ((N, H), (V, H)))
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    ids = torch.randint(0, V, (N,), generator=g)
    row_mask = torch.rand(N, generator=g) >= p_mask                     # p_mask 1: every row masked
    upstream = torch.randn(3, N, generator=g, dtype=torch.float64)       # grads of lp, entropy, lse
    params = [t for t in (x, w, b) if t is not None]
    with _tiles(chunk, group_rows):
        out = linear_logprobs(x, w, ids, b, temperature=temperature, with_entropy=with_entropy, row_mask=row_mask)
        loss = sum((o.double() * u).sum() for o, u in zip(out, upstream) if o is not None)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    ref_params = [_leaf(t) for t in params]
    xr, wr, br = ref_params + [None] * (3 - len(ref_params))
    ref = cg.reference_token_logprobs(xr, wr, ids, br, mask=row_mask, temperature=temperature,
                                      with_entropy=with_entropy)
    rloss = sum((r * u).sum() for r, u in zip(ref, upstream) if r is not None)
    (vtol, gtol) = TOL[dtype]
    for o, r in zip(out, ref):
        if r is not None:
            torch.testing.assert_close(o.double(), r, rtol=vtol[0], atol=vtol[1])
    for got, want in zip(grads, torch.autograd.grad(rloss, ref_params, allow_unused=True)):
        got = torch.zeros_like(want) if got is None else got.double()
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, rtol=gtol[0], atol=gtol[1])


LOSS_CONFIGS = st.fixed_dictionaries({
    "loss_type": st.sampled_from(("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")),
    "beta": st.sampled_from((0.0, 0.04)),
    "entropy_coef": st.sampled_from((0.0, 0.01)),
    "metrics": st.sampled_from(("none", "with_entropy")),
})


@settings(max_examples=120, deadline=None)
@given(cfg=LOSS_CONFIGS, lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5), packed=st.booleans(),
       H=st.integers(1, 12), V=st.integers(2, 70), dtype=DTYPES, p_mask=st.sampled_from((0.0, 0.4, 1.0)),
       seed=st.integers(0, 2**16), **TILES)
def test_grpo_loss_matches_float64_reference(cfg, lengths, packed, H, V, dtype, p_mask, seed, chunk, group_rows):
    """Packed (cu_seqlens over `lengths`, empty and one-token sequences included) or padded to
    [S, max(lengths)] (pad positions masked); p_mask 1 masks every token."""
    config = cg.GRPOConfig(max_completion_length=8, **cfg)
    g = torch.Generator().manual_seed(seed)
    S, N, T = len(lengths), sum(lengths), max(lengths)
    valid = torch.rand(N, generator=g) >= p_mask                                   # [N]
    if packed:
        cu = torch.tensor([0] + lengths).cumsum(0)
        tok_shape, mask = (N,), valid
    else:
        cu, tok_shape = None, (S, T)
        mask = torch.zeros(S, T, dtype=torch.bool)
        mask[torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]] = valid
    hidden = torch.randn(*tok_shape, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    ids = torch.randint(0, V, tok_shape, generator=g)
    adv = torch.randn(S, generator=g, dtype=torch.float64)
    with torch.no_grad():
        p = cg.reference_token_logprobs(hidden, weight, ids).logprobs
    old = p + 0.3 * torch.randn(tok_shape, generator=g, dtype=torch.float64)
    ref = p + 0.3 * torch.randn(tok_shape, generator=g, dtype=torch.float64)
    h, w = (t.to(dtype).requires_grad_() for t in (hidden, weight))
    kw = dict(cu_seqlens=cu, config=config)
    with _tiles(chunk, group_rows):
        ours = cg.grpo_loss(h, w, ids, adv, mask, old, ref, **kw)
        grads = torch.autograd.grad(ours.loss, (h, w))
    hr, wr = _leaf(h), _leaf(w)
    gold = cg.reference_grpo_loss(hr, wr, ids, adv, mask, old, ref, **kw)
    (vtol, gtol) = TOL[dtype]
    torch.testing.assert_close(ours.loss.double(), gold.loss, rtol=vtol[0], atol=vtol[1])
    torch.testing.assert_close(ours.per_token_loss.double(), gold.per_token_loss, rtol=vtol[0], atol=vtol[1])
    for got, want in zip(grads, torch.autograd.grad(gold.loss, (hr, wr))):
        torch.testing.assert_close(got.double(), want, rtol=gtol[0], atol=gtol[1])


SEQ_CONFIGS = st.fixed_dictionaries({
    "loss_type": st.sampled_from(("grpo", "bnpo", "dr_grpo", "dapo", "luspo")),
    "importance_sampling_level": st.just("sequence"),
    "beta": st.sampled_from((0.0, 0.04)),
    "entropy_coef": st.sampled_from((0.0, 0.01)),
}) | st.fixed_dictionaries({"loss_type": st.just("vespo"), "beta": st.sampled_from((0.0, 0.04))})


@settings(max_examples=40, deadline=None)
@given(cfg=SEQ_CONFIGS, lengths=st.lists(st.integers(0, 7), min_size=1, max_size=7),
       extra=st.integers(0, 3), rows=st.sampled_from((16, 32, 48)), V=st.integers(2, 40),
       p_mask=st.sampled_from((0.0, 0.3, 1.0)), seed=st.integers(0, 2**16))
def test_packed_whole_sequence_blocks_match_float64_reference(cfg, lengths, extra, rows, V, p_mask, seed):
    """Sequence-coupled losses on packed inputs in the fused mode (blocks of rows // max_seqlen
    whole sequences, max_seqlen = the longest + extra): the float64 reference's loss and grads."""
    H = 6
    config = cg.GRPOConfig(max_completion_length=8, gradient_mode="fused", **cfg,
                           fused_workspace_mib=rows * V * 8 / 2**20)
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    mask = torch.rand(N, generator=g) >= p_mask                                    # [N]
    cu = torch.tensor([0] + lengths).cumsum(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).requires_grad_()
    ids = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    with torch.no_grad():
        p = cg.reference_token_logprobs(hidden, weight, ids).logprobs
    old = p + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    ref = p + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    ours = cg.grpo_loss(hidden, weight, ids, adv, mask, old, ref, cu_seqlens=cu,
                        max_seqlen=max(lengths) + extra or 1, config=config)
    gold = cg.reference_grpo_loss(hidden, weight, ids, adv, mask, old, ref, cu_seqlens=cu, config=config)
    torch.testing.assert_close(ours.loss, gold.loss, rtol=1e-10, atol=1e-12)
    for got, want in zip(torch.autograd.grad(ours.loss, (hidden, weight)),
                         torch.autograd.grad(gold.loss, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# --- Hostile corners in every mode (issue 41): empty batches, all-masked rows, garbage at masked
# positions. Both gradient modes (and compiled recompute on a few) give the same loss and grads,
# finite, and equal to the same batch with zeros at the masked positions.
@settings(max_examples=25, deadline=None)
@given(B=st.integers(0, 3), T=st.integers(0, 6), p_valid=st.sampled_from((0.0, 0.5, 1.0)),
       garbage=st.sampled_from((0.0, 1e4, 3e38)), dtype=st.sampled_from((torch.float32, torch.float64)),
       loss_type=st.sampled_from(("grpo", "dapo", "dr_grpo")), seed=st.integers(0, 2**16))
def test_hostile_corners_agree_across_modes(B, T, p_valid, garbage, dtype, loss_type, seed):
    g = torch.Generator().manual_seed(seed)
    H, V = 8, 23
    mask = torch.rand(B, T, generator=g) < p_valid
    clean = torch.randn(B, T, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype)
    ids = torch.where(mask, torch.randint(0, V, (B, T), generator=g), -100)   # padding ids at masked
    adv = torch.randn(B, generator=g, dtype=dtype)
    old = torch.where(mask, torch.randn(B, T, generator=g, dtype=dtype) - 3, torch.nan)
    cfg = dict(loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=max(T, 1))
    results = []
    for hidden in (torch.where(mask[..., None], clean, 0), torch.where(mask[..., None], clean, garbage)):
        for mode in ("recompute", "fused"):
            h, ww = hidden.clone().requires_grad_(), w.clone().requires_grad_()
            out = cg.grpo_loss(h, ww, ids, adv, mask, old, old, config=cg.GRPOConfig(gradient_mode=mode, **cfg))
            gh, gw = torch.autograd.grad(out.loss, (h, ww), allow_unused=True)
            gh = torch.zeros_like(h) if gh is None else gh
            gw = torch.zeros_like(ww) if gw is None else gw
            results.append((out.loss.detach(), gh, gw))
    for loss, gh, gw in results:
        assert loss.isfinite() and gh.isfinite().all() and gw.isfinite().all()
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, **tol)
