"""The CUDA branch of compiled_grpo::linear_logprobs traced on a CPU machine: fake CUDA tensors
with a symbolic N, Triton's active driver replaced by one that only names an sm_90 target
(enough to generate each kernel's TTIR for the write guard). Each script runs in a subprocess: the interpreter
tests set TRITON_INTERPRET=1 for the pytest process. They check that N stays symbolic (no
guard) and that every Triton step survives Inductor's reinplace pass writing its buffers in
place (no clone, no dropped launch)."""
import pytest

_TRACE_PRELUDE = r'''
import inspect, json, torch, triton
from triton.backends.compiler import GPUTarget

class FakeDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

triton.runtime.driver.set_active(FakeDriver())
from torch._dynamo.source import ConstantSource
from torch._functorch.aot_autograd import aot_function
from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
from torch._inductor.fx_utils import FakeTensorUpdater
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs import _linear_logprobs_backward_op, _linear_logprobs_op
tuning.TRACE_LAUNCHES = TRACE_LAUNCHES

import sys
sys.path.insert(0, "tests")
from ttir_writes import ttir_written_params
import lowerings.linear_logprobs.launching.traced as launch

# every traced launch of the op, once per (kernel, constexprs), for check_declared
recorded = {}
_traced_launch = launch._traced_launch


def _record(kernel, grid, bound, options):
    key = (kernel.fn.__name__,) + tuple((p.name, bound[p.name]) for p in kernel.params if p.is_constexpr)
    with torch._C._DisableTorchDispatch():   # stand-ins of the traced (functional) tensors
        plain = {k: torch.empty(2, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                 for k, v in bound.items()}
    recorded.setdefault(key, (kernel, plain))
    return _traced_launch(kernel, grid, bound, options)


launch._traced_launch = _record


def check_declared():
    """The guard: every buffer a traced launch's TTIR writes is among the buffers its kernel
    declares (launch.writes), so the compiled graph keeps and orders every write."""
    for key, (kernel, bound) in recorded.items():
        undeclared = ttir_written_params(kernel, bound) - set(launch.written_params(kernel, bound))
        assert not undeclared, f"{key[0]} writes {sorted(undeclared)} without declaring it ({key})"
    return {key[0] for key in recorded}


env = ShapeEnv()
mode = FakeTensorMode(shape_env=env)
graphs = []


def fake_batch():
    """(N, hidden [N, 256], weight [5000, 256] bf16, ids [N], row mask [N]) on fake CUDA, N symbolic
    (hint 300); inside `mode`. 5000 columns: 3 chunks at CHUNK_V 2048, the last partial."""
    n = env.create_symintnode(env.create_symbol(300, source=ConstantSource("N")), hint=300)
    x = torch.empty(n, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(5000, 256, device="cuda", dtype=torch.bfloat16)
    return (n, x, w, torch.empty(n, device="cuda", dtype=torch.int64),
            torch.empty(n, device="cuda", dtype=torch.bool))


def reinplaced_counts(bw):
    """Run Inductor's reinplace pass on the backward graph; op name -> node count, asserting
    that no mutable op / Triton kernel node clones its buffers."""
    # FakeTensorUpdater takes the GraphModule on torch 2.13 and its Graph on 2.11
    params = inspect.signature(FakeTensorUpdater.__init__).parameters
    reinplace_inplaceable_ops(FakeTensorUpdater(bw if "gm" in params else bw.graph), bw.graph)
    counts = {}
    for node in bw.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        counts[name] = counts.get(name, 0) + 1
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            assert node.meta["only_clone_these_tensors"] == [], node.format_node()
        assert node.target is not torch.ops.higher_order.triton_kernel_wrapper_functional, \
            "a Triton launch traced through wrap_triton: its writes would be inferred, not declared"
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            name = node.args[0].__name__   # the mutable op's name: launches count per kernel
            if node.args[0] is torch.ops.compiled_grpo.triton_launch.default:
                name = json.loads(node.kwargs["spec"])[1]
            counts[name] = counts.get(name, 0) + 1
    return counts
'''
_CUDA_TRACE = "TRACE_LAUNCHES = True\n" + _TRACE_PRELUDE + r'''
with mode:
    n, x, w, ids, _ = fake_batch()
    import lowerings.linear_logprobs.recompute.dense as tk
    tuning.CHUNK_V = 2048
    tuning.DX_GROUP_BYTES = 200_000         # 2 row groups of 256 (hint) rows, the last partial
    assert tk._row_groups(n, 256) == 2
    assert tuning.TMA == "1" and tk._use_tma(x, w)     # the TMA kernels' TTIR traces (sm_90 target)
    tuning.TMA = "eager"
    assert not tk._use_tma(x, w)                   # "eager": pointer kernels while tracing
    tuning.TMA = "1"
    grab = lambda gm, args: graphs.append(gm) or gm
    lp, ent, lse = aot_function(lambda x, w, ids: _linear_logprobs_op(
        x, w, ids, None, 0.7, False, True), grab)(x, w, ids)
    aot_function(lambda *a: _linear_logprobs_backward_op(
        *a[:3], None, *a[3:], 0.7, False, True, True, True, False), grab)(
        x, w, ids, lse, ent, lse, lse, lse)
    assert not env.guards and not env.replacements, (env.guards, env.replacements)  # N symbolic
    # the softcapped kernels (HAS_CAP) trace too
    lpc, entc, lsec = aot_function(lambda x, w, ids: _linear_logprobs_op(
        x, w, ids, None, 0.7, False, True, None, 0.5, 30.0), grab)(x, w, ids)
    aot_function(lambda *a: _linear_logprobs_backward_op(
        *a[:3], None, *a[3:], 0.7, False, True, True, True, False, None, 0.5, 30.0), grab)(
        x, w, ids, lsec, entc, lsec, lsec, lsec)
    counts = reinplaced_counts(graphs[1])
# per row group: dlogits, dW and dX for each of 3 chunks, then the dX store
assert counts["auto_functionalized_v2"] == 2 * (3 * 3 + 1), counts
assert counts["_dlogits_kernel"] == 6 and counts["_linear_logprobs_dw_rows.default"] == 6, counts
assert not any("scatter" in k or "clone" in k or "copy_" in k for k in counts), counts
assert check_declared() == {"_fwd_kernel", "_combine_kernel", "_dlogits_kernel"}
print("OK")
'''


