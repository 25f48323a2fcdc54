"""grpo_loss's choice between the fused-gradient and recompute modes (compiled_grpo/fused.py):
which mode "auto" picks (CPU, CUDA, tensor-parallel heads, sequence-coupled losses on packed
inputs, a sequence longer than the workspace), the errors of gradient_mode="fused" where it
cannot be exact, and the row-block plan the workspace budget sets."""
import pytest
import torch

import compiled_grpo as cg
from lowerings.linear_logprobs.fused import steps
from compiled_grpo import fused as F
from lowerings.linear_logprobs import device
from helpers import make_inputs

V = 37   # make_inputs' vocabulary


def _mib(rows: int) -> float:
    """fused_workspace_mib holding `rows` float64 rows of V logits and of the CPU body's tiles
    (fused/schedule.ws_row_bytes)."""
    return rows * (V + steps.cpu_tile_cols(V)) * 8 / 2**20


# Tests that make "auto" act as on CUDA (_auto_device_ok) also lift the CPU body's bound on the
# block rows (fused.CPU_BLOCK_ROWS): with the default 768 MiB budget a block of this V = 37
# float64 head holds ~1.5M rows, which the CPU body computes valid or not (40 s a call). A
# 16-row budget keeps the blocks of CPU tensors small; the mode choice does not read it.
SMALL_MIB = _mib(16)


def test_mode_selection(monkeypatch):
    calls = []
    real = F.fused_logprobs
    monkeypatch.setattr(F, "fused_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    inp = make_inputs(B=3, T=5, seed=8)
    cg.grpo_loss(**inp)                                           # auto on CPU: recompute
    assert len(calls) == 0
    cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused"))
    assert len(calls) == 1
    with torch.no_grad():                                         # no gradient: nothing to fuse
        cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused"))
    assert len(calls) == 1
    frozen = dict(inp, hidden=inp["hidden"].detach(), weight=inp["weight"].detach())
    cg.grpo_loss(**frozen)
    assert len(calls) == 1
    # GSPO on packed inputs: auto falls back to recompute, fused says why
    cu = torch.tensor([0, 5, 9, 15])
    packed = {k: (v.detach().reshape(15, -1).squeeze(-1) if k not in ("weight", "advantages") else v)
              for k, v in inp.items()}
    packed["hidden"] = inp["hidden"].detach().reshape(15, -1).requires_grad_()
    seq = dict(importance_sampling_level="sequence")
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: True)   # "auto" as on CUDA
    cg.grpo_loss(**inp, config=cg.GRPOConfig(fused_workspace_mib=SMALL_MIB))
    assert len(calls) == 2
    cg.grpo_loss(**packed, cu_seqlens=cu, config=cg.GRPOConfig(**seq))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="gradient_mode='fused'.*packed"):
        cg.grpo_loss(**packed, cu_seqlens=cu, config=cg.GRPOConfig(gradient_mode="fused", **seq))
    # a sequence longer than the workspace's rows (at least 16): GSPO cannot hold it in one block
    long = make_inputs(B=2, T=20, seed=8)
    cg.grpo_loss(**long, config=cg.GRPOConfig(fused_workspace_mib=1e-6, **seq))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="fused_workspace_mib"):
        cg.grpo_loss(**long, config=cg.GRPOConfig(gradient_mode="fused", fused_workspace_mib=1e-6, **seq))
    with pytest.raises(ValueError, match="gradient_mode"):
        cg.GRPOConfig(gradient_mode="fast")
    with pytest.raises(ValueError, match="fused_workspace_mib"):
        cg.GRPOConfig(fused_workspace_mib=0)


def test_mode_selection_tp(monkeypatch):
    """Vocab-parallel heads: "auto" fuses them as on one GPU (even split / DTensor: global V known
    on every rank); vocab_start's uneven shards leave V unknown: auto recomputes, fused raises."""
    from compiled_grpo.distributed import VocabShard
    inp = make_inputs(B=2, T=4, V=12, seed=8)
    h, w = inp["hidden"], inp["weight"][:6]
    cfg = cg.GRPOConfig(beta=0.04)
    even = VocabShard(w, None, None, 0, 2, 0, 12)
    uneven = even._replace(vocab_size=None)
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: True)   # "auto" as on CUDA
    assert F.use_fused(h, w, None, cfg, None, even)
    assert not F.use_fused(h, w, None, cfg, None, uneven)
    with pytest.raises(ValueError, match="vocab_start"):
        F.use_fused(h, w, None, cg.GRPOConfig(gradient_mode="fused"), None, uneven)
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: False)  # CPU: recompute
    assert not F.use_fused(h, w, None, cfg, None, even)


