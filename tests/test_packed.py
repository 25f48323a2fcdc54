"""Packed (padding-free) inputs: ``cu_seqlens`` gives the padded layout's numbers.

Each test builds padded [B, T] inputs with helpers.make_inputs, cuts sequence i to its first L_i
positions (mask False beyond L_i in the padded copy), and packs those positions end to end: the
packed call must give the padded call's loss, per-token outputs (at the packed rows), metrics and
gradients, in float64 up to summation order. Lengths include an empty sequence, a fully masked
one and masked tokens inside sequences.
"""
import dataclasses
import functools
import itertools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_grpo as cg
from helpers import DEVICES, make_inputs

LENGTHS = (5, 0, 3, 7, 4)            # sequence 1 empty; sequence 4 fully masked (below)
T = max(LENGTHS)
PAIRS = [(lt, lvl) for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
         for lvl in ("token", "sequence")]
PER_TOKEN = ("token_ids", "mask", "old_logprobs", "ref_logprobs", "sampling_ratio")


@cg.metric("test_packed_min_ratio")
def _min_ratio(stats: cg.TokenStats) -> torch.Tensor:
    return torch.where(stats.mask, stats.ratio, torch.inf).amin()


def cu_of(lengths, dtype=torch.int64):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)


def pack(x, lengths):
    """[B, T, ...] -> [sum L_i, ...]: each sequence's first L_i positions, end to end."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def padded_and_packed(lengths=LENGTHS, seed=0, adv_2d=False, sampling_ratio=False, fully_masked=(4,)):
    pad = make_inputs(B=len(lengths), T=max(lengths), seed=seed, adv_2d=adv_2d, p_mask=0.25)
    mask = pad["mask"].clone()
    for i, n in enumerate(lengths):
        mask[i, n:] = False
    for i in fully_masked:
        mask[i] = False
    pad["mask"] = mask
    if sampling_ratio:
        g = torch.Generator().manual_seed(seed + 1)
        pad["sampling_ratio"] = torch.rand(mask.shape, generator=g, dtype=torch.float64) + 0.5
    packed = {k: pack(v, lengths) if k in PER_TOKEN else v for k, v in pad.items()}
    packed["hidden"] = pack(pad["hidden"], lengths).detach().requires_grad_()
    if adv_2d:
        packed["advantages"] = pack(pad["advantages"], lengths)
    return pad, packed


def assert_same(packed_out, padded_out, lengths, rtol=1e-12, atol=1e-14):
    torch.testing.assert_close(packed_out.loss, padded_out.loss, rtol=rtol, atol=atol)
    for name in ("per_token_loss", "logprobs", "entropy"):
        a, e = getattr(packed_out, name), getattr(padded_out, name)
        assert (a is None) == (e is None), name
        if e is not None:
            torch.testing.assert_close(a, pack(e, lengths).detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert (packed_out.metrics is None) == (padded_out.metrics is None)
    if padded_out.metrics is not None:
        for name, e in padded_out.metrics._asdict().items():
            a = getattr(packed_out.metrics, name)
            if name == "custom":
                assert a.keys() == e.keys()
                a, e = list(a.values()), list(e.values())
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"metrics.{name}: {m}")


def assert_same_grads(packed_out, padded_out, pad, packed, lengths, shared=()):
    """d/d hidden at the packed rows, d/d weight (and any ``shared`` leaf such as bias) equal."""
    gh, gw, *gs = torch.autograd.grad(packed_out.loss, (packed["hidden"], packed["weight"], *shared))
    rh, rw, *rs = torch.autograd.grad(padded_out.loss, (pad["hidden"], pad["weight"], *shared))
    torch.testing.assert_close(gh, pack(rh, lengths), rtol=1e-10, atol=1e-14)
    for a, e in zip([gw, *gs], [rw, *rs]):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-14)
    for i, n in enumerate(lengths):  # padding rows get no gradient in the padded layout
        assert not rh[i, n:].any()


@pytest.mark.parametrize("loss_type,level", PAIRS)
@pytest.mark.parametrize("beta,sampling_ratio,num_items", list(itertools.product((0.0, 0.04), (False, True), (None, 40))))
def test_matrix_equals_padded(loss_type, level, beta, sampling_ratio, num_items):
    pad, packed = padded_and_packed(seed=len(loss_type) + 3 * (level == "sequence"), sampling_ratio=sampling_ratio)
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, max_completion_length=9,
                        epsilon_high=5.0 if loss_type == "cispo" else 0.28, entropy_coef=0.01,
                        metrics=("with_entropy", "test_packed_min_ratio"))
    cu = cu_of(LENGTHS)
    a = cg.grpo_loss(**packed, cu_seqlens=cu, num_items_in_batch=num_items, config=cfg)
    e = cg.grpo_loss(**pad, num_items_in_batch=num_items, config=cfg)
    assert a.per_token_loss.shape == (sum(LENGTHS),)
    assert_same(a, e, LENGTHS)
    assert_same_grads(a, e, pad, packed, LENGTHS)


@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("cu_dtype", (torch.int32, torch.int64))
def test_per_token_advantages_kl_estimators_and_bias(level, cu_dtype):
    pad, packed = padded_and_packed(seed=11, adv_2d=True, fully_masked=())
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(pad["weight"].shape[0], generator=g, dtype=torch.float64, requires_grad=True)
    for est, corr in itertools.product(("k1", "k2", "k3"), (False, True)):
        cfg = cg.GRPOConfig(loss_type="grpo", importance_sampling_level=level, beta=0.1, kl_estimator=est,
                            use_bias_correction_kl=corr, temperature=0.7, grad_divisor=100.0, metrics="basic")
        a = cg.grpo_loss(**packed, bias=bias, cu_seqlens=cu_of(LENGTHS, cu_dtype), config=cfg)
        e = cg.grpo_loss(**pad, bias=bias, config=cfg)
        assert_same(a, e, LENGTHS)
        assert_same_grads(a, e, pad, packed, LENGTHS, shared=(bias,))


def test_reference_and_on_policy():
    pad, packed = padded_and_packed(seed=13)
    cfg = cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", metrics="basic")
    cu = cu_of(LENGTHS)
    for k in ("old_logprobs",):
        packed[k], pad[k] = None, None
    a = cg.reference_grpo_loss(**packed, cu_seqlens=cu, config=cfg)
    assert_same(a, cg.grpo_loss(**pad, config=cfg), LENGTHS)
    assert a.metrics.ratio_new_old.item() == 1.0


def test_hf_packed_batch_shapes():
    """HF's padding-free batch: hidden [1, N, H], per-token tensors [1, N]; outputs come back [1, N]."""
    pad, packed = padded_and_packed(seed=14, sampling_ratio=True)
    n = sum(LENGTHS)
    hf = {k: (v.unsqueeze(0) if k in PER_TOKEN else v) for k, v in packed.items()}
    hf["hidden"] = packed["hidden"].detach().unsqueeze(0).requires_grad_()
    cfg = cg.GRPOConfig(loss_type="dr_grpo", max_completion_length=8, beta=0.04, metrics="with_entropy")
    a = cg.grpo_loss(**hf, cu_seqlens=cu_of(LENGTHS), config=cfg)
    e = cg.grpo_loss(**pad, config=cfg)
    assert a.per_token_loss.shape == a.logprobs.shape == a.entropy.shape == (1, n)
    flat = a._replace(per_token_loss=a.per_token_loss[0], logprobs=a.logprobs[0], entropy=a.entropy[0])
    assert_same(flat, e, LENGTHS)
    gh = torch.autograd.grad(a.loss, hf["hidden"])[0]
    torch.testing.assert_close(gh[0], pack(torch.autograd.grad(e.loss, pad["hidden"])[0], LENGTHS))
    # per-token advantages as [1, N]
    pad2, packed2 = padded_and_packed(seed=15, adv_2d=True)
    hf2 = {k: (v.unsqueeze(0) if k in PER_TOKEN or k in ("advantages", "hidden") else v) for k, v in packed2.items()}
    a2 = cg.grpo_loss(**hf2, cu_seqlens=cu_of(LENGTHS), config=cfg)
    torch.testing.assert_close(a2.loss, cg.grpo_loss(**pad2, config=cfg).loss, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("with_mask", (False, True))
def test_token_logprobs_packed(with_mask):
    pad, packed = padded_and_packed(seed=16)
    mask = dict(mask=packed["mask"]) if with_mask else {}
    cu = cu_of(LENGTHS)
    out = cg.token_logprobs(packed["hidden"], packed["weight"], packed["token_ids"], cu_seqlens=cu,
                            with_entropy=True, **mask)
    ref = cg.token_logprobs(pad["hidden"], pad["weight"], pad["token_ids"], with_entropy=True,
                            **(dict(mask=pad["mask"]) if with_mask else {}))
    for a, e in ((out.logprobs, ref.logprobs), (out.entropy, ref.entropy)):
        torch.testing.assert_close(a, pack(e, LENGTHS), rtol=1e-12, atol=1e-14)
    gold = cg.reference_token_logprobs(packed["hidden"], packed["weight"], packed["token_ids"], cu_seqlens=cu,
                                       with_entropy=True, **mask)
    for a, e in zip(out, gold):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
    hf = cg.token_logprobs(packed["hidden"].unsqueeze(0), packed["weight"], packed["token_ids"].unsqueeze(0),
                           cu_seqlens=cu, **{k: v.unsqueeze(0) for k, v in mask.items()})
    assert hf.logprobs.shape == (1, sum(LENGTHS))
    torch.testing.assert_close(hf.logprobs[0], out.logprobs, rtol=0, atol=0)


def _packed(**over):
    return {**padded_and_packed(seed=17)[1], "cu_seqlens": cu_of(LENGTHS), **over}


@pytest.mark.parametrize("over,exc,match", [
    (dict(cu_seqlens=cu_of(LENGTHS).float()), TypeError, "cu_seqlens"),
    (dict(cu_seqlens=cu_of(LENGTHS)[None]), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=torch.zeros(1, dtype=torch.long)), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=[0, 5, 19]), TypeError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([1, 5, 5, 8, 15, 19])), ValueError, "cu_seqlens"),   # not 0 first
    (dict(cu_seqlens=torch.tensor([0, 5, 5, 8, 15, 18])), ValueError, "cu_seqlens"),   # not N last
    (dict(cu_seqlens=torch.tensor([0, 5, 4, 8, 15, 19])), ValueError, "cu_seqlens"),   # decreasing
    (dict(cu_seqlens=torch.tensor([0, 5, 5, 8, 15, 19]).to("meta")), ValueError, "cu_seqlens"),
    (dict(hidden=torch.randn(2, 19, 16, dtype=torch.float64)), ValueError, "hidden"),
    (dict(mask=torch.ones(18, dtype=torch.bool)), ValueError, "mask"),
    (dict(advantages=torch.randn(4, dtype=torch.float64)), ValueError, "advantages"),
    (dict(old_logprobs=torch.randn(5, dtype=torch.float64)), ValueError, "old_logprobs"),
    (dict(ref_logprobs=torch.randn(1, 19, dtype=torch.float64)), ValueError, "ref_logprobs"),
    (dict(sampling_ratio=torch.ones(5, 1, dtype=torch.float64)), ValueError, "sampling_ratio"),
    (dict(max_seqlen=6), ValueError, "max_seqlen=6, the longest has 7"),   # LENGTHS' longest: 7
    (dict(max_seqlen=0), ValueError, "max_seqlen"),
    (dict(max_seqlen=7.0), TypeError, "max_seqlen"),
    (dict(max_seqlen=True), TypeError, "max_seqlen"),
    (dict(max_seqlen=torch.tensor(7)), TypeError, "max_seqlen"),
])
def test_errors_name_the_argument(over, exc, match):
    with pytest.raises(exc, match=match):
        cg.grpo_loss(**_packed(**over), config=cg.GRPOConfig(beta=0.04))


