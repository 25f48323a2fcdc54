"""The pass skips the rows no mask selects (lowerings/naive_fusion/rows.py) and forms each block's
gradient from its own rows (local_grad.py). Skipped rows are proven by garbage there: nan hidden
states at masked rows (and old log-probs of -1e4, whose ratio exp(0 - old) overflows) never reach
the compiled loss or gradients, which equal eager's on the same batch with those rows cleaned.
Where a log-prob value is read or returned at rows no mask selects, every row is computed (the
reason counted) and the result equals eager's on the batch as it is.

Legend: B sequences, T tokens; batch() and the losses from test_naive_fusion_fused_grad.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from naive_fusion_harness import fusion_on  # noqa: F401 (autouse: the pass on, caches off)
from test_naive_fusion_fused_grad import (assert_same, batch, cross_entropy_sum, dapo,
                                          grpo_seq_mean, logprobs, run)


def pg_only(h, w, b, ids, mask, adv, old, ref):
    """A clipped policy-gradient term alone: a sequence of advantage 0 adds nothing."""
    lp = logprobs(h, w, b, ids)
    coef = torch.exp(lp - old)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.28) * adv[:, None])
    return (per_token * mask).sum() / mask.sum()


def dapo_with_metrics(h, w, b, ids, mask, adv, old, ref):
    """DAPO's loss and, as TRL logs them, masked means of the log-probs and of the ratio."""
    lp = logprobs(h, w, b, ids)
    m = mask.float()
    coef = torch.exp(lp - old)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.28) * adv[:, None])
    with torch.no_grad():
        mean_lp = (lp * m).sum() / m.sum()
        ratio = torch.where(mask, coef, 0.0).sum() / m.sum()
    return (per_token * m).sum() / m.sum(), mean_lp, ratio


def _garbage(args, rows):
    """nan hidden states (and old log-probs of -1e4) where ``rows`` [B, T] holds."""
    h, w, b, ids, mask, adv, old, ref = args
    bad = h.detach().masked_fill(rows[..., None], float("nan")).requires_grad_()
    return (bad, w, b, ids, mask, adv, old.masked_fill(rows, -1e4), ref)


def _run_pair(fn, clean, dirty):
    """(eager on the clean batch, compiled on the dirty one, float64 on the clean one)."""
    want, _, gold, _ = run(fn, clean)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    params = [t for t in dirty[:3] if t is not None]
    out = compiled(*dirty)
    loss = out[0] if isinstance(out, tuple) else out
    return want, (loss, torch.autograd.grad(loss, params)), gold, out


@pytest.mark.parametrize("fn", [dapo, grpo_seq_mean, cross_entropy_sum, dapo_with_metrics],
                         ids=["dapo", "grpo-seq-mean-entropy", "cross-entropy-sum", "dapo-metrics"])
def test_masked_rows_are_skipped(fn):
    """Garbage at the masked rows: the compiled loss, gradients and metrics equal eager's on the
    clean batch; counted "masked" and "local"."""
    clean = batch(bias=fn is cross_entropy_sum)
    dirty = _garbage(clean, ~clean[4])
    clean = (clean[0].detach().masked_fill(~clean[4][..., None], 0.0).requires_grad_(), *clean[1:])
    want, got, gold, out = _run_pair(fn, clean, dirty)
    assert dict(counters["compiled_grpo_rows"]) == {"masked": 1}
    assert dict(counters["compiled_grpo_block_gradient"]) == {"local": 1}
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
    assert_same(want, got, gold)
    if isinstance(out, tuple):   # the metrics: masked means, equal to eager's on the clean rows
        torch.testing.assert_close(torch.stack(out[1:]), torch.stack(fn(*clean)[1:]).detach())


def test_rows_of_zero_advantage_are_skipped():
    """A product by the advantages is a mask too: a sequence of advantage 0 is not computed when
    the loss has no other term of it (its hidden states nan here)."""
    clean = batch()
    adv = clean[5].clone()
    adv[0] = 0.0
    clean = (*clean[:5], adv, *clean[6:])
    skip = ~clean[4]
    skip[0] = True
    dirty = _garbage(clean, skip)
    clean = (clean[0].detach().masked_fill(skip[..., None], 0.0).requires_grad_(), *clean[1:])
    want, got, gold, _ = _run_pair(pg_only, clean, dirty)
    assert counters["compiled_grpo_rows"]["masked"] == 1
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
    assert_same(want, got, gold)


def returns_detached_logprobs(h, w, b, ids, mask, adv, old, ref):
    lp = logprobs(h, w, b, ids)
    return (lp * mask).sum() / mask.sum(), lp.detach()


def reads_before_the_mask(h, w, b, ids, mask, adv, old, ref):
    lp = logprobs(h, w, b, ids)
    return (lp * mask).sum() / mask.sum(), lp.detach().mean()


def shifted(h, w, b, ids, mask, adv, old, ref):
    lp = logprobs(h, w, b, ids)
    return (lp[:, 1:] * mask[:, 1:]).sum() / mask.sum()


@pytest.mark.parametrize("fn,rows,grad", [(returns_detached_logprobs, "returned", "local"),
                                          (reads_before_the_mask, "read", "local"),
                                          (shifted, "read", "placed")],
                         ids=["returned", "read", "slice"])
def test_rows_not_proven_unused_are_computed(fn, rows, grad):
    """Log-probs returned, or reduced, before any mask: every row computed (counted), the outputs
    equal eager's; a slice of them: the block's values placed among all N (counted "placed")."""
    args = batch()
    want, got, gold, _ = run(fn, args)
    assert dict(counters["compiled_grpo_rows"]) == {rows: 1}
    assert dict(counters["compiled_grpo_block_gradient"]) == {grad: 1}
    assert counters["compiled_grpo_gradient"]["fused"] == 1
    assert_same(want, got, gold)
    out, ref = torch.compile(fn, fullgraph=True)(*args), fn(*args)
    torch.testing.assert_close(out[1] if isinstance(out, tuple) else out,
                               (ref[1] if isinstance(ref, tuple) else ref).detach())
