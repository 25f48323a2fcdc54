"""Launching this package's Triton kernels through their compiled launcher, past Triton's
per-launch binding: host time of small policies' eager steps and of the recompute op's many
launches (the fused path through precompile.capturable, the recompute op through launch.py).

Why. `kernel[grid](*args)` (JITFunction.run) binds and specializes every argument, builds the
cache key from them and the options, checks the kernel's globals, then calls the compiled
kernel's launcher: 25-60 us a launch against 13-24 us for the launcher alone (H100,
bench/results/launch_overhead_h100_1cf350e.txt). A small policy's eager step launches ~72 of
them (8 row blocks x 9 kernels) and is host-bound on slower hosts (README, "Small policies").

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
ENABLED = False turns the shortcut off.
"""
import inspect
from typing import Any, Callable

import triton
from torch import Tensor
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

ENABLED = True
_NO_DEFAULT = inspect.Parameter.empty


def _arg_key(a: Any):
    if isinstance(a, Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):   # (an int subclass: first)
        return "u1"
    if isinstance(a, int):
        kind = 0 if -(1 << 31) <= a < (1 << 31) else 1 if -(1 << 63) <= a < (1 << 63) else 2
        return kind, a == 1, a % 16 == 0
    if isinstance(a, float):
        return "fp"
    return a   # None, constexpr values (hashable; an unhashable one takes Triton's path)


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
        rt = triton.knobs.runtime
        if not ENABLED or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            self.kernel[grid](*args, **kwargs)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        try:
            # constexprs and options (num_warps, ...) by value, the other arguments by kind
            key = (device, rt.debug, triton.knobs.compilation.instrumentation_mode,
                   tuple(a if c else _arg_key(a) for a, c in zip(args, self.constexpr)),
                   tuple((k, _arg_key(v) if k in self.specialized else v)
                         for k, v in kwargs.items()))
            ck = self.compiled.get(key)
        except TypeError:   # an unhashable argument: Triton's own path
            self.kernel[grid](*args, **kwargs)
            return
        if ck is None:
            ck = self.kernel[grid](*args, **kwargs)
            if hasattr(ck, "result"):   # an async compile's future
                ck = ck.result()
            if ck is not None and hasattr(ck, "packed_metadata"):
                self.compiled[key] = ck
            return
        vals = list(args)
        for name in self.names[len(args):]:
            v = kwargs.get(name, self.defaults[name])
            if v is _NO_DEFAULT:   # cannot happen after the key's first launch bound them
                raise TypeError(f"{self.kernel.__name__}: missing argument {name!r}")
            vals.append(v)
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        # no launch metadata and no hooks: none is installed (checked above)
        ck.run(g0, g1, g2, driver.get_current_stream(device), ck.function, ck.packed_metadata,
               None, None, None, *vals)


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
