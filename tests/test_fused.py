"""grpo_loss's fused-gradient mode (compiled_grpo/fused.py) against the recompute path.

The loss value is computed by the same code in both modes, so it is compared for equality; the
gradients come from per-block torch.func.grad of the same loss functions in fused mode and from
autograd through the recompute op otherwise: float64 agreement to rounding over every loss type,
IS level, KL, entropy bonus, sampling ratio, normalizer, bias, and packed inputs, with several
row blocks (a tiny fused_workspace_mib). Plus: gradcheck of the fused gradient against finite
differences, bf16 numerics against the float64 reference, determinism, the TRL options' mode
selection, and torch.compile(fullgraph=True) with dynamic shapes. Which mode "auto" picks, the
errors of "fused", and the block plan: tests/test_fused_modes.py; sequence-coupled losses on
packed inputs (max_seqlen): tests/test_fused_packed.py.
"""
import functools
import itertools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_grpo as cg
from compiled_grpo import fused as F
from compiled_grpo import fused_grads as FG
from fused_cases import H, V, _assert_same, _mib, _option_inputs, _packed, _pair, _run
from helpers import make_inputs

CASES = [dict(loss_type=lt, importance_sampling_level=lvl) for lt, lvl in itertools.product(
    ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"), ("token", "sequence"))
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['loss_type']}-{c['importance_sampling_level']}")
@pytest.mark.parametrize("extras", ["plain", "kl_entropy", "everything"])
def test_fused_equals_recompute_float64(case, extras):
    """B=5, T=9 (45 rows): 16-row blocks (token level: 3 blocks; GSPO: blocks of 1 whole row)."""
    inp = make_inputs(B=5, T=9, H=H, V=V, seed=1)
    kw = dict(case, max_completion_length=9)
    call = {}
    bias = None
    if extras in ("kl_entropy", "everything"):
        kw.update(beta=0.04, entropy_coef=0.01, kl_estimator="k3", metrics="with_entropy")
    if extras == "everything":
        kw.update(use_bias_correction_kl=True, delta=1.5, grad_divisor=7.0 if case["loss_type"] != "dapo" else None,
                  temperature=0.8, logit_scale=1.3, final_logit_softcapping=4.0, kl_estimator="k2")
        g = torch.Generator().manual_seed(3)
        call = dict(sampling_ratio=0.5 + torch.rand(5, 9, generator=g, dtype=torch.float64), num_items_in_batch=17)
        bias = torch.randn(V, generator=g, dtype=torch.float64)
    inp.update(call)
    rec, fus = _pair(inp, bias, **kw)
    _assert_same(rec, fus)
    if extras != "plain":   # metrics are computed from the same detached tensors
        for k, v in rec[0].metrics._asdict().items():
            if torch.is_tensor(v):
                torch.testing.assert_close(getattr(fus[0].metrics, k), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("old", [True, False])
def test_fused_packed_equals_padded(loss_type, old):
    """Packed token-level inputs (cu_seqlens) in fused mode: the padded layout's loss and grads."""
    B, T = 4, 8
    inp = make_inputs(B=B, T=T, H=H, V=V, seed=2)
    if not old:
        inp["old_logprobs"] = None
    cfg = cg.GRPOConfig(loss_type=loss_type, beta=0.04, max_completion_length=T, fused_workspace_mib=_mib(16),
                        gradient_mode="fused", entropy_coef=0.02)
    pad, pad_g = _run(inp, cfg)
    lengths = torch.tensor([8, 3, 6, 1])
    keep = torch.arange(T)[None, :] < lengths[:, None]                     # [B, T] the packed tokens
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    inp_pad = dict(inp, mask=inp["mask"] & keep)
    pad, pad_g = _run(inp_pad, cfg)
    packed = {k: (v[keep] if torch.is_tensor(v) and v.dim() >= 2 else v) for k, v in inp_pad.items()
              if k not in ("weight", "advantages")}
    packed.update(weight=inp["weight"], advantages=inp["advantages"])
    packed["hidden"] = inp["hidden"].detach()[keep]
    out, grads = _run(packed, cfg, cu_seqlens=cu)
    torch.testing.assert_close(out.loss, pad.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[0], pad_g[0][keep], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], pad_g[1], rtol=1e-10, atol=1e-12)


def test_gradcheck_fused_loss():
    """The attached gradients are the loss value's derivatives (finite differences, float64)."""
    inp = make_inputs(B=3, T=5, H=6, V=11, seed=4)
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, entropy_coef=0.05, gradient_mode="fused",
                        fused_workspace_mib=8 * 11 * 8 / 2**20, log_ratio_clamp=None)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)

    def f(h, w, b):
        return cg.grpo_loss(**dict(inp, hidden=h, weight=w), bias=b, config=cfg).loss

    h = inp["hidden"].detach().clone().requires_grad_()
    w = inp["weight"].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (h, w, bias), eps=1e-6, atol=1e-7)


