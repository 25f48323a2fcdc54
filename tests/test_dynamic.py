"""Dynamic shapes and recompiles of `torch.compile(grpo_loss, fullgraph=True)`.

How a trainer should call it (research/inductor-apis.md §5): mark the varying dims dynamic on
every input that has them, before the first call; V and H stay static (they are the model's).

    for t in (hidden, token_ids, mask, old_logprobs, ref_logprobs):   # [B, T(, H)]
        torch._dynamo.mark_dynamic(t, 1)        # T; also dim 0 when B varies
    out = compiled_loss(hidden, weight, token_ids, ..., config=cfg)

Sizes 0 and 1 are always specialized by Dynamo (0/1 specialization), so the tests avoid them.

What is asserted:
- one frame serves ten sequence lengths (and ten (B, T) pairs) with no recompile after the first
  call (`error_on_recompile=True`), forward values and gradients equal to eager at every size;
- a distinct metrics request is a distinct graph: N distinct configs give exactly N frames,
  re-running them with *new but equal* GRPOConfig objects gives none (the guards are on the
  config's field values, not its identity);
- new data values of the same shapes never recompile;
- `num_items_in_batch` as a 0-dim tensor never recompiles when its value changes; as a Python
  int it recompiles exactly once, on the second value, into a dynamic int.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_grpo as cg
from helpers import DEVICES, make_inputs

H, V = 16, 37
LENGTHS = [2, 3, 4, 6, 7, 9, 11, 13, 16, 20]                      # ten T, none 0 or 1
BATCH_AND_LENGTHS = [(2, 2), (3, 3), (4, 5), (5, 7), (2, 9), (6, 4), (3, 11), (7, 2), (4, 13), (2, 20)]


@cg.metric("test_dynamic_ratio_max")
def _ratio_max(stats: cg.TokenStats) -> torch.Tensor:
    return torch.where(stats.mask, stats.ratio, 0).amax()


def _inputs(B, T, device, seed=0, adv_2d=False, sampling_ratio=False):
    out = make_inputs(B=B, T=T, H=H, V=V, seed=seed, adv_2d=adv_2d, device=device)
    if sampling_ratio:
        out["sampling_ratio"] = (0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(seed))).to(device)
    return out


def _mark_dynamic(inp, batch=False):
    """mark_dynamic on the T dim of every [B, T(, ...)] input (and on B when batch=True)."""
    for name, x in inp.items():
        if name == "weight":
            continue                                   # [V, H]: static
        if x.dim() >= 2 and x.shape[1] > 1:            # [B, 1] sampling ratio has no T dim
            torch._dynamo.mark_dynamic(x, 1)
        if batch:
            torch._dynamo.mark_dynamic(x, 0)


def _check_against_eager(out, inp, cfg, rtol, atol):
    ref = cg.grpo_loss(**inp, config=cfg)
    for name in ("loss", "per_token_loss", "logprobs", "entropy"):
        a, e = getattr(out, name), getattr(ref, name)
        if e is not None:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    params = (inp["hidden"], inp["weight"])
    for ga, ge in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref.loss, params)):
        torch.testing.assert_close(ga, ge, rtol=rtol, atol=atol)


TOL = {"aot_eager": (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}
CONFIGS = {
    "dapo": (cg.GRPOConfig(), {}),
    "grpo_sequence_beta_entropy": (cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                                                 metrics=("with_entropy", "test_dynamic_ratio_max"),
                                                 entropy_coef=0.01), {"adv_2d": True}),
    "dr_grpo_sampling_ratio": (cg.GRPOConfig(loss_type="dr_grpo", max_completion_length=32, metrics="basic"),
                               {"sampling_ratio": True}),
}


def _run_sizes(backend, cfg, sizes, device, batch, **input_kwargs):
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    for i, (b, t) in enumerate(sizes):
        inp = _inputs(b, t, device, seed=i, **input_kwargs)
        _mark_dynamic(inp, batch=batch)
        if i == 0:
            out = compiled(**inp, config=cfg)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = compiled(**inp, config=cfg)
        _check_against_eager(out, inp, cfg, *TOL[backend])
    assert cnt.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ten_sequence_lengths_one_frame(name, device):
    cfg, input_kwargs = CONFIGS[name]
    _run_sizes("aot_eager", cfg, [(3, t) for t in LENGTHS], device, batch=False, **input_kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_ten_batch_and_sequence_sizes_one_frame(backend, device):
    cfg, input_kwargs = CONFIGS["grpo_sequence_beta_entropy"]
    _run_sizes(backend, cfg, BATCH_AND_LENGTHS, device, batch=True, **input_kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_metrics_requests_compile_once_each_and_values_never_recompile(device):
    # Each distinct metrics request traces a different graph: one frame per request (they share
    # Dynamo's recompile_limit, 8 by default). Fresh but equal configs and new data reuse them.
    requests = ["none", "basic", "with_entropy", ("basic", "test_dynamic_ratio_max"), "test_dynamic_ratio_max"]
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    for n, metrics in enumerate(requests, start=1):
        compiled(**_inputs(3, 5, device), config=cg.GRPOConfig(metrics=metrics))
        assert cnt.frame_count == n, metrics
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 3):
            for metrics in requests:
                cfg = cg.GRPOConfig(metrics=metrics)              # a new object, equal fields
                inp = _inputs(3, 5, device, seed=seed)
                out = compiled(**inp, config=cfg)
                ref = cg.grpo_loss(**inp, config=cfg)
                torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
                if cfg.metrics:
                    for name, value in ref.metrics._asdict().items():
                        got = getattr(out.metrics, name)
                        if name == "custom":
                            assert got.keys() == value.keys()
                            got, value = list(got.values()), list(value.values())
                        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)
    assert cnt.frame_count == len(requests)


@pytest.mark.parametrize("device", DEVICES)
def test_num_items_in_batch_tensor_value_change_never_recompiles(device):
    # The documented way to pass a global token count that changes every step: a 0-dim tensor
    # (its value is data; only None -> tensor, dtype or device changes would recompile).
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    cfg = cg.GRPOConfig()
    inp = _inputs(3, 5, device)
    for i, n in enumerate([5, 9, 13, 40, 1000]):
        items = torch.tensor(n, device=device)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(**inp, num_items_in_batch=items, config=cfg)
        torch.testing.assert_close(out.loss, cg.grpo_loss(**inp, num_items_in_batch=items, config=cfg).loss)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_num_items_in_batch_int_recompiles_once_into_a_dynamic_int(device):
    # A Python int is specialized on the first call (a static constant in the graph); a second
    # value makes Dynamo's automatic dynamic retrace it as a SymInt, and every later value reuses
    # that frame. (Before 7da810f, aggregate's torch.as_tensor(int) specialized the SymInt again, so
    # each new value recompiled until recompile_limit, a hard error under fullgraph=True.)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(cg.grpo_loss, backend=cnt, fullgraph=True)
    cfg = cg.GRPOConfig()
    inp = _inputs(3, 5, device)
    for i, n in enumerate([5, 9, 13, 40, 1000, 7, 3, 21, 64, 100]):  # more values than recompile_limit (8)
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            out = compiled(**inp, num_items_in_batch=n, config=cfg)
        torch.testing.assert_close(out.loss, cg.grpo_loss(**inp, num_items_in_batch=n, config=cfg).loss)
        assert cnt.frame_count == min(i + 1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_true_symbolic_scalars_one_frame(device):
    """torch.compile(dynamic=True) hands Python float arguments in as SymFloats: the argument
    checks of temperature / logit_scale / final_logit_softcapping take them without a graph break
    (fullgraph=True compiles), and values and gradients equal eager."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, H, generator=g).to(device).requires_grad_()
    w = torch.randn(V, H, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, V, (2, 8), generator=g).to(device)
    mask = (torch.rand(2, 8, generator=g) > 0.3).to(device)

    def f(h, w, temperature, scale, cap):
        out = cg.token_logprobs(h, w, ids, mask=mask, temperature=temperature, logit_scale=scale,
                                final_logit_softcapping=cap)
        return out.logprobs.sum()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for args in ((0.7, 0.5, 3.0), (1.3, 2.0, 5.0)):
        got = compiled(h, w, *args)
        gh, gw = torch.autograd.grad(got, (h, w))
        want = f(h, w, *args)
        eh, ew = torch.autograd.grad(want, (h, w))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gh, eh)
        torch.testing.assert_close(gw, ew)
