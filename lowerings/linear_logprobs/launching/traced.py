"""Triton launches whose writes are declared, not inferred: the recompute op's launchers' `wrap`.

Where. Inside a trace the recompute op's CUDA bodies are by default one opaque custom op each
(op.py, tuning.TRACE_LAUNCHES), whose fake runs the body on fake tensors: these traced launches
are then what the fake sees (the precompile workers get their kernels), and the traced graph
holds them only with TRACE_LAUNCHES.

Why. A kernel launched through `torch.library.wrap_triton` is traced as a functional node whose
outputs are the tensors torch's TTIR analysis finds it writing
(torch/_higher_order_ops/triton_kernel_wrap.py); a node found writing nothing has no output and
Inductor removes it. That analysis lists a fixed set of write ops. On torch 2.11 (H200, the
qwen3-8b bench shape) it found no write in the dW step whose epilogue is a bulk reduce-add
(`tt.descriptor_reduce`, kernels.dw._dw_tile): 230 of the 253 dW launches of the masked recompute
backward vanished from the compiled graph and dW came back 87-91% wrong
(bench/results/compile_grads_root_cause_h200_897d288.txt). Nothing failed loudly.

So no launch here depends on that analysis. Each kernel states the pointer parameters it writes
(`writes`, beside its definition), and under tracing each launch is one call of the mutable custom
op `compiled_grpo::triton_launch`, whose `writes` argument (mutates_args) holds those buffers.
Functionalization turns it into `auto_functionalized_v2`, which Inductor keeps, orders by the
declared reads and writes, and reinplaces onto the one buffer (tests/test_cuda_trace.py checks:
no clone, no dropped launch, every write a kernel's TTIR holds is declared). Eager launches go
straight to the kernel. Both (the eager launch, and the custom op's at run time) go through
fast_launch's compiled launcher after a configuration's first launch: the recompute op's eager
step at the qwen3-8b bench made 956 launches and was host-bound on Triton's per-launch binding
(H100: 70.9 against 61.9 ms a step, bench/results/recompute_plan_h100_7424600.txt). The custom
op is opaque to Inductor's scheduler; its cost is the host time of a Python launch (as in
eager), not GPU time.
"""
import functools
import importlib
import json
from typing import Any, Sequence

import torch
import torch._guards
from torch import Tensor

from lowerings.linear_logprobs.kernels.writes import writes  # noqa: F401 (the kernels' declaration)
try:   # a CPU-only install without triton launches nothing here
    from lowerings.linear_logprobs.launching import fast as _fast
    from lowerings.linear_logprobs.launching import precompile as _precompile
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    _fast = _precompile = None


def _declaration(kernel) -> tuple[tuple, dict]:
    if not hasattr(kernel, "declared_writes"):
        raise TypeError(f"Triton kernel {kernel.fn.__name__} declares no writes "
                        f"(decorate it with lowerings.linear_logprobs.launching.traced.writes)")
    return kernel.declared_writes


def written_params(kernel, bound: dict) -> tuple[str, ...]:
    """The parameters `kernel` declares writing at a launch with arguments `bound` (name -> value)."""
    always, when = _declaration(kernel)
    return always + tuple(p for p, flag in when.items() if bound[flag])


class declared:
    """`declared(kernel)[grid](*args, **kwargs)`: the kernel's launch, eager; while tracing, one
    `compiled_grpo::triton_launch` whose mutated buffers are the kernel's declared writes."""

    def __init__(self, kernel):
        _declaration(kernel)   # an undeclared kernel fails here, eager too, not first when traced
        self.kernel = kernel

    def __getitem__(self, grid):
        return functools.partial(_launch, self.kernel, tuple(grid))


def _tracing(args) -> bool:
    """Whether the launch is being traced: its first tensor is fake (FakeTensor, or a
    FunctionalTensor around one). A plain torch.Tensor never is: that check costs ~0.1 us
    against detect_fake_mode's ~13 us over a launch's arguments (~800 launches an eager step)."""
    t = next(a for a in args if isinstance(a, Tensor))
    return type(t) is not Tensor and torch._guards.detect_fake_mode([t]) is not None