def test_bf16_within_twice_eager_error():
    """bf16 inputs: fused-mode gradients against the float64 reference no worse than 2x the
    recompute path's (on CPU both compute in fp32)."""
    inp64 = make_inputs(B=4, T=16, H=32, V=101, seed=5)
    inp16 = {k: (v.detach().to(torch.bfloat16) if k in ("hidden", "weight") else v) for k, v in inp64.items()}
    inp64 = {k: (v.detach().to(torch.bfloat16).double() if k in ("hidden", "weight") else v) for k, v in inp64.items()}
    kw = dict(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    (_, g64), = [_run(inp64, cg.GRPOConfig(gradient_mode="recompute", **kw))]
    rec, fus = _pair(inp16, **kw)
    for i in range(2):
        err_r = (rec[1][i].double() - g64[i]).norm() / g64[i].norm()
        err_f = (fus[1][i].double() - g64[i]).norm() / g64[i].norm()
        assert err_f <= 2 * err_r + 1e-6, (i, err_f, err_r)


def test_deterministic():
    inp = make_inputs(B=4, T=9, seed=6)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused", fused_workspace_mib=_mib(16))
    a, b = _run(inp, cfg), _run(inp, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_outputs_detached_in_fused_mode():
    inp = make_inputs(seed=7)
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(beta=0.04, entropy_coef=0.01, gradient_mode="fused"))
    assert out.loss.requires_grad
    assert not out.per_token_loss.requires_grad and not out.logprobs.requires_grad
    assert not out.entropy.requires_grad
    rec = cg.grpo_loss(**inp, config=cg.GRPOConfig(beta=0.04, entropy_coef=0.01, gradient_mode="recompute"))
    assert rec.per_token_loss.requires_grad and rec.entropy.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compile_fullgraph_dynamic(level):
    """Fused mode under torch.compile(fullgraph=True): one frame for several T (mark_dynamic),
    no recompile, loss and grads equal to eager."""
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, entropy_coef=0.01, importance_sampling_level=level,
                        gradient_mode="fused", fused_workspace_mib=_mib(64))
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend=cnt, fullgraph=True)
    for i, T in enumerate((9, 12, 15)):
        inp = make_inputs(B=4, T=T, H=H, V=V, seed=10 + i, device="cpu")
        for k in ("hidden", "token_ids", "mask", "old_logprobs", "ref_logprobs"):
            torch._dynamo.mark_dynamic(inp[k], 1)
        ctx = torch._dynamo.config.patch(error_on_recompile=True) if i else torch._dynamo.config.patch()
        with ctx:
            loss = fn(**inp)
        loss.backward()
        ref_inp = {k: (v.detach().clone().requires_grad_() if k in ("hidden", "weight") else v) for k, v in inp.items()}
        ref = cg.grpo_loss(**ref_inp, config=cfg).loss
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(inp["hidden"].grad, ref_inp["hidden"].grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(inp["weight"].grad, ref_inp["weight"].grad, rtol=1e-4, atol=1e-6)
    assert cnt.frame_count == 1


# --- TRL 1.16 options ------------------------------------------------------------------------------
# (config, pass the sampler's log-probs, pass old log-probs). vespo, the off-policy mask and a
# sequence_* weight with old_logprobs=None read whole sequences of current log-probs (blocks of
# whole rows); the weight from old and sampler log-probs is formed once before the blocks.
OPTION_CASES = {
    "vespo": (dict(loss_type="vespo"), False, True),
    "vespo_token_is_kl": (dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask",
                               vllm_importance_sampling_clip_min=0.7, vllm_importance_sampling_clip_max=1.4,
                               beta=0.04, use_bias_correction_kl=True), True, True),
    "opsm_sampler": (dict(off_policy_mask_threshold=0.02, vllm_importance_sampling_correction=False), True, True),
    "opsm_old_grpo": (dict(loss_type="grpo", off_policy_mask_threshold=0.0, entropy_coef=0.01), False, True),
    "is_token_truncate": (dict(vllm_importance_sampling_mode="token_truncate",
                               vllm_importance_sampling_clip_min=0.9), True, True),
    "is_sequence_mask_opsm": (dict(vllm_importance_sampling_clip_max=2.0, off_policy_mask_threshold=0.05),
                              True, True),
    "is_sequence_truncate_onpolicy": (dict(vllm_importance_sampling_mode="sequence_truncate"), True, False),
    "is_token_mask_onpolicy_bnpo": (dict(loss_type="bnpo", vllm_importance_sampling_mode="token_mask",
                                         vllm_importance_sampling_clip_max=1.3), True, False),
}