def test_max_seqlen_only_with_cu_seqlens():
    pad = padded_and_packed(seed=17)[0]
    with pytest.raises(ValueError, match="max_seqlen bounds the sequences of cu_seqlens"):
        cg.grpo_loss(**pad, max_seqlen=8, config=cg.GRPOConfig(beta=0.04))
    cg.grpo_loss(**_packed(max_seqlen=7), config=cg.GRPOConfig(beta=0.04))   # a bound that holds


def test_token_logprobs_errors():
    p = _packed()
    h, w, ids = p["hidden"], p["weight"], p["token_ids"]
    with pytest.raises(ValueError, match="cu_seqlens"):
        cg.token_logprobs(h, w, ids, cu_seqlens=torch.tensor([0, 3, 18]))
    with pytest.raises(ValueError, match="hidden"):
        cg.token_logprobs(h.reshape(1, 1, 19, 16), w, ids.reshape(1, 1, 19), cu_seqlens=cu_of(LENGTHS))
    with pytest.raises(TypeError, match="cu_seqlens"):
        cg.token_logprobs(h, w, ids, cu_seqlens=cu_of(LENGTHS).double())


def test_cu_seqlens_values_are_checked_under_compile():
    f = torch.compile(cg.grpo_loss, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        f(**_packed(cu_seqlens=torch.tensor([0, 5, 4, 8, 15, 19])))
    with pytest.raises(RuntimeError, match="max_seqlen must bound"):
        f(**_packed(max_seqlen=6))


# Packings for the compile tests: S and N both vary (none 0 or 1: Dynamo specializes those).
PACKINGS = [(3, 0, 4), (2, 5, 1, 3), (6, 2), (1, 4, 2, 3, 5, 2), (4, 4, 4)]
TOL = {"eager": (1e-5, 1e-6), "aot_eager": (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}


def _device_inputs(lengths, seed, device="cpu"):
    pad, packed = padded_and_packed(lengths, seed=seed, fully_masked=(1,))
    out = {k: (v.detach().float() if v.is_floating_point() else v).to(device) for k, v in packed.items()}
    out["hidden"].requires_grad_()
    out["weight"].requires_grad_()
    out["cu_seqlens"] = cu_of(lengths, torch.int32).to(device)
    for k in ("hidden", "token_ids", "mask", "old_logprobs", "ref_logprobs", "advantages", "cu_seqlens"):
        torch._dynamo.mark_dynamic(out[k], 0)
    return out


CONFIGS = {
    "grpo_sequence": cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                                   entropy_coef=0.01, metrics=("with_entropy", "test_packed_min_ratio")),
    "dr_grpo": cg.GRPOConfig(loss_type="dr_grpo", max_completion_length=8, metrics="basic"),
    # Inductor: the per-segment sums and broadcasts without the metrics' extra kernels (compile time)
    "grpo_sequence_lean": cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
}


@pytest.mark.parametrize("backend,name", [("eager", "grpo_sequence"), ("aot_eager", "grpo_sequence"),
                                          ("aot_eager", "dr_grpo"), ("inductor", "grpo_sequence_lean")])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_once_for_many_packings(backend, name, device):
    cfg = CONFIGS[name]
    packings = PACKINGS if backend != "inductor" else PACKINGS[:3]
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(packings):
        inp = _device_inputs(lengths, seed=i, device=device)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(**inp, config=cfg)
        ref = cg.grpo_loss(**inp, config=cfg)
        rtol, atol = TOL[backend]
        for field in ("loss", "per_token_loss", "logprobs", "entropy"):
            if getattr(ref, field) is not None:
                torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=rtol, atol=atol)
        for a, e in zip(*(o.metrics or () for o in (out, ref))):
            for x, y in zip(*(list(m.values()) if isinstance(m, dict) else [m] for m in (a, e))):
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        params = (inp["hidden"], inp["weight"])
        for ga, ge in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref.loss, params)):
            torch.testing.assert_close(ga, ge, rtol=rtol, atol=atol)
    assert cnt.frame_count == 1


