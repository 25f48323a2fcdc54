"""The fused path's kernels precompiled while a trace runs (lowerings/linear_logprobs/
launching/precompile.py), on a CPU machine: fake CUDA tensors, Triton's driver replaced by one that names
an sm_90 target. The capture records one specialization a kernel for 8 row blocks (the
block-varying arguments are not specialized on) and launches nothing; the workers compile them
with triton alone; the parent adopts each without compiling it. Each script runs in a subprocess
(the driver is process-wide)."""
import pytest

from tests.test_cuda_trace import _run_trace

_PRELUDE = r'''
import collections, json, os, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch, triton
from triton.backends.compiler import GPUTarget

class FakeDriver:   # the target alone: nothing here can launch
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0

triton.runtime.driver.set_active(FakeDriver())
from torch._subclasses.fake_tensor import FakeTensorMode
from lowerings.linear_logprobs import device
from lowerings.linear_logprobs.recompute import dw_steps
from lowerings.linear_logprobs.fused import schedule as fused
from lowerings.linear_logprobs.fused import blocks as fused_cuda
from lowerings.linear_logprobs.fused import steps as fused_steps
from lowerings.linear_logprobs.launching import precompile
device._SMS[0] = device._SMS[None] = 132
# the fake driver names sm_90: dw_steps takes the Gluon dW step, as on an H100
G, R, H, V, N = 8, 256, 512, 5000, 1900
with FakeTensorMode():
    bf, f32 = torch.bfloat16, torch.float32
    cuda = lambda *shape, dtype=f32: torch.empty(*shape, device="cuda", dtype=dtype)
    x, w = cuda(N, H, dtype=bf), cuda(V, H, dtype=bf)
    ids_p, perm = cuda(G * R, dtype=torch.int64), cuda(G * R, dtype=torch.int64)
    counts = cuda(G, dtype=torch.int32)
    ws, zoff = cuda(R, fused.ws_cols(x, V), dtype=bf), cuda(R, 20)
    xg, ref = cuda(R, H, dtype=bf), cuda(3 * R)
    dx, dw, db = cuda(N, H, dtype=bf), cuda(V, H, dtype=bf), cuda(0)
    dxp = cuda(fused_cuda.dx_split_rows(R, H, 2), H)

    def steps(scaled):   # every block's launches, last block first (as fused/schedule.py runs them)
        for b in reversed(range(G)):
            fused_cuda.block_forward(x, w, ids_p, None, perm, counts, ws, zoff, xg, b, b * R, R,
                                     0.7, False, 1.0, None, ref, scaled)
            fused_cuda.block_backward(w, ids_p, perm, counts, ws, zoff, xg, cuda(R), cuda(R),
                                      cuda(R), cuda(R), dx, dxp, dw, db, b, b * R, R, 0.7, False,
                                      1.0, None, True, True, False, ref, scaled)
'''

_CAPTURE = _PRELUDE + r'''
    with precompile.capture() as found:   # fake tensors: a launch that ran would raise
        steps(True)
        steps(False)
per_kernel = collections.Counter(name for _, name, _ in dict.fromkeys(found))
assert per_kernel == {"_gather_rows_kernel": 1, "_target_ref_kernel": 1, "_fwd_kernel": 2,
                      "_combine_kernel": 2, "_exp_prep_kernel": 1, "_fused_dlogits_kernel": 1,
                      "_dw_step_ws_kernel": 2, "_dx_split_kernel": 2,
                      "_dx_split_reduce_kernel": 2}, per_kernel
# no compile happened: the capture's hook handed the specializations over instead
import importlib
for module, name, _ in found:
    kernel = getattr(importlib.import_module(module), name)
    assert all(not cache[0] for cache in kernel.device_caches.values()), name
print("OK")
'''

_WORKERS = _PRELUDE + r'''
    precompile.WORKERS = 2
    handed = precompile.precompile(steps, True)
assert handed == 9 and len(precompile._pending) == 2, (handed, precompile._pending)
# the parent's compiles from here on: each adoption must find the workers' kernel
from triton.compiler import compiler
from triton.experimental.gluon._runtime import GluonASTSource
built = []
for cls in (compiler.ASTSource, GluonASTSource):
    make_ir = cls.make_ir
    cls.make_ir = lambda self, *a, _f=make_ir, **k: built.append(self.fn.__name__) or _f(self, *a, **k)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()   # as Inductor's fresh_cache does meanwhile
precompile.wait()
assert not precompile._pending and not built, built
import importlib
adopted = collections.Counter()
for module, name, _ in precompile._sent:
    kernel = getattr(importlib.import_module(module), name)
    adopted[name] = sum(len(c[0]) for c in kernel.device_caches.values())
assert adopted == {"_gather_rows_kernel": 1, "_target_ref_kernel": 1, "_fwd_kernel": 1,
                   "_combine_kernel": 1, "_exp_prep_kernel": 1, "_dw_step_ws_kernel": 2,
                   "_dx_split_kernel": 1, "_dx_split_reduce_kernel": 1}, adopted
print("OK")
'''


# Inductor points TRITON_PTXAS_PATH at torch's own ptxas before its first in-process compile,
# after the workers started in some runs: the parent's cache keys must still match the workers'
_WORKERS_PTXAS = _WORKERS.replace(
    'os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()   # as Inductor\'s fresh_cache does meanwhile',
    """os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import stat
real = triton.knobs.nvidia.ptxas.path
wrapper = os.path.join(tempfile.mkdtemp(), "ptxas")   # another ptxas build: its own version line
with open(wrapper, "w") as f:
    f.write(f'#!/bin/sh\\n"{real}" "$@" || exit $?\\n[ "$1" = --version ] && echo "(another build)"\\nexit 0\\n')
os.chmod(wrapper, stat.S_IRWXU)
os.environ["TRITON_PTXAS_PATH"] = wrapper""")

