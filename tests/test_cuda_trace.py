"""The CUDA branch of compiled_grpo::linear_logprobs traced on a CPU machine: fake CUDA tensors
with a symbolic N, Triton's active driver replaced by one that only names an sm_90 target
(enough for wrap_triton's TTIR analysis). Each script runs in a subprocess: the interpreter
tests set TRITON_INTERPRET=1 for the pytest process. They check that N stays symbolic (no
guard) and that every Triton step survives Inductor's reinplace pass writing its buffers in
place (no clone, no dropped launch)."""
import pytest

_TRACE_PRELUDE = r'''
import inspect, torch, triton
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
from lowerings.linear_logprobs import _linear_logprobs_backward_op, _linear_logprobs_op

env = ShapeEnv()
mode = FakeTensorMode(shape_env=env)
graphs = []


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
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            assert node.kwargs["tensors_to_clone"] == [], node.format_node()
    return counts
'''
_CUDA_TRACE = _TRACE_PRELUDE + r'''
with mode:
    n = env.create_symintnode(env.create_symbol(300, source=ConstantSource("N")), hint=300)
    x = torch.empty(n, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(5000, 256, device="cuda", dtype=torch.bfloat16)   # 3 chunks, the last partial
    ids = torch.empty(n, device="cuda", dtype=torch.int64)
    import lowerings.linear_logprobs.cuda as tk
    tk.CHUNK_V = 2048
    tk.DX_GROUP_BYTES = 200_000         # 2 row groups of 256 (hint) rows, the last partial
    assert tk._row_groups(n, 256) == 2
    assert tk.TMA == "1" and tk._use_tma(x, w)     # the TMA kernels' TTIR traces (sm_90 target)
    tk.TMA = "eager"
    assert not tk._use_tma(x, w)                   # "eager": pointer kernels while tracing
    tk.TMA = "1"
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
# per row group: dW and dX for each of 3 chunks, then the dX store
assert counts["auto_functionalized_v2"] == 2 * (3 * 2 + 1), counts
assert not any("scatter" in k or "clone" in k or "copy_" in k for k in counts), counts
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
    env["LINEAR_LOGPROBS_TMA"] = "1"
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_cuda_backward_trace_in_place_and_symbolic_n():
    """Traced CUDA backward: no guard on N, and Inductor's reinplace pass leaves no copy of the
    dW / fp32 dX / workspace buffers (each chunk writes them in place, as eager does)."""
    _run_trace(_CUDA_TRACE)


# The row-masked CUDA path (cuda_rows.py) traced the same way: valid-first sort, per-group gather,
# Triton dlogits / dW / dX steps.
_CUDA_ROWS_TRACE = _TRACE_PRELUDE + r'''
with mode:
    n = env.create_symintnode(env.create_symbol(300, source=ConstantSource("N")), hint=300)
    x = torch.empty(n, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(5000, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(n, device="cuda", dtype=torch.int64)
    m = torch.empty(n, device="cuda", dtype=torch.bool)
    import lowerings.linear_logprobs.cuda as tk
    import lowerings.linear_logprobs.cuda_rows as rk
    tk.CHUNK_V = 2048
    rk.WS_BYTES = 1 << 30
    tk.DX_GROUP_BYTES = 200_000
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
# per row group: gather, then dlogits, dW and dX steps for each of 3 chunks; nothing copied
assert counts["triton_kernel_wrapper_functional"] == 2 * (1 + 3 * 3), counts
assert not any("clone" in k or "copy_" in k for k in counts), counts
print("OK")
'''


def test_cuda_rows_backward_trace_in_place_and_symbolic_n():
    """Traced row-masked CUDA forward and backward: no guard on N, and every Triton step writes
    its buffers (xg, ws, dW, the fp32 dX accumulator, dX) in place after Inductor's reinplace."""
    _run_trace(_CUDA_ROWS_TRACE)


# Both dW step kernels with the TMA epilogue and ACCUMULATE: their only real write to dW is a
# descriptor reduce-add, which torch's TTIR mutation analysis does not list (kernels_dw._dw_out).
_DW_TMA_OUT_TRACE = _TRACE_PRELUDE + r'''
from torch.library import wrap_triton
from lowerings.linear_logprobs.kernels_dw import _dw_step_kernel, _dw_step_persistent_kernel
tiles = dict(ACCUMULATE=True, ON_DEVICE=False, DOT_PREC="tf32", USE_TMA=True, TMA_OUT=True,
             BLOCK_C=128, BLOCK_H=128, BLOCK_K=64, GROUP_C=8)
for kernel, extra in ((_dw_step_kernel, ()), (_dw_step_persistent_kernel, (4,))):
    def step(ws, xg, dw, count):
        dw = dw.clone()     # the trace then has no input mutation to replay outside fake mode
        wrap_triton(kernel)[(4,)](ws, xg, dw, count, 0, 256, 0, 512, 256, 512, 256, 256, 4, 2,
                                  0, 0, *extra, **tiles)
        return dw
    graphs.clear()
    with mode:
        args = (torch.empty(256, 512, device="cuda", dtype=torch.bfloat16),
                torch.empty(256, 256, device="cuda", dtype=torch.bfloat16),
                torch.empty(512, 256, device="cuda", dtype=torch.bfloat16),
                torch.empty(1, device="cuda", dtype=torch.int32))
        aot_function(step, lambda gm, a: graphs.append(gm) or gm)(*args)
    out = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0][0]
    # dW comes back out of the kernel node (a mutation seen), not as the untouched input
    assert out.op == "call_function" and out.args[0].target is \
        torch.ops.higher_order.triton_kernel_wrapper_functional, graphs[0].code
print("OK")
'''


def test_dw_tma_epilogue_reads_as_mutating_dw():
    """The dW steps' TMA epilogue (reduce-add into dW) is seen by Inductor as writing dW, so a
    compiled graph keeps the launch (both the grid and the persistent kernel)."""
    _run_trace(_DW_TMA_OUT_TRACE)
