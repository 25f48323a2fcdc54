"""Launching this package's Triton kernels through their compiled launcher, past Triton's
per-launch binding: host time of small policies' eager steps and of the recompute op's many
launches (the fused path through precompile.capturable, the recompute op through launching/traced.py).

Why. `kernel[grid](*args)` (JITFunction.run) binds and specializes every argument, builds the
cache key from them and the options, checks the kernel's globals, then calls the compiled
kernel's launcher: 25-60 us a launch against 13-24 us for the launcher alone (H100,
bench/results/launch_overhead_h100_1cf350e.txt). A small policy's eager step launches ~72 of
them (8 row blocks x 9 kernels) and is host-bound on slower hosts (docs/performance.md, "Small policies and the host").

How. Each launch gets a key that distinguishes at least what Triton's specialization does: a
tensor's dtype and 16-byte alignment, an int's i32 / i64 / u64 class, divisibility by 16 and
equality to 1, a float's, a bool's and None's kind, the value of anything else (constexprs,
num_warps and other options), the keyword names, the device and Triton's debug and
instrumentation knobs. It may split what Triton would not (an argument Triton does not
specialize), never the reverse, so the kernel stored for a key is the one Triton would launch.
The first launch of a key goes through JITFunction.run (it compiles or finds the kernel, checks
the arguments, and returns the compiled kernel); later ones call that kernel's launcher with
the arguments in parameter order, defaults filled in, on the current stream. With a launch
hook installed (a profiler: knobs.runtime.launch_enter_hook / launch_exit_hook) every launch
takes Triton's path.
ENABLED = False turns the shortcut off; it starts off on a Triton whose internals (the launcher's
calling convention above) were not checked (triton_compat.INTERNALS_OK).
The key is built with a type-dispatch table, the keywords (constexprs and options: every
launcher's case) go into it as they are, and the parameters after the positional ones (their
values, defaults filled in) are kept with the key: on this project's 2-core CPU machine the
Python of a recompute dX-step launch (17 positional arguments, 12 keywords) took 18 -> 11.4 us
with a stand-in launcher (2026-11-27). Why it matters: a small head's recompute step queues
~470 GEMM-step launches of ~45 us of GPU each and was host-bound (H100, qwen3-0.6b: 34 ms of
host against 22.7 ms of kernels a step, bench/results/recompute_dx_split_h100.txt); on one H200
the step timed the same as before it (24.94 / 25.07 against 24.94 / 26.70 ms, alternating).
"""
import inspect
from typing import Any, Callable

import triton
from torch import Tensor
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

from lowerings.linear_logprobs.launching.triton_compat import INTERNALS_OK

ENABLED = INTERNALS_OK
_NO_DEFAULT = inspect.Parameter.empty
# Whether Triton contracts a * b + c into one fma, pinned at every launch (and in
# bench/kernels/aot_check.py): Triton's default comes from TRITON_DEFAULT_FP_FUSION, which Triton
# 3.10 is to flip, and the kernels' numbers (the float64-reference tolerances, the bitwise
# agreement of eager, compiled and precompiled launches) were measured with it on.
FP_FUSION = True


def pinned(kwargs: dict) -> dict:
    """A launch's keywords with the options this package pins (FP_FUSION) unless given."""
    return kwargs if "enable_fp_fusion" in kwargs else {**kwargs, "enable_fp_fusion": FP_FUSION}


def _tensor_key(a: Tensor):
    return a.dtype, a.data_ptr() % 16 == 0


def _int_key(a: int):
    kind = 0 if -(1 << 31) <= a < (1 << 31) else 1 if -(1 << 63) <= a < (1 << 63) else 2
    return kind, a == 1, a % 16 == 0


# by exact type first (a dict lookup: the key of a ~45-argument launch is most of its host time)
_KEY_BY_TYPE = {Tensor: _tensor_key, bool: lambda a: "u1", int: _int_key, float: lambda a: "fp",
                type(None): lambda a: None}


def _arg_key(a: Any):
    by_type = _KEY_BY_TYPE.get(type(a))
    if by_type is not None:
        return by_type(a)
    if isinstance(a, Tensor):   # subclasses (nn.Parameter)
        return _tensor_key(a)
    if isinstance(a, int):      # int subclasses (bool has none: the table took it)
        return _int_key(a)
    if isinstance(a, float):
        return "fp"
    return a   # constexpr values (hashable; an unhashable one takes Triton's path)


class Launcher:
    """`Launcher(kernel)[grid](*args, **kwargs)`: `kernel[grid](*args, **kwargs)`, through the
    compiled launcher after a key's first launch (module docstring)."""

    __slots__ = ("kernel", "names", "defaults", "constexpr", "specialized", "compiled")

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        params = kernel.signature.parameters
        self.names = tuple(params)
        self.defaults = {n: p.default for n, p in params.items()}
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)   # keyed by value
        self.specialized = {p.name for p in kernel.params if not p.is_constexpr}
        self.compiled: dict = {}

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        kwargs = pinned(kwargs)
        rt = triton.knobs.runtime
        if not ENABLED or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            self.kernel[grid](*args, **kwargs)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        # keywords that are constexprs or options (the launchers' case) keyed by value as they
        # are; a non-constexpr parameter given by keyword by its kind
        by_value = self.specialized.isdisjoint(kwargs)
        try:
            # constexprs and options (num_warps, ...) by value, the other arguments by kind
            key = (device, rt.debug, triton.knobs.compilation.instrumentation_mode,
                   tuple([a if c else _arg_key(a) for a, c in zip(args, self.constexpr)]),
                   tuple(kwargs.items()) if by_value else
                   tuple((k, _arg_key(v) if k in self.specialized else v)
                         for k, v in kwargs.items()))
            found = self.compiled.get(key)
        except TypeError:   # an unhashable argument: Triton's own path
            self.kernel[grid](*args, **kwargs)
            return
        if found is None:
            ck = self.kernel[grid](*args, **kwargs)
            if hasattr(ck, "result"):   # an async compile's future
                ck = ck.result()
            if ck is not None and hasattr(ck, "packed_metadata"):
                # the parameters after the positional ones, in order (defaults filled in): the
                # key holds their values when they all came by value, so they are kept with it
                self.compiled[key] = (ck, self._tail(args, kwargs) if by_value else None)
            return
        ck, tail = found
        vals = args + (tail if tail is not None else self._tail(args, kwargs))
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        # no launch metadata and no hooks: none is installed (checked above)
        ck.run(g0, g1, g2, driver.get_current_stream(device), ck.function, ck.packed_metadata,
               None, None, None, *vals)

    def _tail(self, args: tuple, kwargs: dict) -> tuple:
        tail = tuple(kwargs.get(name, self.defaults[name]) for name in self.names[len(args):])
        if any(v is _NO_DEFAULT for v in tail):   # not after the key's first launch bound them
            raise TypeError(f"{self.kernel.__name__}: missing argument")
        return tail


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6's are chains, empty unless a profiler or a
    user added one (older Triton: None unless set)."""
    return hook is not None and (not isinstance(hook, HookChain) or bool(hook.calls))


def launcher(kernel) -> Any:
    """The Launcher of a JITFunction (Gluon's too), one a kernel (callers wrap kernels at each
    launch: cuda_rows._gather); the kernel itself otherwise (the interpreter tests'
    InterpretedFunction launches as it is)."""
    if not isinstance(kernel, JITFunction):
        return kernel
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found


_LAUNCHERS: dict[int, Launcher] = {}   # by id(kernel): a JITFunction's hash reads its source
