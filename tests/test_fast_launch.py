"""fast_launch (lowerings/linear_logprobs/launching/fast.py): a launch's key splits at least what
Triton's specialization splits, the first launch of a key goes through JITFunction.run, later
ones call the compiled kernel's launcher with the arguments in parameter order. On CPU: the
kernel's run and the driver are stand-ins (the GPU tests launch the real ones: test_fused_gpu,
test_compile_grads_gpu)."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from lowerings.linear_logprobs.launching import fast as fl
from lowerings.linear_logprobs.launching import precompile


def _body(x_ptr, n, scale, flag, A: tl.constexpr, B: tl.constexpr = 3):
    pass


# a JITFunction whatever TRITON_INTERPRET says (the test session's conftest sets it: triton.jit
# would make an InterpretedFunction, which fast_launch leaves alone)
_kernel = JITFunction(_body)


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("launcher",) + args)


@pytest.fixture
def launches(monkeypatch):
    """(launcher, log): Triton's run and the compiled launcher record their calls."""
    log = []
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(_kernel, "run", lambda *args, grid, warmup, **kw: (
        log.append(("triton", grid, args, kw)) or _Compiled(log)))
    monkeypatch.setattr(fl, "_LAUNCHERS", {})
    return fl.launcher(_kernel), log


def test_second_launch_takes_the_launcher(launches):
    launch, log = launches
    x = torch.zeros(64)
    launch[(3,)](x, 7, 0.5, True, A=2, num_warps=4)
    launch[(5, 2)](x, 9, 1.5, False, A=2, num_warps=4)
    assert [e[0] for e in log] == ["triton", "launcher"]
    # grid, stream, function, metadata, no launch metadata / enter hook, exit hook, then every
    # parameter in order, the default B filled in
    assert log[1][1:] == (5, 2, 1, 1234, "function", "metadata", None, None, None,
                          x, 9, 1.5, False, 2, 3)


def test_keyword_arguments_reach_the_launcher_by_value(launches):
    """The parameters after the positional ones go to the launcher in order: constexprs and
    defaults kept with the key (they are in it by value), a non-constexpr parameter given by
    keyword (keyed by kind only) read from each launch."""
    launch, log = launches
    x = torch.zeros(64)
    for flag in (True, False, True):
        launch[(1,)](x, 7, 0.5, flag=flag, A=2)
    assert [e[0] for e in log] == ["triton", "launcher", "launcher"]
    assert [e[-3:] for e in log[1:]] == [(False, 2, 3), (True, 2, 3)]
    launch[(1,)](x, 7, 0.5, True, A=2, B=5)
    launch[(1,)](x, 7, 0.5, True, A=2, B=5)
    assert log[-1][0] == "launcher" and log[-1][-3:] == (True, 2, 5)


@pytest.mark.parametrize("change", [
    lambda x: ((x[1:], 7, 0.5, True), dict(A=2)),              # a pointer not 16-byte aligned
    lambda x: ((x.double(), 7, 0.5, True), dict(A=2)),         # another dtype
    lambda x: ((x, 1, 0.5, True), dict(A=2)),                  # an int equal to 1
    lambda x: ((x, 16, 0.5, True), dict(A=2)),                 # an int divisible by 16
    lambda x: ((x, 1 << 40, 0.5, True), dict(A=2)),            # an int past int32
    lambda x: ((x, 7, 0.5, True), dict(A=4)),                  # a constexpr's value
    lambda x: ((x, 7, 0.5, True), dict(A=2, num_warps=8)),     # an option
    lambda x: ((x, 7, 0.5, True), dict(A=2, B=3)),             # a default given by keyword
    lambda x: ((x, 7, 0.5, None), dict(A=2)),                  # None (a constexpr to Triton)
])
def test_what_triton_specializes_takes_its_path(launches, change):
    launch, log = launches
    x = torch.zeros(64)
    launch[(1,)](x, 7, 0.5, True, A=2)
    args, kw = change(x)
    launch[(1,)](*args, **kw)
    assert [e[0] for e in log] == ["triton", "triton"]
    launch[(1,)](*args, **kw)   # and then the launcher for it
    assert log[-1][0] == "launcher"


def test_launch_hook_and_switch_take_tritons_path(launches, monkeypatch):
    launch, log = launches
    x = torch.zeros(64)
    launch[(1,)](x, 7, 0.5, True, A=2)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch[(1,)](x, 7, 0.5, True, A=2)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(fl, "ENABLED", False)
    launch[(1,)](x, 7, 0.5, True, A=2)
    assert [e[0] for e in log] == ["triton"] * 3


def test_one_launcher_a_kernel_and_capturable_uses_it(launches):
    launch, log = launches
    assert fl.launcher(_kernel) is launch
    x = torch.zeros(64)
    precompile.capturable(_kernel)[(1,)](x, 7, 0.5, True, A=2)
    precompile.capturable(_kernel)[(1,)](x, 7, 0.5, True, A=2)
    assert [e[0] for e in log] == ["triton", "launcher"]


def test_interpreted_kernels_launch_as_they_are():
    def not_jit():
        pass
    assert fl.launcher(not_jit) is not_jit


def test_fp_fusion_is_pinned_at_every_launch(launches, monkeypatch):
    """Triton's fma-contraction default (TRITON_DEFAULT_FP_FUSION; 3.10 flips it) cannot change a
    result: every launch, Triton's path and the compiled launcher's key alike, says
    enable_fp_fusion=FP_FUSION, and an explicit value is kept; so does a precompile capture and
    every sm_90 build of bench/kernels/aot_check.py."""
    launch, log = launches
    x = torch.zeros(64)
    launch[(1,)](x, 7, 0.5, True, A=2)
    launch[(1,)](x, 7, 0.5, True, A=2, enable_fp_fusion=False)
    assert [e[3]["enable_fp_fusion"] for e in log] == [fl.FP_FUSION, False]
    captured = []
    monkeypatch.setattr(_kernel, "warmup", lambda *a, **kw: captured.append(kw))
    precompile._capture_launch(_kernel, x, 7, 0.5, True, A=2)
    assert captured[0]["enable_fp_fusion"] is fl.FP_FUSION

    from bench.kernels import aot_check
    seen = []
    monkeypatch.setattr(aot_check.triton, "compile", lambda src, target, options: seen.append(options))
    for label, fn, consts, warps, stages in list(aot_check.cases())[:3]:
        # the session's kernels are InterpretedFunctions (conftest): the JITFunction of the source
        aot_check.build(fn if isinstance(fn, JITFunction) else JITFunction(fn.fn), consts, warps, stages)
    assert seen and all(o["enable_fp_fusion"] is fl.FP_FUSION for o in seen)