def _run_trace(script: str) -> None:
    """Run a fake-CUDA trace script in a fresh interpreter (no TRITON_INTERPRET); it prints OK."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_cuda_backward_trace_in_place_and_symbolic_n():
    """(tuning.TRACE_LAUNCHES: each launch a node.) Traced CUDA backward: no guard on N, and Inductor's reinplace pass leaves no copy of the
    dW / fp32 dX / workspace buffers (each chunk writes them in place, as eager does)."""
    _run_trace(_CUDA_TRACE)


# The row-masked CUDA path (recompute/rows.py) traced the same way: valid-first sort, per-group gather,
# Triton dlogits / dW / dX steps.
_CUDA_ROWS_TRACE = "TRACE_LAUNCHES = True\n" + _TRACE_PRELUDE + r'''
with mode:
    n, x, w, ids, m = fake_batch()
    import lowerings.linear_logprobs.recompute.dense as tk
    import lowerings.linear_logprobs.recompute.rows as rk
    tuning.CHUNK_V = 2048
    rk.WS_BYTES = 1 << 30
    tuning.DX_GROUP_BYTES = 200_000
    grab = lambda gm, args: graphs.append(gm) or gm
    lp, ent, lse = aot_function(lambda x, w, ids, m: _linear_logprobs_op(
        x, w, ids, None, 0.7, False, True, m), grab)(x, w, ids, m)
    aot_function(lambda x, w, ids, lse, ent, g, m: _linear_logprobs_backward_op(
        x, w, ids, None, lse, ent, g, g, g, 0.7, False, True, True, True, False, m), grab)(
        x, w, ids, lse, ent, lse, m)
    assert not env.guards and not env.replacements, (env.guards, env.replacements)  # N symbolic
    lpc, entc, lsec = aot_function(lambda x, w, ids, m: _linear_logprobs_op(
        x, w, ids, None, 0.7, False, True, m, 0.5, 30.0), grab)(x, w, ids, m)
    aot_function(lambda x, w, ids, lse, ent, g, m: _linear_logprobs_backward_op(
        x, w, ids, None, lse, ent, g, g, g, 0.7, False, True, True, True, False, m, 0.5, 30.0),
        grab)(x, w, ids, lsec, entc, lsec, m)
    counts = reinplaced_counts(graphs[1])
# per row group: gather, then dlogits, dW and dX steps for each of 3 chunks, then the dX
# K-split partials' sum (cuda_rows.DX_SPLITS: it exits unless the group's dX split); nothing copied
assert counts["auto_functionalized_v2"] == 2 * (1 + 3 * 3 + 1), counts
assert counts["_dx_split_reduce_kernel"] == 2, counts
# (the dW step: the Gluon kernel, as the fake driver's sm_90 target takes it; dw_steps)
assert counts["_dw_step_ws_kernel"] == 6 and counts["_gather_rows_kernel"] == 2, counts
assert not any("clone" in k or "copy_" in k for k in counts), counts
# ... and the Triton persistent dW step, which the other targets (and fp32 dW) take
import lowerings.linear_logprobs.recompute.dw_steps as dws
dws.DW_WS = False
with mode:
    aot_function(lambda x, w, ids, lse, ent, g, m: _linear_logprobs_backward_op(
        x, w, ids, None, lse, ent, g, g, g, 0.7, False, True, True, True, False, m), grab)(
        x, w, ids, lse, ent, lse, m)
counts = reinplaced_counts(graphs[-1])
assert counts["_dw_step_persistent_kernel"] == 6 and "_dw_step_ws_kernel" not in counts, counts
assert not any("clone" in k or "copy_" in k for k in counts), counts
assert check_declared() == {"_gather_rows_kernel", "_fwd_kernel", "_combine_kernel", "_dlogits_kernel", "_dw_step_ws_kernel",
                            "_dw_step_persistent_kernel", "_dx_step_kernel", "_dx_split_reduce_kernel"}
print("OK")
'''


def test_cuda_rows_backward_trace_in_place_and_symbolic_n():
    """(tuning.TRACE_LAUNCHES.) Traced row-masked CUDA forward and backward: no guard on N, and every Triton step writes
    its buffers (xg, ws, dW, the fp32 dX accumulator, dX) in place after Inductor's reinplace."""
    _run_trace(_CUDA_ROWS_TRACE)