@pytest.mark.parametrize("mib,blocks", [(640.0, 1), (_mib(16), 3), (_mib(32), 2)])
def test_block_plan(mib, blocks, monkeypatch):
    """The workspace budget sets the block count: N = 45 rows, 16-row granularity."""
    seen = []
    real = F._op.fused_linear_logprobs
    monkeypatch.setattr(F._op, "fused_linear_logprobs",
                        lambda *a, **k: seen.append((k["blocks"], k["block_rows"])) or real(*a, **k))
    inp = make_inputs(B=5, T=9, seed=9)
    cg.grpo_loss(**inp, config=cg.GRPOConfig(fused_workspace_mib=mib, gradient_mode="fused")).loss.backward()
    assert seen[0][0] == blocks and seen[0][0] * seen[0][1] >= 45


def test_block_plan_whole_waves(monkeypatch):
    """With several blocks, block rows are a multiple of the plan's rows (fused.block_align: whole
    dX waves or whole forward waves, CUDA only: faked here as 24 rows) where the budget (32 rows)
    holds them; the result is unchanged."""
    seen = []
    real = F._op.fused_linear_logprobs
    monkeypatch.setattr(F._op, "fused_linear_logprobs",
                        lambda *a, **k: seen.append((k["blocks"], k["block_rows"])) or real(*a, **k))
    inp = make_inputs(B=5, T=9, seed=9)
    cfg = dict(fused_workspace_mib=_mib(40), beta=0.04)
    want = cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="recompute", **cfg)).loss
    monkeypatch.setattr(F._op, "block_align", lambda h, w, budget: 24)
    got = cg.grpo_loss(**inp, config=cg.GRPOConfig(gradient_mode="fused", **cfg)).loss
    assert seen == [(2, 24)]
    torch.testing.assert_close(got, want)


def test_sm_count_is_a_compile_time_constant(monkeypatch):
    """fused.sm_count (wave_rows' SM count) is called, not traced, inside a fullgraph compile."""
    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(device, "_SMS", {})   # sm_count's cache (a GPU run fills it)
    fn = torch.compile(lambda x: x * F._op.sm_count(0), fullgraph=True, backend="eager")
    assert fn(torch.ones(2)).tolist() == [132.0, 132.0]


def test_auto_recomputes_sequence_losses_under_compile_on_torch_with_the_guard_bug(monkeypatch):
    """torch 2.11 cannot print a shape guard without a source location, which the whole-sequence
    fused blocks create under torch.compile on CUDA (fused._guard_location_bug): there "auto"
    recomputes GSPO inside a compiled step; eager GSPO and compiled token-level losses still fuse.
    "fused" asked for explicitly is not overridden."""
    calls = []
    real = F.fused_logprobs
    monkeypatch.setattr(F, "fused_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(F, "_auto_device_ok", lambda t: True)   # "auto" as on CUDA
    monkeypatch.setattr(F, "_GUARD_LOCATION_BUG", True)
    inp = make_inputs(B=3, T=5, seed=8)
    gspo = cg.GRPOConfig(importance_sampling_level="sequence", fused_workspace_mib=SMALL_MIB)
    torch._dynamo.reset()
    compiled = torch.compile(cg.grpo_loss, backend="eager", fullgraph=True)
    want = cg.grpo_loss(**inp, config=gspo).loss        # eager: fused
    assert len(calls) == 1
    got = compiled(**inp, config=gspo).loss             # compiled: recompute
    assert len(calls) == 1
    torch.testing.assert_close(got, want)
    compiled(**inp, config=cg.GRPOConfig(fused_workspace_mib=SMALL_MIB))   # token-level: fused
    assert len(calls) == 2
    compiled(**inp, config=cg.GRPOConfig(importance_sampling_level="sequence", gradient_mode="fused",
                                         fused_workspace_mib=SMALL_MIB))
    assert len(calls) == 3
    monkeypatch.setattr(F, "_GUARD_LOCATION_BUG", False)
    torch._dynamo.reset()
    torch.compile(cg.grpo_loss, backend="eager", fullgraph=True)(**inp, config=gspo)
    assert len(calls) == 4


@pytest.mark.parametrize("dynamic", [False, None, True])
def test_is_static_tells_a_constant_from_a_symbol(dynamic):
    """device.is_static under Dynamo: True for a static size, False for a symbol (dynamic=True, or
    automatic dynamic's second compile), with no guard of its own (one frame under dynamic=True);
    Dynamo answers isinstance(n, int) with True for both."""
    from torch._dynamo.testing import CompileCounter
    cnt = CompileCounter()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + (1 if device.is_static(x.shape[0]) else 2), backend=cnt,
                       fullgraph=True, dynamic=dynamic)
    got = [fn(torch.zeros(n)).tolist()[0] for n in (4, 6, 9)]
    assert got == {False: [1, 1, 1], None: [1, 2, 2], True: [2, 2, 2]}[dynamic]
    assert cnt.frame_count == {False: 3, None: 2, True: 1}[dynamic]
    assert device.is_static(5)