def test_compile_once_for_many_packings_whole_sequence_blocks():
    """GSPO in the fused mode on packed inputs (max_seqlen = 6 bounds every packing; whole
    sequences first-fit decreasing into 16-row blocks, 2 of them here): one graph for every packing, N and S
    dynamic, the recompute path's values. The block count stays within one step of
    fused/plan.COMPILED_BLOCKS (3-4 sequences of 17-18 tokens: min(cdiv(S, 16 // 6), 2 cdiv(N, 16) - 1)
    = 2 blocks); crossing one recompiles, as for padded whole-row blocks. CPU: on CUDA with torch
    2.11, "auto" recomputes compiled sequence-coupled losses (fused._guard_location_bug)."""
    cfg = cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                        gradient_mode="fused", fused_workspace_mib=16 * 64 * 4 / 2**20)
    rec = dataclasses.replace(cfg, gradient_mode="recompute")
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(functools.partial(cg.grpo_loss, max_seqlen=6), backend=cnt, fullgraph=True)
    for i, lengths in enumerate([(6, 5, 6), (5, 6, 4, 3), (6, 0, 6, 6), (6, 1, 6, 5)]):
        inp = _device_inputs(lengths, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(**inp, config=cfg)
        ref = cg.grpo_loss(**inp, config=rec)
        rtol, atol = TOL["inductor"]
        torch.testing.assert_close(out.loss, ref.loss, rtol=rtol, atol=atol)
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=rtol, atol=atol)
        params = (inp["hidden"], inp["weight"])
        for ga, ge in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref.loss, params)):
            torch.testing.assert_close(ga, ge, rtol=rtol, atol=atol)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_compile_once_for_many_packings(device):
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(cg.token_logprobs, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(PACKINGS):
        inp = _device_inputs(lengths, seed=i, device=device)
        args = (inp["hidden"], inp["weight"], inp["token_ids"])
        kw = dict(mask=inp["mask"], cu_seqlens=inp["cu_seqlens"], with_entropy=True)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(*args, **kw)
            ref = cg.token_logprobs(*args, **kw)
        torch.testing.assert_close(out.logprobs, ref.logprobs)
        torch.testing.assert_close(out.entropy, ref.entropy)
    assert cnt.frame_count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the op's row-masked Triton path)")
@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence"), ("dr_grpo", "sequence")])
def test_cuda_float32_equals_padded(loss_type, level):
    pad, packed = padded_and_packed(seed=21)
    moved = []
    for d in (pad, packed):
        out = {k: (v.detach().float() if v.is_floating_point() else v).cuda() for k, v in d.items()}
        out["hidden"].requires_grad_()
        out["weight"].requires_grad_()
        moved.append(out)
    pad, packed = moved
    cfg = cg.GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=8,
                        metrics="with_entropy")
    a = cg.grpo_loss(**packed, cu_seqlens=cu_of(LENGTHS).cuda(), config=cfg)
    e = cg.grpo_loss(**pad, config=cfg)
    assert_same(a, e, LENGTHS, rtol=1e-5, atol=1e-6)
    gh, gw = torch.autograd.grad(a.loss, (packed["hidden"], packed["weight"]))
    rh, rw = torch.autograd.grad(e.loss, (pad["hidden"], pad["weight"]))
    torch.testing.assert_close(gh, pack(rh, LENGTHS), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (host syncs are a CUDA notion)")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_step_has_no_host_sync(compiled):
    """A whole grpo_loss fwd+bwd step, padded and packed, under set_sync_debug_mode("error"):
    the row-masked op, the segment reductions and the device-side argument checks never wait
    on the GPU (issue: real batches)."""
    pad, packed = padded_and_packed(seed=22)
    cfg = cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                        metrics="with_entropy")
    fn = torch.compile(cg.grpo_loss, fullgraph=True) if compiled else cg.grpo_loss
    for d, extra in ((pad, {}), (packed, {"cu_seqlens": cu_of(LENGTHS).cuda()})):
        x = {k: (v.detach().float() if v.is_floating_point() else v).cuda() for k, v in d.items()}
        x["hidden"].requires_grad_()
        x["weight"].requires_grad_()
        fn(**x, **extra, config=cfg).loss.backward()        # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(**x, **extra, config=cfg).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_segments_sum_and_broadcast_are_each_others_gradient():
    """Segments.sum (torch.segment_reduce) and .broadcast (index_select) through their autograd
    Functions: fp64 gradcheck and gradgradcheck (a zero-length sequence included), the ids-only
    form (offsets by searchsorted) equal to the cu_seqlens one, and torch.func.grad of them
    under torch.compile(fullgraph=True, dynamic=True) equal to eager."""
    cu = torch.tensor([0, 3, 3, 7, 10])
    seg = cg.segments_from_cu_seqlens(cu, 10)
    bare = cg.Segments(seg.ids, seg.num_sequences)
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)

    def f(x, s=seg):
        return (s.broadcast(torch.exp(s.sum(x) / 3)) * x).sum()

    assert torch.autograd.gradcheck(f, (x,)) and torch.autograd.gradgradcheck(f, (x,))
    torch.testing.assert_close(torch.func.grad(f)(x.detach(), bare), torch.func.grad(f)(x.detach()),
                               rtol=0, atol=0)
    torch.testing.assert_close(seg.sum(x.detach())[1], torch.zeros((), dtype=torch.float64))
    compiled = torch.compile(torch.func.grad(f), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x.detach()), torch.func.grad(f)(x.detach()))