# The guard itself: a kernel whose only write is a bulk reduce-add through a tensor descriptor (the
# dW steps' TMA epilogue, the write torch 2.11's analysis missed) is caught until it is declared.
_DESCRIPTOR_WRITE_TRACE = "TRACE_LAUNCHES = True\n" + _TRACE_PRELUDE + r'''
from ttir_writes import _toy_kernel
from lowerings.linear_logprobs.kernels.dw import _dw_step_kernel, _dw_step_persistent_kernel
_reduce_only = _toy_kernel()
with mode:
    t = lambda *s: torch.empty(*s, device="cuda", dtype=torch.bfloat16)
    toy = dict(out_ptr=t(64, 64), src_ptr=t(64, 64), n=64)
    assert ttir_written_params(_reduce_only, toy) == {"out_ptr"}
    assert set(launch.written_params(_reduce_only, toy)) == set()     # undeclared: the guard fails
    tiles = dict(ACCUMULATE=True, ON_DEVICE=False, DOT_PREC="tf32", USE_TMA=True, TMA_OUT=True,
                 BLOCK_C=128, BLOCK_H=128, BLOCK_K=64, GROUP_C=8)
    for kernel, extra in ((_dw_step_kernel, {}), (_dw_step_persistent_kernel, {"n_programs": 4})):
        bound = dict(ws_ptr=t(256, 512), x_ptr=t(256, 256), dw_ptr=t(512, 256),
                     count_ptr=torch.empty(1, device="cuda", dtype=torch.int32), row0=0, n_rows=256,
                     v0=0, cols=512, H=256, stride_ws=512, stride_x=256, stride_dw=256, n_cblocks=4,
                     n_hblocks=2, n_later=0, final=0, **extra, **tiles)
        assert ttir_written_params(kernel, bound) == {"dw_ptr"}           # the reduce-add is seen
        assert launch.written_params(kernel, bound) == ("dw_ptr",)        # and declared
    # a Gluon kernel's TMA store (torch's TTIR reader cannot read Gluon: ttir_writes follows it)
    from ttir_writes import _gluon_toy_kernel
    from lowerings.linear_logprobs.kernels.dw_gluon import _dw_step_ws_kernel
    _copy_only = _gluon_toy_kernel()
    toy = dict(out_ptr=t(64, 64), src_ptr=t(64, 64), n=64, num_warps=4)
    assert ttir_written_params(_copy_only, toy) == {"out_ptr"}       # src_ptr is only read
    assert set(launch.written_params(_copy_only, toy)) == set()      # undeclared: the guard fails
    for acc in (False, True):
        bound = dict(ws_ptr=t(256, 512), x_ptr=t(256, 256), dw_ptr=t(512, 256),
                     count_ptr=torch.empty(1, device="cuda", dtype=torch.int32), row0=0, n_rows=256,
                     v0=0, cols=512, H=256, stride_ws=512, stride_x=256, stride_dw=256, n_cblocks=4,
                     n_hblocks=1, n_later=0, final=0, ACCUMULATE=acc, ON_DEVICE=False, BLOCK_C=128,
                     BLOCK_H=256, BLOCK_K=64, GROUP_C=8, STAGES=3, NC=2, num_warps=4)
        assert ttir_written_params(_dw_step_ws_kernel, bound) == {"dw_ptr"}
        assert launch.written_params(_dw_step_ws_kernel, bound) == ("dw_ptr",)
print("OK")
'''


