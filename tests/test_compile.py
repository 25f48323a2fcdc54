"""Graph-break tests: `grpo_loss` and `token_logprobs` under `torch.compile(fullgraph=True)`.

Climbs the compile ladder (STYLE.md item 7): every configuration of the matrix compiles as ONE
frame under backend "eager" (Dynamo tracing only) and "aot_eager" (plus AOTAutograd: the joint
graph, functionalization, the triton_op decomposed), and a representative subset under
"inductor". Forward values (loss, per-token loss, log-probs, entropy, every metric) and the
gradients w.r.t. hidden, weight and bias equal the eager call.

Shapes are tiny (B=2, T=5, H=16, V=37): these tests are about graphs, not numerics
(tests/test_loss_golden.py owns numerics). Runs on CPU, and on CUDA too when one is present
(there the op launches its Triton kernels through `launch.declared`: custom ops with declared writes).
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_grpo as cg
from helpers import DEVICES, make_inputs

B, T, H, V = 2, 5, 16, 37


@cg.metric("test_compile_max_abs_log_ratio")
def _max_abs_log_ratio(stats: cg.TokenStats) -> torch.Tensor:
    return torch.where(stats.mask, stats.log_ratio.abs(), 0).amax()


# name -> (GRPOConfig kwargs, extra grpo_loss kwargs builder). Covers every loss type, token and
# sequence IS, beta with each KL estimator and the bias correction, delta, each metrics level, a
# registered metric, entropy_coef, bias, both sampling-ratio shapes, num_items_in_batch (int and
# tensor), temperature, disabled clamps and grad_divisor.
def _bias(dev):
    return {"bias": (0.1 * torch.randn(V, generator=torch.Generator().manual_seed(5))).to(dev).requires_grad_()}


def _sampling_ratio(shape):
    def make(dev):
        g = torch.Generator().manual_seed(6)
        return {"sampling_ratio": (0.5 + torch.rand(*shape, generator=g)).to(dev)}
    return make


def _sampling_logps(dev):
    g = torch.Generator().manual_seed(7)
    return {"sampling_per_token_logps": (-2.0 + 0.5 * torch.randn(B, T, generator=g)).to(dev)}


CONFIGS = {
    "dapo": ({}, None),
    "grpo": ({"loss_type": "grpo"}, None),
    "bnpo": ({"loss_type": "bnpo"}, None),
    "dr_grpo": ({"loss_type": "dr_grpo", "max_completion_length": 8}, None),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, None),
    "sapo": ({"loss_type": "sapo"}, None),
    "luspo": ({"loss_type": "luspo"}, None),
    "grpo_sequence_is": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, None),
    "dapo_sequence_is_adv2d": ({"importance_sampling_level": "sequence"}, "adv_2d"),
    "beta_k3": ({"beta": 0.04}, None),
    "beta_k1": ({"beta": 0.04, "kl_estimator": "k1"}, None),
    "beta_k2_bias_correction": ({"beta": 0.04, "kl_estimator": "k2", "use_bias_correction_kl": True}, None),
    "delta": ({"delta": 1.5, "epsilon_high": 0.28}, None),
    "metrics_basic": ({"metrics": "basic"}, None),
    "metrics_with_entropy_beta": ({"metrics": "with_entropy", "beta": 0.04}, None),
    "registered_metric": ({"metrics": "test_compile_max_abs_log_ratio"}, None),
    "basic_and_registered_metric": ({"metrics": ("basic", "test_compile_max_abs_log_ratio")}, None),
    "entropy_coef": ({"entropy_coef": 0.01}, None),
    "bias": ({}, _bias),
    "sampling_ratio_bt": ({}, _sampling_ratio((B, T))),
    "sampling_ratio_b1": ({"loss_type": "grpo"}, _sampling_ratio((B, 1))),
    "num_items_int": ({}, lambda dev: {"num_items_in_batch": 17}),
    "num_items_tensor": ({"loss_type": "cispo", "epsilon_high": 5.0},
                         lambda dev: {"num_items_in_batch": torch.tensor(17, device=dev)}),
    "temperature_no_clamps": ({"temperature": 0.7, "log_ratio_clamp": None, "kl_input_clamp": None,
                               "kl_output_clamp": None, "beta": 0.04}, None),
    "grad_divisor": ({"grad_divisor": 64.0}, None),
    # TRL 1.16 options: the sampler's log-probs, sequence / token IS weights, masks, vespo, and the
    # top-entropy threshold (sort + gather on a masked tensor: no host sync, no data-dependent shape)
    "trl_is_opsm_top_entropy": ({"loss_type": "grpo", "off_policy_mask_threshold": 0.05, "top_entropy_quantile": 0.3,
                                 "entropy_coef": 0.01, "metrics": "basic"}, _sampling_logps),
    "trl_vespo_token_is": ({"loss_type": "vespo", "vllm_importance_sampling_mode": "token_mask",
                            "metrics": "basic"}, _sampling_logps),
    "everything": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04, "delta": 1.5,
                    "use_bias_correction_kl": True, "entropy_coef": 0.01,
                    "metrics": ("with_entropy", "test_compile_max_abs_log_ratio")}, _bias),
}
# The inductor rung: a representative subset (each Inductor compile costs seconds on CPU).
INDUCTOR_CONFIGS = ["dapo", "everything", "cispo", "trl_is_opsm_top_entropy"]


def _inputs(device, extra=None, seed=0):
    out = make_inputs(B=B, T=T, H=H, V=V, seed=seed, adv_2d=extra == "adv_2d", device=device)
    if callable(extra):
        out.update(extra(device))
    return out


def _leaves(out: cg.GRPOOutput) -> dict:
    """Every tensor the loss returns, by name (metrics flattened, custom metrics included)."""
    leaves = {"loss": out.loss, "per_token_loss": out.per_token_loss, "logprobs": out.logprobs,
              "entropy": out.entropy}
    if out.metrics is not None:
        for name, value in out.metrics._asdict().items():
            if name == "custom":
                leaves.update({f"custom.{k}": v for k, v in value.items()})
            else:
                leaves[f"metrics.{name}"] = value
    return leaves


def _grads(out, inp):
    params = [inp["hidden"], inp["weight"]] + ([inp["bias"]] if "bias" in inp else [])
    return torch.autograd.grad(out.loss, params)


def _assert_same(actual: cg.GRPOOutput, expected: cg.GRPOOutput, inp, rtol, atol):
    a, e = _leaves(actual), _leaves(expected)
    assert a.keys() == e.keys()
    for name in e:
        if e[name] is None:
            assert a[name] is None, name
        else:
            torch.testing.assert_close(a[name], e[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    for i, (ga, ge) in enumerate(zip(_grads(actual, inp), _grads(expected, inp))):
        torch.testing.assert_close(ga, ge, rtol=rtol, atol=atol, msg=lambda m: f"grad {i}: {m}")


# Tolerances: "eager" replays the captured ops one by one (bitwise, up to op order); AOT may
# reorder reductions; Inductor fuses and reorders them (fp32 on tiny shapes: ~1e-6 relative).
TOL = {"eager": (1e-6, 1e-6), "aot_eager": (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}


def _check_one_frame(backend, name, device):
    torch._dynamo.reset()
    cfg_kwargs, extra = CONFIGS[name]
    cfg = cg.GRPOConfig(**cfg_kwargs)
    inp = _inputs(device, extra)
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    got = compiled(**inp, config=cfg)
    assert cnt.frame_count == 1, f"{name}: {cnt.frame_count} frames"
    _assert_same(got, cg.grpo_loss(**inp, config=cfg), inp, *TOL[backend])
    # A second call with new values of the same shapes reuses the frame.
    inp2 = _inputs(device, extra, seed=1)
    _assert_same(compiled(**inp2, config=cfg), cg.grpo_loss(**inp2, config=cfg), inp2, *TOL[backend])
    assert cnt.frame_count == 1, f"{name}: recompiled on new values"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_grpo_loss_fullgraph_one_frame(backend, name, device):
    _check_one_frame(backend, name, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", INDUCTOR_CONFIGS)
def test_grpo_loss_fullgraph_inductor(name, device):
    _check_one_frame("inductor", name, device)


@pytest.mark.parametrize("device", DEVICES)
def test_explain_reports_no_break_reasons(device):
    # explain's graph_break_count can read 0 after a break (research/inductor-apis.md §4): assert
    # on break_reasons.
    torch._dynamo.reset()
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, metrics=("with_entropy", "test_compile_max_abs_log_ratio"),
                        entropy_coef=0.01)
    inp = _inputs(device, _bias)
    ex = torch._dynamo.explain(cg.grpo_loss)(**inp, config=cfg)
    assert ex.break_reasons == []
    assert ex.graph_count == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("kwargs", [{}, {"with_entropy": True, "temperature": 0.7}], ids=["plain", "entropy_temp"])
def test_token_logprobs_no_grad_fullgraph(kwargs, backend, device):
    """Old/ref log-probs come from the same op under no_grad: one frame, values equal eager.

    (Each kwargs set gets its own compile: a second Python-float temperature on the same compiled
    function makes Dynamo try a dynamic SymFloat, fail the tensorify pass and restart with the
    float specialized, which CompileCounter counts as extra frames. grpo_loss never sees this:
    its temperature is a field of the frozen config.)"""
    torch._dynamo.reset()
    inp = _inputs(device)
    bias = _bias(device)["bias"].detach()
    h, w, ids, mask = inp["hidden"].detach(), inp["weight"].detach(), inp["token_ids"], inp["mask"]
    ids = torch.where(mask, ids, -100)  # padding ids at masked positions are allowed
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(cg.token_logprobs, backend=cnt, fullgraph=True)
    rtol, atol = TOL[backend]
    with torch.no_grad():
        got = compiled(h, w, ids, bias, mask=mask, **kwargs)
        want = cg.token_logprobs(h, w, ids, bias, mask=mask, **kwargs)
    assert cnt.frame_count == 1
    for field in ("logprobs", "entropy", "lse"):
        a, e = getattr(got, field), getattr(want, field)
        assert (a is None) == (e is None), field
        if e is not None:
            assert not a.requires_grad
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


# Configs one step function meets in turn (a sweep, a schedule, two trainers' settings): each
# changes number fields the one before it held. On a recompile Dynamo makes a changed float or
# int symbolic (automatic dynamic scalars); the fused path needs some of them as constants (the
# workspace rows, the per-block gradient graph's key) and specializes them (device.static_value).
SWEEP = [dict(entropy_coef=0.01), dict(entropy_coef=0.0), dict(entropy_coef=0.02, beta=0.1),
         dict(epsilon_high=0.3, fused_workspace_mib=0.001, max_completion_length=9, temperature=0.7),
         dict(temperature=0.9, max_completion_length=11), dict(entropy_coef=0.01)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_one_step_function_across_changing_configs(mode, device):
    """One compiled step (the same code object: the trainer's) called with configs whose number
    fields change between calls compiles (fullgraph) and equals eager every time (torch 2.11-2.13
    raised inside Dynamo on the second config in fused mode: the per-block gradient's key read a
    symbolic entropy_coef)."""
    torch._dynamo.reset()
    inp = _inputs(device, {})
    cnt = CompileCounterWithBackend("aot_eager")
    frames = []
    for kw in SWEEP:
        cfg = cg.GRPOConfig(**{"loss_type": "dapo", "gradient_mode": mode, "metrics": "with_entropy",
                               "beta": 0.04, **kw})
        step = torch.compile(lambda **a: cg.grpo_loss(**a, config=cfg), backend=cnt, fullgraph=True)  # noqa: B023
        _assert_same(step(**inp), cg.grpo_loss(**inp, config=cfg), inp, *TOL["aot_eager"])
        frames.append(cnt.frame_count)
    # Two frames a config at most (Dynamo's automatic-dynamic compile, then the specialized one);
    # the first config again reuses what it compiled.
    assert frames[-2] <= 2 * (len(SWEEP) - 1) and frames[-1] == frames[-2], frames


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_scales_saved_grads_in_place(device):
    """Compiled (Inductor), the backward scales the stored d_hidden and d_weight in place and
    returns them: no clone and no g * dX / g * dW buffer in the generated code
    (steps.scale_saved_grads and its Inductor lowering), the gradients of (c * loss) equal eager's for c = 1 and 0.37, and a
    second backward through the graph still fails autograd's version check."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused")
    inp = make_inputs(B=4, T=9, seed=13, device=device)
    torch._dynamo.reset()
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, fullgraph=True, dynamic=False)
    for c in (1.0, 0.37):
        got, want = ({k: (v.detach().clone().requires_grad_() if k in ("hidden", "weight") else v)
                      for k, v in inp.items()} for _ in range(2))
        with inductor_config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):   # this run's own code
            loss = fn(**got)
            _, code = run_and_get_code(lambda: (c * loss).backward())
        (c * cg.grpo_loss(**want, config=cfg).loss).backward()
        for k in ("hidden", "weight"):
            torch.testing.assert_close(got[k].grad, want[k].grad, rtol=1e-5, atol=1e-7)
        if c == 1.0:   # the first backward compiled the graph: its code
            code = "\n".join(code)
            # scale_grads_ on the saved d_hidden and d_weight themselves (Inductor's lowering of
            # scale_saved_grads), both returned: no clone, no g * dX or g * dW kernel
            call = code[code.index("scale_grads_.default(["):]
            scaled = call[len("scale_grads_.default(["):call.index("]")].split(", ")
            ret = code[code.rindex("return ("):].split("\n")[0]
            assert len(scaled) == 2 and all(f"{t}," in ret for t in scaled), (scaled, ret)
            assert "clone" not in code and "triton_" not in code and "cpp_fused" not in code
    loss = fn(**inp)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_in_place_scale_is_ordered_before_other_readers_of_the_head_gradient(device):
    """Two losses on one head and an L2 term of W in one compiled graph, the sum scaled by 0.5:
    W's gradient sums both saved d_weights (each scaled in place by its backward) and the L2
    term's; the lowering's declared write orders that sum after the scales (Inductor could
    otherwise run it first, on unscaled gradients). Equal to eager's."""
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused")
    a, b = make_inputs(B=4, T=9, seed=13, device=device), make_inputs(B=4, T=9, seed=14, device=device)
    w0 = a["weight"].detach().clone()

    def two(ha, hb, w):
        la = cg.grpo_loss(**dict(a, hidden=ha, weight=w), config=cfg).loss
        lb = cg.grpo_loss(**dict(b, hidden=hb, weight=w), config=cfg).loss
        return (la + lb) * 0.5 + 0.01 * (w.float() ** 2).sum()

    def grads(f):
        ha, hb = (x["hidden"].detach().clone().requires_grad_() for x in (a, b))
        w = w0.clone().requires_grad_()
        f(ha, hb, w).backward()
        return w.grad, ha.grad, hb.grad

    torch._dynamo.reset()
    for got, want in zip(grads(torch.compile(two, fullgraph=True)), grads(two)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainable", ["hidden", "weight"])
def test_compiled_fused_backward_with_a_frozen_head_or_trunk(trainable, device):
    """Only hidden (a frozen lm_head: no saved d_weight for the in-place scale) or only the head
    (a frozen trunk: no d_hidden to carry steps.scale_saved_grads, out of place) trainable,
    compiled by Inductor, the loss scaled by 0.5: the gradient equals eager's."""
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="fused")
    inp = make_inputs(B=4, T=9, seed=13, device=device)
    torch._dynamo.reset()
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, fullgraph=True)
    got, want = ({k: (v.detach().clone().requires_grad_(k == trainable) if k in ("hidden", "weight") else v)
                  for k, v in inp.items()} for _ in range(2))
    (0.5 * fn(**got)).backward()
    (0.5 * cg.grpo_loss(**want, config=cfg).loss).backward()
    torch.testing.assert_close(got[trainable].grad, want[trainable].grad, rtol=1e-5, atol=1e-7)
