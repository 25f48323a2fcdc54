"""The per-block loss gradient inside a trace (compiled_grpo/fused_grads.py): the per-token
inputs gathered into the blocks' order once (fused/schedule.py's on_order) and, for token-level blocks,
one aten graph traced once and run by the custom op compiled_grpo::block_grads.
"""
import json

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

import compiled_grpo as cg
from compiled_grpo import fused_grads as FG
from fused_cases import H, V, _mib, _run
from helpers import make_inputs


@pytest.mark.parametrize("grouped", [False, True])
def test_block_grads_on_inputs_gathered_once_equal_the_per_block_gather(grouped):
    """A trace's per-block gradient reads slices of the per-token inputs gathered into the blocks'
    order once (fused/schedule.py's on_order: block_loss with idx None); an eager call gathers each block's
    rows itself (idx). Bitwise the same gradients, for token-level and whole-sequence blocks."""
    g = torch.Generator().manual_seed(3)
    n, blocks, rows = 23, 3, 8                                     # G R = 24 slots >= N
    perm = torch.randperm(n, generator=g)
    perm = torch.cat([perm, perm.new_zeros(blocks * rows - n)])    # [G R], as order_rows pads
    per_tok = dict(old=-torch.rand(n, generator=g, dtype=torch.float64) * 3,
                   valid=torch.rand(n, generator=g) > 0.3, adv=torch.randn(n, generator=g, dtype=torch.float64),
                   sr=None, ref=-torch.rand(n, generator=g, dtype=torch.float64) * 3,
                   agg_w=torch.rand(n, generator=g, dtype=torch.float64),
                   ent_w=torch.rand(n, generator=g, dtype=torch.float64), samp=None)
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, entropy_coef=0.01,
                        importance_sampling_level="sequence" if grouped else "token")
    seg_ids = torch.arange(n) // 5                                  # 5 sequences
    counts = torch.tensor([8, 6, 7])
    ordered = {k: None if t is None else t.index_select(0, perm) for k, t in per_tok.items()}
    for b in range(blocks):
        r0 = b * rows
        idx = perm.narrow(0, r0, rows)
        lp = -torch.rand(rows, generator=g, dtype=torch.float64) * 4
        ent = torch.rand(rows, generator=g, dtype=torch.float64)
        each = FG.block_grads(lp, ent, idx, r0, per_tok, cfg,
                              (seg_ids, 5, counts, rows) if grouped else None)
        once = FG.block_grads(lp, ent, None, r0, ordered, cfg,
                              (seg_ids.index_select(0, perm), 5, counts, rows) if grouped else None)
        for a, c in zip(each, once):
            assert torch.equal(a, c), (b, a, c)
        assert each[0].abs().sum() > 0


def test_compiled_token_blocks_run_one_traced_graph():
    """In a trace, every token-level block's gradient is the same aten graph, traced once (make_fx
    when Dynamo asks _graph_key) and run by compiled_grpo::block_grads: G op calls, one trace,
    gradients equal to eager to rounding. A process whose graph registry lacks the key (a graph
    compiled before, its key not traced here) traces it at the op's first run instead, inside the
    compiled graph: same gradients."""
    cfg = cg.GRPOConfig(loss_type="grpo", beta=0.04, entropy_coef=0.01, gradient_mode="fused",
                        fused_workspace_mib=_mib(16))
    inp = make_inputs(B=5, T=9, H=H, V=V, seed=21)                  # N = 45: 3 blocks of 16 rows
    FG._block_graph.cache_clear()
    FG._block_fn.cache_clear()
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend=cnt, fullgraph=True,
                       dynamic=False)
    ref, ref_grads = _run(inp, cfg)
    for rerun in (False, True):
        if rerun:
            FG._block_graph.cache_clear()
            FG._block_fn.cache_clear()
        leaves = {k: inp[k].detach().clone().requires_grad_() for k in ("hidden", "weight")}
        loss = fn(**dict(inp, **leaves))
        loss.backward()
        torch.testing.assert_close(loss, ref.loss, rtol=1e-12, atol=1e-14)
        for k, g in zip(("hidden", "weight"), ref_grads):
            torch.testing.assert_close(leaves[k].grad, g, rtol=1e-10, atol=1e-12)
        assert FG._block_graph.cache_info().misses == 1
    ops = [nd for nd in cnt.graphs[0].graph.nodes if nd.target is torch.ops.compiled_grpo.block_grads.default]
    assert len(ops) == 3, len(ops)
    assert cnt.frame_count == 1


def test_block_graph_key_round_trips_the_config():
    """_graph_key's json gives the config back field for field (a dtype, a tuple, None, floats)."""
    cfg = cg.GRPOConfig(loss_type="dr_grpo", lm_head_dtype=torch.float32, metrics=("basic",),
                        log_ratio_clamp=None, epsilon_high=0.28, max_completion_length=7)
    key = FG._graph_key(tuple(getattr(cfg, n) for n in FG._FIELDS), 8, "torch.float64",
                        ("torch.float64", "torch.bool", "torch.float64", "", "", "torch.float64", "", ""), "cpu")
    assert FG._config(json.loads(key)[0]) == cfg