def test_is_static_false_for_a_bounded_dynamic_size():
    """A mark_dynamic range with a max (a symbol whose range is bounded) is still a symbol."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + (1 if device.is_static(x.shape[0]) else 2), backend="eager",
                       fullgraph=True)
    x = torch.zeros(6)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
    assert fn(x).tolist()[0] == 2


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_static_rows_take_eagers_exact_plan(dynamic, monkeypatch):
    """A compile of static shapes runs eager's block plan (N = 80 rows of 16: 5 blocks, the
    exact count), a symbolic N a step of COMPILED_BLOCKS (6): compiling costs no empty blocks
    where the sizes are known (issue 65's 'compiling never costs time'); loss and grads equal
    eager's either way."""
    seen = []
    real = F._op.fused_linear_logprobs
    monkeypatch.setattr(F._op, "fused_linear_logprobs",
                        lambda *a, **k: seen.append(k["blocks"]) or real(*a, **k))
    cfg = cg.GRPOConfig(beta=0.04, gradient_mode="fused", fused_workspace_mib=_mib(16))
    inp = make_inputs(B=2, T=40, seed=4)
    torch._dynamo.reset()
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend="aot_eager",
                       fullgraph=True, dynamic=dynamic)
    loss = fn(**inp)
    ref = cg.grpo_loss(**inp, config=cfg).loss
    assert seen == [6 if dynamic else 5, 5]
    params = (inp["hidden"], inp["weight"])
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b)


def test_compiled_block_counts_step_so_dynamic_sizes_rarely_recompile():
    """Inside torch.compile the block count is the smallest of fused/plan.COMPILED_BLOCKS (~1.5x steps)
    that holds the rows: ten row counts needing 1..10 blocks compile 7 graphs' counts (1, 2, 3,
    4, 6, 8, 12), where the exact count would compile 10 and pass Dynamo's recompile limit of 8.
    Compiled, row counts needing 1, 5, 6, 7 and 8 blocks of 16 rows compile 3 graphs (counts 1,
    6, 8: a size within a step reuses its graph); loss and grads equal eager's exact plan at
    every size. (All ten sizes compiled took 60-160 s of a 2-core CI run.)"""
    from torch._dynamo.testing import CompileCounterWithBackend
    from lowerings.linear_logprobs.fused.plan import compiled_blocks as _compiled_blocks
    assert [_compiled_blocks(n, 16) for n in range(16, 161, 16)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12]
    cfg = cg.GRPOConfig(beta=0.04, gradient_mode="fused", fused_workspace_mib=_mib(16))
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend=cnt, fullgraph=True)
    for i, T in enumerate((6, 36, 44, 52, 60)):       # N = 2T: 1, 5, 6, 7, 8 blocks
        inp = make_inputs(B=2, T=T, seed=20 + i)
        for k in ("hidden", "token_ids", "mask", "old_logprobs", "ref_logprobs"):
            torch._dynamo.mark_dynamic(inp[k], 1)
        loss = fn(**inp)
        got = torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))
        ref = cg.grpo_loss(**inp, config=cfg).loss
        want = torch.autograd.grad(ref, (inp["hidden"], inp["weight"]))
        torch.testing.assert_close(loss, ref)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert cnt.frame_count == 3


def test_compiled_cpu_blocks_bounded_at_small_vocab(monkeypatch):
    """Off CUDA a compiled graph's token-level blocks hold at most fused.CPU_BLOCK_ROWS rows: the
    CPU body computes every row of a block, and the default 640 MiB budget at a small vocab is
    ~1M rows (bench.tp's cpu-tiny fused TP step took 7 s a call with such blocks)."""
    from lowerings.linear_logprobs.fused import schedule as lf
    seen = []
    forward_rows = lf._cpu._forward_rows

    def spy(x, *a, **k):
        seen.append(x.shape[0])
        return forward_rows(x, *a, **k)

    monkeypatch.setattr(lf._cpu, "_forward_rows", spy)
    cfg = cg.GRPOConfig(beta=0.04, gradient_mode="fused")             # the default budget
    inp = make_inputs(B=2, T=8, seed=3)
    torch._dynamo.reset()
    loss = torch.compile(lambda **kw: cg.grpo_loss(**kw, config=cfg).loss, backend="aot_eager",
                         fullgraph=True)(**inp)
    torch.testing.assert_close(loss, cg.grpo_loss(**inp, config=cfg).loss)
    assert seen and max(seen) <= F.CPU_BLOCK_ROWS, seen