def _launch(kernel, grid: tuple, *args, **kwargs) -> None:
    if not _tracing((*args, *kwargs.values())):
        _fast.launcher(kernel)[grid](*args, **kwargs)
        return
    names = kernel.arg_names
    bound = dict(zip(names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    options = {k: v for k, v in kwargs.items() if k not in names}          # num_warps, num_stages
    _traced_launch(kernel, grid, bound, options)


def _traced_launch(kernel, grid: tuple, bound: dict, options: dict) -> None:
    """One `triton_launch`: the declared-written buffers, the other tensors, the runtime ints and
    floats (each tensor once: a buffer passed for several parameters keeps one identity), and a
    JSON plan of where each parameter's value is."""
    out = written_params(kernel, bound)
    w_list: list[Tensor] = []
    for name in out:
        if not isinstance(bound[name], Tensor):
            raise ValueError(f"{kernel.fn.__name__} declares writing {name}, not a tensor here")
        if not any(t is bound[name] for t in w_list):
            w_list.append(bound[name])
    r_list: list[Tensor] = []
    ints: list = []
    floats: list = []
    plan = []
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    for name in kernel.arg_names:
        v = bound[name]
        if isinstance(v, Tensor):
            for kind, lst in (("w", w_list), ("r", r_list)):
                i = next((i for i, t in enumerate(lst) if t is v), None)
                if i is not None:
                    plan.append((kind, i))
                    break
            else:
                r_list.append(v)
                plan.append(("r", len(r_list) - 1))
        elif name in constexprs or v is None or isinstance(v, str):
            plan.append(("c", v))
        elif isinstance(v, (int, torch.SymInt)):            # bool is an int
            ints.append(v)
            plan.append(("i", len(ints) - 1))
        elif isinstance(v, (float, torch.SymFloat)):
            floats.append(v)
            plan.append(("f", len(floats) - 1))
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(v).__name__}")
    spec = json.dumps([kernel.fn.__module__, kernel.fn.__name__, plan, options])
    triton_launch(spec, list(grid), w_list, r_list, ints, floats)


@functools.lru_cache(maxsize=None)
def _plan(spec: str):
    module, name, plan, options = json.loads(spec)
    return getattr(importlib.import_module(module), name), plan, options


@torch.library.custom_op("compiled_grpo::triton_launch", mutates_args=("writes",))
def triton_launch(spec: str, grid: Sequence[int], writes: list[Tensor], reads: list[Tensor],
                  ints: Sequence[int], floats: Sequence[float]) -> None:
    """Launch the kernel of `spec` (module, name, where each parameter's value is, launch options)
    over `grid`; it writes the `writes` buffers (and no other)."""
    kernel, args, options = _call(spec, writes, reads, ints, floats)
    if writes and writes[0].is_cuda:
        from lowerings.linear_logprobs.recompute.dense import _ensure_allocator
        _ensure_allocator()   # in-kernel TMA descriptors need Triton's scratch allocator
        _precompile.wait()    # the kernels the trace handed to the precompile workers
    _fast.launcher(kernel)[tuple(grid)](*args, **options)


def _call(spec: str, writes, reads, ints, floats) -> tuple:
    """(kernel, positional arguments, launch options) of a triton_launch call."""
    kernel, plan, options = _plan(spec)
    lists: dict[str, Any] = {"w": writes, "r": reads, "i": ints, "f": floats}
    return kernel, [v if kind == "c" else lists[kind][v] for kind, v in plan], options


@triton_launch.register_fake
def _(spec, grid, writes, reads, ints, floats):
    if writes and writes[0].device.type == "cuda":   # its kernel, to the precompile workers
        kernel, args, options = _call(spec, writes, reads, ints, floats)
        _precompile.precompile(lambda: _precompile.capturable(kernel)[grid](*args, **options))
    return None