_EAGER = _PRELUDE + r'''
    precompile.WORKERS = 2
    scal = dict(temperature=0.7, with_entropy=False, logit_scale=1.0, softcap=None,
                round_logits=False)
    args = (x, w, ids_p, None, perm, counts, ws, zoff, xg, dx, dxp, dw, db, G, R, ref, True, scal,
            True, True, False)
    fused_cuda.precompile_eager(*args)          # one block's launches, captured: all 9 kernels
    assert len(precompile._sent) == 9 and len(precompile._pending) == 2
    fused_cuda.precompile_eager(*args)          # the same configuration: nothing more
    assert len(precompile._sent) == 9 and len(precompile._pending) == 2
    longer = (cuda(N + 37, H, dtype=bf),) + args[1:9] + (cuda(N + 37, H, dtype=bf),) + args[10:13] \
        + (G + 1,) + args[14:]             # another batch length: not captured again
    fused_cuda.precompile_eager(*longer)
    assert len(fused_cuda._EAGER_SEEN) == 1 and len(precompile._sent) == 9
precompile.wait()
print("OK")
'''


_RECOMPUTE = _PRELUDE + r'''
    precompile.WORKERS = 1
    from lowerings.linear_logprobs import _linear_logprobs_op
    ids = cuda(N, dtype=torch.int64)
    _linear_logprobs_op(x, w, ids, None, 0.7, False, True)   # traced: triton_launch's fake
names = sorted(name for _, name, _ in precompile._sent)
assert names == ["_combine_kernel", "_fwd_kernel"], names
precompile.wait()
print("OK")
'''


_SYMBOLIC = _PRELUDE.replace("with FakeTensorMode():", """from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv
env = ShapeEnv()
with FakeTensorMode(shape_env=env):
    N = env.create_symintnode(env.create_symbol(1900, source=ConstantSource("N")), hint=1900)""") + r'''
    precompile.WORKERS = 1
    scal = dict(temperature=0.7, with_entropy=False, logit_scale=1.0, softcap=None,
                round_logits=False)
    for b in reversed(range(G)):   # the ops themselves: their fake implementations capture
        fused_steps.fused_block_forward(x, w, ids_p, None, perm, counts, ws, zoff, xg, b, b * R, R,
                                  ref=ref, scaled=True, **scal)
        fused_steps.fused_block_backward(w, ids_p, perm, counts, ws, zoff, xg, cuda(R), cuda(R),
                                   cuda(R), cuda(R), dx, dxp, dw, db, b, b * R, R, need_x=True,
                                   need_w=True, need_b=False, ref=ref, scaled=True, **scal)
assert len(precompile._sent) == 9, precompile._sent
assert not env.guards and not env.replacements, (env.guards, env.replacements)   # N symbolic
precompile.wait()
print("OK")
'''


def test_capture_under_a_symbolic_batch_adds_no_guard():
    """The steps' fake implementations capture with N symbolic (hidden and dX [N, H]) and add
    no guard on it: a trace that precompiles still compiles once for every batch length."""
    _run_trace(_SYMBOLIC)


def test_recompute_launches_are_handed_over_from_the_trace():
    """The recompute op's launches (launching/traced.py's triton_launch, under a trace) are captured from
    its fake implementation like the fused steps'."""
    _run_trace(_RECOMPUTE)


def test_eager_call_hands_one_block_over_once():
    """An eager fused call (nothing traces it) captures one block's launches, which specialize
    as every block's, and only once for a launch configuration."""
    _run_trace(_EAGER)


def test_workers_share_the_cpus_among_local_ranks(monkeypatch):
    pytest.importorskip("triton")
    from lowerings.linear_logprobs.launching import precompile
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = precompile._cpus_per_rank()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert precompile._cpus_per_rank() == max(1, alone // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")   # not a count: as one rank
    assert precompile._cpus_per_rank() == alone


def test_capture_records_one_specialization_a_kernel_and_launches_nothing():
    """8 row blocks, exp-scaled and not: one specialization of each kernel (two of the dW step:
    storing and adding), whatever the block's count pointer alignment or position; before the
    block-varying arguments were left unspecialized it was 24 for the scaled blocks alone."""
    _run_trace(_CAPTURE)


def test_workers_compile_and_the_parent_adopts_without_compiling():
    """Two worker processes compile the 9 specializations (triton alone; here without the CUDA
    launcher, which needs libcuda); wait() loads each from the workers' cache directory into the
    kernel's in-process cache, compiling none itself, though TRITON_CACHE_DIR moved meanwhile."""
    pytest.importorskip("triton")
    _run_trace(_WORKERS)


def test_the_parent_adopts_without_compiling_after_inductor_switches_ptxas():
    """The workers' kernels are found though TRITON_PTXAS_PATH names another ptxas build by the
    parent's first compile (Inductor sets it before its first in-process compile): the parent's
    ptxas version is fixed when the workers start and handed to them (precompile._ptxas_version).
    Without that every kernel compiled twice in 3 of 4 end-to-end runs on an H100."""
    pytest.importorskip("triton")
    assert "TRITON_PTXAS_PATH" in _WORKERS_PTXAS
    _run_trace(_WORKERS_PTXAS)
