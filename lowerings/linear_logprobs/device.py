"""Host-side integer helpers and device facts the launch plans share, with no triton import (the
CPU body and compiled_grpo's block planning use them where triton may be absent)."""
from typing import Optional

import torch


def cdiv(a, b):
    """ceil(a / b) for host code (ints or SymInts): the launchers' and compiled_grpo's block
    planning. triton.cdiv is a ConstexprFunction in Triton 3.6, ~6 us a host call against
    ~0.15: the old per-N split pick alone made ~60 of them a block, ~3 ms of host time a qwen3-8b step."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= n (n >= 1), as triton.next_power_of_2 without its host cost."""
    return 1 << (n - 1).bit_length()


def size_hint(n) -> int:
    """n, or the size hint of a symbolic n (1 when unbacked): the host plans' integer view of a
    dimension that may be symbolic under torch.compile. In fake-tensor traces (make_fx, the
    custom ops' fake kernels) that is the hint; in a Dynamo trace n comes back as the symbol
    itself (Dynamo answers isinstance(n, int) for a SymInt), so a comparison on it guards
    there: static_int is the way to a Python int inside Dynamo."""
    return n if isinstance(n, int) else (n.node.hint or 1)


def static_int(n) -> int:
    """n >= 0 as a Python int; a symbolic n (a Dynamo trace under dynamic=True, a fake-tensor trace)
    is specialized to its value: the graph gets a guard on it and recompiles when it changes.
    For sizes a training run does not vary (the head's H and V), where a host plan needs ints.
    len(range(n)) is the spelling Dynamo evaluates to a constant (int(n) stays symbolic, and
    guard_int is not traceable; Dynamo answers type(n) is int for a symbol too)."""
    return len(range(n))


def is_static(n) -> bool:
    """Whether the size n is a compile-time constant: a Python int in eager and in traces of
    static shapes, or a symbol whose range is one value; False for a symbol (dynamic=True, the
    second compile of automatic dynamic shapes, a mark_dynamic range). Dynamo answers
    isinstance(n, int) and type(n) is int with True for a symbol too; has_static_value is the
    test it evaluates at trace time, with no guard (tests/test_fused_modes.py)."""
    from torch.fx.experimental.symbolic_shapes import has_static_value
    return has_static_value(n)


def static_value(v):
    """A config number as a Python constant. A float or int field that changed between two compiles
    of the same code (a sweep over entropy_coef, two configs through one step) comes back from
    Dynamo symbolic (automatic dynamic scalars); __float__ and len(range(n)) (static_int) are the
    spellings Dynamo specializes, with a guard on the value, as the first compile had (int() and
    float() stay symbolic). Other values, and every value in eager, pass through unchanged."""
    if type(v) is float:
        return v.__float__()
    if type(v) is int:
        return static_int(v) if v >= 0 else -static_int(-v)
    return v


_SMS: dict = {}   # sm_count's cache


@torch.compiler.assume_constant_result
def sm_count(index: Optional[int]) -> int:
    """The GPU's SM count; a constant to Dynamo (called, not traced, inside a compiled step),
    cached here (several calls a row block on the host; Dynamo warns on functools caches)."""
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def cuda_sms(device: torch.device) -> int:
    """The SM count of `device` when it is a CUDA device of this machine; 0 for CPU tensors and
    for fake CUDA tensors on a machine without CUDA (traces, interpreter tests): the launch
    plans' one test of whether there is a GPU to plan for."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return sm_count(device.index) if cuda else 0


def grid_sms(device: torch.device) -> int:
    """Programs of a persistent grid on `device`: its SM count; 4 off a CUDA device (cuda_sms)."""
    return cuda_sms(device) or 4