@pytest.mark.parametrize("name", OPTION_CASES)
def test_fused_equals_recompute_trl_options(name):
    """float64, 16-row blocks (coupled options: blocks of one whole row): same loss, grads, metrics."""
    kw, with_samp, with_old = OPTION_CASES[name]
    inp = _option_inputs(with_samp, with_old)
    rec, fus = _pair(inp, metrics="with_entropy", **kw)
    _assert_same(rec, fus)
    for k, v in rec[0].metrics._asdict().items():
        if torch.is_tensor(v):
            torch.testing.assert_close(getattr(fus[0].metrics, k), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [*OPTION_CASES, "top_entropy"])
def test_trl_options_packed_equal_padded(name):
    """Every new option on cu_seqlens inputs gives the padded layout's loss, grads and metrics
    (sequence-level quantities through Segments); "auto" picks recompute where fused is not exact."""
    kw, with_samp, with_old = OPTION_CASES.get(name, (dict(top_entropy_quantile=0.3, entropy_coef=0.05), True, True))
    inp = _option_inputs(with_samp, with_old, B=4, T=8, seed=13)
    pad, packed, cu, keep = _packed(inp, [8, 3, 6, 0])
    cfg = cg.GRPOConfig(metrics="with_entropy", fused_workspace_mib=_mib(16), **kw)
    p_out, p_g = _run(pad, cfg)
    out, grads = _run(packed, cfg, cu_seqlens=cu)
    torch.testing.assert_close(out.loss, p_out.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[0], p_g[0][keep], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], p_g[1], rtol=1e-10, atol=1e-12)
    for k, v in p_out.metrics._asdict().items():
        if torch.is_tensor(v):
            torch.testing.assert_close(getattr(out.metrics, k), v, rtol=1e-12, atol=1e-12, msg=k)


def test_trl_options_fused_mode_selection():
    """top_entropy_quantile < 1 is never fused; sequence-coupled options on packed inputs neither."""
    inp = _option_inputs(True, True, B=3, T=5)
    why = F.why_not_fused(inp["hidden"], inp["weight"], cg.GRPOConfig(top_entropy_quantile=0.2), None, None)
    assert "top_entropy_quantile" in why
    with pytest.raises(ValueError, match="gradient_mode='fused'.*top_entropy_quantile"):
        cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused", top_entropy_quantile=0.2))
    _, packed, cu, _ = _packed(inp, [5, 2, 4])
    for kw in (dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask"), dict(off_policy_mask_threshold=0.1)):
        with pytest.raises(ValueError, match="gradient_mode='fused'.*packed"):
            cg.grpo_loss(**packed, cu_seqlens=cu, config=cg.GRPOConfig(gradient_mode="fused", **kw))
    # the sampler weight from given old log-probs is inputs-only: packed sequence_* modes stay fused
    assert F.why_not_fused(packed["hidden"], inp["weight"], cg.GRPOConfig(), object(), None,
                           packed["old_logprobs"], packed["sampling_per_token_logps"]) is None
    assert "sequence_" in F.why_not_fused(packed["hidden"], inp["weight"], cg.GRPOConfig(), object(), None,
                                          None, packed["sampling_per_token_logps"])


def test_second_backward_is_an_error():
    """The stored gradients are scaled in place by the first backward: a second backward through
    the same graph must fail loudly, never reuse them."""
    inp = make_inputs(seed=12, device="cpu")      # float32 (float64 scales out of place)
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused"))
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


def test_second_backward_is_an_error_when_the_scaling_is_invisible_to_autograd(monkeypatch):
    """The same when the in-place scaling is a write autograd cannot see (the CUDA body's Triton
    kernel; here a .data multiply): the scaling runs as a mutating custom op
    (compiled_grpo::scale_grads_), whose call bumps the gradients' version counters."""
    from lowerings.linear_logprobs.fused import steps as lf

    def invisible(tensors, g):
        for t in tensors:
            t.data.mul_(g)
    monkeypatch.setattr(lf, "scale_", invisible)
    inp = make_inputs(seed=12, device="cpu")
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused"))
    (2.0 * out.loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


def test_compile_static_shapes():
    """dynamic=False: every size a plain int (block bounds too), still one graph."""
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused", fused_workspace_mib=_mib(16))
    inp = make_inputs(B=4, T=9, H=H, V=V, seed=13, device="cpu")
    cnt = CompileCounterWithBackend("inductor")
    loss = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend=cnt, fullgraph=True,
                         dynamic=False)(**inp)
    loss.backward()
    ref_inp = {k: (v.detach().clone().requires_grad_() if k in ("hidden", "weight") else v) for k, v in inp.items()}
    cg.grpo_loss(**ref_inp, config=cfg).loss.backward()
    torch.testing.assert_close(inp["weight"].grad, ref_inp["weight"].grad, rtol=1e-4, atol=1e-6)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_eager_compiled_block_grads(level, monkeypatch):
    """Eager calls on CUDA run the per-block gradient compiled (dynamic): same float64 result as
    the eager torch.func path, one graph for every block and a second batch size, token-level
    and whole-sequence (GSPO) blocks alike."""
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: True)
    monkeypatch.setattr(FG, "AT_LIMIT", False)   # an earlier test may have met the recompile limit
    FG.compiled_block_grads.cache_clear()
    torch._dynamo.reset()
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, entropy_coef=0.01, importance_sampling_level=level,
                        gradient_mode="fused", fused_workspace_mib=_mib(16))
    cnt = CompileCounterWithBackend("eager")
    monkeypatch.setattr(FG, "compiled_block_grads",
                        functools.lru_cache(None)(lambda: torch.compile(FG.block_grads, dynamic=True,
                                                                        fullgraph=True, backend=cnt)))
    for B, T in ((5, 9), (7, 9)):
        inp = make_inputs(B=B, T=T, H=H, V=V, seed=14)
        fast = _run(inp, cfg)
        monkeypatch.setattr(FG, "BLOCK_GRADS_COMPILED", False)
        slow = _run(inp, cfg)
        monkeypatch.setattr(FG, "BLOCK_GRADS_COMPILED", True)
        _assert_same(slow, fast)
    assert cnt.frame_count == 1, cnt.frame_count