@pytest.mark.parametrize("cfg", [
    cg.GRPOConfig(loss_type="dapo", beta=0.04),
    cg.GRPOConfig(loss_type="grpo", beta=0.04, kl_estimator="k2", entropy_coef=0.01, delta=4.0),
    cg.GRPOConfig(loss_type="cispo", epsilon_high=5.0, vllm_importance_sampling_mode="token_truncate"),
    cg.GRPOConfig(loss_type="sapo"),
], ids=["dapo-k3", "grpo-k2-entropy-delta", "cispo-sampling", "sapo"])
def test_block_graph_is_functional_smaller_and_bitwise_the_eager_gradient(cfg):
    """The block graph is functionalized, then dead and repeated ops go (fewer kernel launches a
    block): no in-place op is left, it has fewer ops than make_fx's raw trace, and it gives
    bitwise the eager torch.func gradient, on values that clip, mask and clamp."""
    g = torch.Generator().manual_seed(5)
    rows = 64
    f32 = lambda: torch.randn(rows, generator=g)  # noqa: E731
    per_tok = dict(old=-torch.rand(rows, generator=g) * 3, valid=torch.rand(rows, generator=g) > 0.2,
                   adv=f32(), sr=None, ref=-torch.rand(rows, generator=g) * 3,
                   agg_w=torch.rand(rows, generator=g), ent_w=torch.rand(rows, generator=g) * 0.01,
                   samp=-torch.rand(rows, generator=g) * 3)
    present = {k: v for k, v in per_tok.items() if v is not None}
    dtypes = tuple("" if per_tok[k] is None else str(per_tok[k].dtype) for k in FG.PER_TOKEN)
    key = FG._graph_key(tuple(getattr(cfg, n) for n in FG._FIELDS), rows, "torch.float32", dtypes, "cpu")
    gm = FG._block_graph(key)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in ops if n.target._schema.is_mutable], gm.code

    def raw(lp, ent, *inputs):
        it = iter(inputs)
        return FG.block_grads(lp, ent, None, 0, {k: next(it) if k in present else None
                                                 for k in FG.PER_TOKEN}, cfg)
    traced = make_fx(raw)(*(torch.zeros_like(t) for t in [f32(), f32(), *present.values()]))
    assert len(ops) < sum(1 for n in traced.graph.nodes if n.op == "call_function")
    for _ in range(3):
        lp = -torch.rand(rows, generator=g) * 3 + 0.5 * f32()       # ratios past the clip range
        ent = torch.rand(rows, generator=g) * 2
        want = FG.block_grads(lp, ent, None, 0, per_tok, cfg)
        got = gm(lp, ent, *present.values())
        for a, b in zip(got, want):
            assert torch.equal(a, b), (a - b).abs().max()


def test_op_runs_the_inductor_compiled_block_graph(monkeypatch):
    """On COMPILE_BLOCK_GRAPH_ON's devices (CUDA; CPU forced here) the op runs the block graph
    compiled by Inductor once per key (one or two kernels a block instead of ~70 launches): the
    same gradients as the fx graph to rounding, outputs that never alias the op's inputs (dL/dent
    is the entropy weights' slice in the graph), and one compile for repeated calls."""
    monkeypatch.setattr(FG, "COMPILE_BLOCK_GRAPH_ON", ("cuda", "cpu"))
    FG._block_fn.cache_clear()
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    g = torch.Generator().manual_seed(9)
    rows = 32
    per_tok = dict(old=-torch.rand(rows, generator=g) * 3, valid=torch.rand(rows, generator=g) > 0.2,
                   adv=torch.randn(rows, generator=g), sr=None, ref=-torch.rand(rows, generator=g) * 3,
                   agg_w=torch.rand(rows, generator=g), ent_w=torch.rand(rows, generator=g) * 0.01, samp=None)
    inputs = [t for t in per_tok.values() if t is not None]
    dtypes = tuple("" if per_tok[k] is None else str(per_tok[k].dtype) for k in FG.PER_TOKEN)
    key = FG._graph_key(tuple(getattr(cfg, n) for n in FG._FIELDS), rows, "torch.float32", dtypes, "cpu")
    try:
        for _ in range(2):
            lp = -torch.rand(rows, generator=g) * 3
            ent = torch.rand(rows, generator=g) * 2
            want = FG._block_graph(key)(lp, ent, *inputs)
            got = torch.ops.compiled_grpo.block_grads(lp, ent, inputs, key)
            ptrs = {t.untyped_storage().data_ptr() for t in (lp, ent, *inputs)}
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
                assert a.untyped_storage().data_ptr() not in ptrs
        assert FG._block_fn.cache_info().misses == 1
        assert not isinstance(FG._block_fn(key), torch.fx.GraphModule)
    finally:
        FG._block_fn.cache_clear()
