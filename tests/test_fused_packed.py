"""grpo_loss's fused-gradient mode on packed inputs with losses that couple a sequence's tokens
(GSPO, vespo, the off-policy mask, a sequence_* IS weight without old log-probs): whole
sequences first-fit decreasing into row blocks (lowerings' fused_order.pack_sequences, order_rows_grouped),
against the recompute path in float64, the mode selection, and torch.compile(fullgraph=True). The plan and
the Triton block steps on it: tests/test_fused_interpret.py; dynamic N and S:
tests/test_packed.py; hypothesis against the reference: tests/test_properties.py."""
import dataclasses
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compiled_grpo as cg
from compiled_grpo import fused as F
from fused_cases import _assert_same, _mib, _option_inputs, _packed, _run

# --- packed whole sequences (max_seqlen) ----------------------------------------------------------
# Sequence-coupled losses on cu_seqlens inputs: whole sequences packed first-fit decreasing, by their valid
# tokens, into blocks of R rows (lowerings' pack_sequences, order_rows_grouped). Sequences of 9,
# 3, 6, 0, 5, 8, 2 tokens (one empty, masked tokens inside them): 16-row blocks launch the bound
# min(cdiv(7, 16 // 9), 2 cdiv(33, 16) - 1) = 5 blocks (the later ones stay empty), 32-row blocks
# min(cdiv(7, 3), 3) = 3 (more than k = 3 sequences fit one), 64 rows one.
_SEQ_LENGTHS = [9, 3, 6, 0, 5, 8, 2]
PACKED_SEQ_CASES = {
    "gspo_grpo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "gspo_dapo_entropy": dict(loss_type="dapo", importance_sampling_level="sequence", entropy_coef=0.01),
    "gspo_dr_grpo_delta": dict(loss_type="dr_grpo", importance_sampling_level="sequence", delta=1.5,
                               max_completion_length=9),
    "vespo": dict(loss_type="vespo"),
    "opsm_sampler": dict(off_policy_mask_threshold=0.02, vllm_importance_sampling_correction=False),
    "is_sequence_onpolicy": dict(vllm_importance_sampling_mode="sequence_truncate"),
}


def _packed_seq_inputs(name, seed=21):
    with_samp = name in ("opsm_sampler", "is_sequence_onpolicy")
    inp = _option_inputs(with_samp, name != "is_sequence_onpolicy", B=7, T=9, seed=seed)
    _, packed, cu, _ = _packed(inp, _SEQ_LENGTHS)
    return packed, cu


@pytest.mark.parametrize("name", PACKED_SEQ_CASES)
@pytest.mark.parametrize("rows,blocks", [(16, 5), (32, 3), (64, 1)])
def test_packed_sequence_losses_fused(name, rows, blocks, monkeypatch):
    """float64: fused on packed whole-sequence blocks = the recompute path (loss, log-probs,
    grads, metrics), with the grouped plan of `blocks` blocks actually taken."""
    plans = []
    real = F._op.order_rows_grouped
    monkeypatch.setattr(F._op, "order_rows_grouped", lambda *a: plans.append(a[2]) or real(*a))
    packed, cu = _packed_seq_inputs(name)
    kw = dict(PACKED_SEQ_CASES[name], metrics="with_entropy", fused_workspace_mib=_mib(rows))
    rec = _run(packed, cg.GRPOConfig(gradient_mode="recompute", **kw), cu_seqlens=cu)
    fus = _run(packed, cg.GRPOConfig(gradient_mode="fused", **kw), cu_seqlens=cu, max_seqlen=9)
    assert plans == [blocks]
    _assert_same(rec, fus)
    for k, v in rec[0].metrics._asdict().items():
        if torch.is_tensor(v):
            torch.testing.assert_close(getattr(fus[0].metrics, k), v, rtol=1e-12, atol=1e-12, msg=k)


def _next_fit(lengths, rows):
    out, b, fill = [], 0, 0
    for n in lengths:
        if fill + n > rows:
            b, fill = b + 1, 0
        fill += n
        out.append(b)
    return out


def _first_fit_decreasing(lengths, rows):
    out, fill = [0] * len(lengths), []
    for s in sorted(range(len(lengths)), key=lambda i: -lengths[i]):   # stable, longest first
        b = next((j for j, f in enumerate(fill) if f + lengths[s] <= rows), len(fill))
        fill += [0] * (b == len(fill))
        fill[b] += lengths[s]
        out[s] = b
    return out