def test_guard_sees_descriptor_writes():
    """The CPU guard finds a write made only through a descriptor reduce-add (the dW steps' TMA
    epilogue), or only through a Gluon kernel's TMA store, and fails a kernel that does not
    declare it; the dW kernels (Triton and Gluon) declare theirs."""
    _run_trace(_DESCRIPTOR_WRITE_TRACE)


# The default (tuning.TRACE_LAUNCHES False): each CUDA body one opaque custom op in the traced
# graph, eager's launches at run time; its fake traces the same launches (the declared-writes
# guard and the precompile workers see every kernel).
_CUDA_OPAQUE_TRACE = "TRACE_LAUNCHES = False\n" + _TRACE_PRELUDE + r'''
import lowerings.linear_logprobs.launching.precompile as pre
handed = []
pre.precompile = lambda host_code, *a, **k: handed.append(host_code) or 0
with mode:
    n, x, w, ids, m = fake_batch()
    tuning.CHUNK_V = 2048
    tuning.DX_GROUP_BYTES = 200_000
    grab = lambda gm, args: graphs.append(gm) or gm
    for mask in (None, m):
        lp, ent, lse = aot_function(lambda x, w, ids, m: _linear_logprobs_op(
            x, w, ids, None, 0.7, False, True, m), grab)(x, w, ids, mask)
        dx, dw, db = aot_function(lambda x, w, ids, lse, ent, g, m: _linear_logprobs_backward_op(
            x, w, ids, None, lse, ent, g, g, g, 0.7, False, True, True, True, False, m), grab)(
            x, w, ids, lse, ent, lse, mask)
        assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (0,), (dx.shape, dw.shape)
    assert not env.guards and not env.replacements, (env.guards, env.replacements)  # N symbolic
for gm, op in zip(graphs, ["linear_logprobs_cuda", "linear_logprobs_cuda_backward"] * 2):
    calls = [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    ours = [t for t in calls if "compiled_grpo" in str(t)]
    assert [str(t) for t in ours] == [f"compiled_grpo.{op}.default"], calls
    assert not any("auto_functionalized" in str(t) for t in calls), calls
assert handed, "the fakes' launches reach the precompile workers"
assert check_declared() >= {"_fwd_kernel", "_combine_kernel", "_dlogits_kernel", "_gather_rows_kernel"}
print("OK")
'''


def test_cuda_trace_default_one_opaque_op_a_body():
    """The default trace: the CUDA forward and backward (dense and row-masked) are one opaque
    custom op each, N symbolic, while their fakes trace every launch (declared writes checked,
    kernels handed to the precompile workers)."""
    _run_trace(_CUDA_OPAQUE_TRACE)
