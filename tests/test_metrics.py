"""Metrics against a hand computation over valid tokens; the @metric registry."""
import math

import pytest
import torch

import compiled_grpo as cg
from helpers import make_inputs


def _valid(inp):
    B, T = inp["mask"].shape
    return [(i, t) for i in range(B) for t in range(T) if inp["mask"][i, t]]


@pytest.mark.parametrize("level", ("token", "sequence"))
def test_basic_and_entropy_metrics_by_hand(level):
    inp = make_inputs(seed=11, spread=0.4)
    cfg = cg.GRPOConfig(beta=0.04, metrics="with_entropy", importance_sampling_level=level)
    out = cg.grpo_loss(**inp, config=cfg)
    m = out.metrics
    p, q, r, a = out.logprobs, inp["old_logprobs"], inp["ref_logprobs"], inp["advantages"]
    valid = _valid(inp)
    n = len(valid)
    rho = {k: math.exp(p[k] - q[k]) for k in valid}
    if level == "token":
        coef = rho
    else:
        seq = {i: sum(p[k] - q[k] for k in valid if k[0] == i) / sum(1 for k in valid if k[0] == i) for i in range(3)}
        coef = {k: math.exp(seq[k[0]]) for k in valid}
    if level == "token":
        low = sum(1 for k in valid if coef[k] < 0.8 and a[k[0]] < 0) / n
        high = sum(1 for k in valid if coef[k] > 1.2 and a[k[0]] > 0) / n
    else:   # TRL 1.16: one flag per sequence, averaged over the B sequences
        low = sum(1 for i in range(3) if math.exp(seq[i]) < 0.8 and a[i] < 0) / 3
        high = sum(1 for i in range(3) if math.exp(seq[i]) > 1.2 and a[i] > 0) / 3
    kl = {k: math.exp(r[k] - p[k]) - (r[k] - p[k]) - 1 for k in valid}
    logits = inp["hidden"].detach() @ inp["weight"].detach().T
    ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    expected = dict(
        old_logprobs=sum(q[k] for k in valid) / n,
        ratio_new_old=sum(rho.values()) / n,
        ratio_new_old_sum=sum(rho.values()),
        ratio_new_old_squared_sum=sum(v * v for v in rho.values()),
        kl_new_old=sum(rho[k] - math.log(rho[k]) - 1 for k in valid) / n,
        clipped_ratio_fraction=sum(1 for k in valid if not 0.8 <= coef[k] <= 1.2) / n,
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio=low + high,
        advantage=sum(a[k[0]] for k in valid) / n,
        max_advantage=max(a[k[0]] for k in valid), min_advantage=min(a[k[0]] for k in valid),
        num_tokens=n, kl_ref=sum(kl.values()) / n, entropy=sum(ent[k] for k in valid) / n,
    )
    for name, value in expected.items():
        got = getattr(m, name)
        assert got.dim() == 0 and not got.requires_grad, name
        assert got.item() == pytest.approx(float(value), rel=1e-9, abs=1e-12), name
    assert m.custom == {}


def test_metric_fields_absent_unless_requested():
    inp = make_inputs(seed=12)
    assert cg.grpo_loss(**inp).metrics is None
    basic = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics="basic")).metrics
    assert basic.entropy is None and basic.kl_ref is None and basic.num_tokens is not None
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics="basic"))
    assert out.entropy is None  # no entropy pass unless asked


def test_registered_metric_runs_only_when_requested():
    calls = []

    @cg.metric("test_mean_abs_log_ratio")
    def mean_abs_log_ratio(stats: cg.TokenStats):
        calls.append(1)
        return (stats.log_ratio.abs() * stats.mask).sum() / stats.mask.sum()

    inp = make_inputs(seed=13)
    cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics="basic"))
    assert calls == []
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics=("test_mean_abs_log_ratio",)))
    assert calls == [1]
    assert out.metrics.num_tokens is None  # only the custom metric was asked for
    expected = ((out.logprobs - inp["old_logprobs"]).abs() * inp["mask"]).sum() / inp["mask"].sum()
    torch.testing.assert_close(out.metrics.custom["test_mean_abs_log_ratio"], expected)
    both = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics=("basic", "test_mean_abs_log_ratio")))
    assert both.metrics.num_tokens is not None and "test_mean_abs_log_ratio" in both.metrics.custom


def test_liger_clip_ratio_equals_low_plus_high_and_metrics_detached():
    inp = make_inputs(seed=14, spread=0.6)
    out = cg.grpo_loss(**inp, config=cg.GRPOConfig(metrics="basic"))
    m = out.metrics
    assert m.clip_ratio.item() == pytest.approx(m.clip_ratio_low.item() + m.clip_ratio_high.item())
    assert all(not v.requires_grad for v in m if isinstance(v, torch.Tensor))