def _random_packings(seed, cases=200):
    import random
    rng = random.Random(seed)
    for _ in range(cases):
        bound = rng.randint(1, 50)
        rows = rng.randint(bound, 120)
        lengths = [rng.choice([0, rng.randint(0, bound)]) for _ in range(rng.randint(1, 40))]
        yield lengths, rows, bound


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("packer,reference", [("next_fit_sequences", _next_fit),
                                              ("pack_sequences", _first_fit_decreasing)])
def test_packers_match_their_sequential_rule(monkeypatch, seed, packer, reference):
    """next_fit_sequences (pointer doubling on the device) = a sequential next-fit, and
    pack_sequences (a device sort, then the first_fit_blocks op) = a sequential first-fit
    decreasing (stable: equal lengths in order), over 200 random cases a seed, zero-length
    sequences included, within next_fit_blocks' bound (which holds for any first-fit too); the
    same compiled with dynamic shapes (fullgraph: first-fit's loop is an opaque op)."""
    from lowerings.linear_logprobs.fused import order as fused_order
    monkeypatch.setattr(fused_order, "SEQ_PACKING", "ffd")
    fn = getattr(fused_order, packer)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for lengths, rows, bound in _random_packings(seed):
        cu = torch.tensor([0] + lengths).cumsum(0)
        blocks = fused_order.next_fit_blocks(len(lengths), int(cu[-1]), rows, bound)
        want = reference(lengths, rows)
        assert max(want) < blocks
        assert fn(cu, rows, blocks).tolist() == want, (lengths, rows)
    assert compiled(cu.int(), rows, blocks).tolist() == want


def test_packed_sequence_losses_fused_selection():
    """Which packed sequence-coupled calls fuse: with max_seqlen bounding the sequences and
    fitting the workspace. "auto" on CPU recomputes; on CUDA it would fuse (why_not_fused None)."""
    packed, cu = _packed_seq_inputs("gspo_grpo")
    cfg = cg.GRPOConfig(importance_sampling_level="sequence", fused_workspace_mib=_mib(16))
    segs = object()
    why = lambda **kw: F.why_not_fused(packed["hidden"], packed["weight"], cfg, segs, None, **kw)  # noqa: E731
    assert "max_seqlen" in why()
    assert why(max_seqlen=16) is None
    assert "raise fused_workspace_mib" in why(max_seqlen=17)
    with pytest.raises(ValueError, match="gradient_mode='fused'.*pass max_seqlen"):
        cg.grpo_loss(**packed, cu_seqlens=cu, config=dataclasses.replace(cfg, gradient_mode="fused"))
    with pytest.raises(ValueError, match="gradient_mode='fused'.*max_seqlen rows"):
        cg.grpo_loss(**packed, cu_seqlens=cu, max_seqlen=40, config=dataclasses.replace(cfg, gradient_mode="fused"))
    # a bound above the longest sequence is as good (blocks of fewer sequences)
    rec = _run(packed, dataclasses.replace(cfg, gradient_mode="recompute"), cu_seqlens=cu)
    fus = _run(packed, dataclasses.replace(cfg, gradient_mode="fused"), cu_seqlens=cu, max_seqlen=12)
    _assert_same(rec, fus)


def test_packed_sequence_losses_fused_compile():
    """torch.compile(fullgraph=True): one frame, the eager values; new sequence lengths with the
    same N and S reuse the graph (the block plan is read on the device from cu_seqlens)."""
    cfg = cg.GRPOConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                        gradient_mode="fused", fused_workspace_mib=_mib(32))
    packed, cu = _packed_seq_inputs("gspo_grpo")
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(functools.partial(cg.grpo_loss, config=cfg, max_seqlen=9), backend=cnt, fullgraph=True)
    for lengths in (_SEQ_LENGTHS, [2, 9, 8, 5, 0, 6, 3]):
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
        eager = _run(packed, cfg, cu_seqlens=cu, max_seqlen=9)
        leaves = {k: packed[k].detach().clone().requires_grad_() for k in ("hidden", "weight")}
        out = fn(**dict(packed, **leaves), cu_seqlens=cu)
        out.loss.backward()
        _assert_same(eager, (out, (leaves["hidden"].grad, leaves["weight"].grad)))
    assert cnt.frame_count == 1