def test_eager_block_grads_past_the_recompile_limit(monkeypatch):
    """One compiled block-gradient graph per config: a process with more configs than Dynamo's
    recompile limit (2 here, 8 by default) gets the eager gradient for the later ones (with one
    warning) where fullgraph=True would raise FailOnRecompileLimitHit, and the configs compiled
    before keep their graphs. Values equal the eager torch.func path's throughout."""
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: True)
    monkeypatch.setattr(FG, "AT_LIMIT", False)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    monkeypatch.setattr(FG, "compiled_block_grads",
                        functools.lru_cache(None)(lambda: torch.compile(FG.block_grads, dynamic=True,
                                                                        fullgraph=True, backend=cnt)))
    inp = make_inputs(B=5, T=9, H=H, V=V, seed=15)
    cfgs = [cg.GRPOConfig(loss_type="grpo", beta=beta, gradient_mode="fused", fused_workspace_mib=_mib(16))
            for beta in (0.01, 0.02, 0.03, 0.04)]
    with torch._dynamo.config.patch(recompile_limit=2):
        for i, cfg in enumerate(cfgs + cfgs[:1]):
            if i == 2:
                with pytest.warns(UserWarning, match="recompile_limit"):
                    fast = _run(inp, cfg)
            else:
                fast = _run(inp, cfg)
            monkeypatch.setattr(FG, "BLOCK_GRADS_COMPILED", False)
            slow = _run(inp, cfg)
            monkeypatch.setattr(FG, "BLOCK_GRADS_COMPILED", True)
            _assert_same(slow, fast)
    assert FG.AT_LIMIT and cnt.frame_count == 2, cnt.frame_count


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_nan_at_masked_positions_never_reach_fused_grads(level):
    """NaN old/ref log-probs, a NaN advantage of a fully masked row and inf sampling ratios at
    masked positions: the fused loss and gradients stay finite and equal the recompute ones."""
    inp = make_inputs(B=4, T=6, seed=3)
    m = inp["mask"]
    m[3] = False
    for k in ("old_logprobs", "ref_logprobs"):
        inp[k] = torch.where(m, inp[k], float("nan"))
    inp["advantages"] = inp["advantages"].clone()
    inp["advantages"][3] = float("nan")
    inp["sampling_ratio"] = torch.where(m, torch.rand(4, 6, dtype=torch.float64) + 0.5, float("inf"))
    rec, fus = _pair(inp, loss_type="grpo", beta=0.04, entropy_coef=0.01, importance_sampling_level=level,
                     metrics="with_entropy", fused_workspace_mib=_mib(12))
    assert torch.isfinite(fus[0].loss) and all(torch.isfinite(g).all() for g in fus[1])
    _assert_same(rec, fus)
