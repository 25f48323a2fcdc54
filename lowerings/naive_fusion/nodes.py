"""Node predicates and small graph edits shared by the naive-fusion pass's matchers (gemm.py,
match.py, loops.py) on Dynamo torch-IR graphs: which op a node is, its arguments by position or
name, its example value, the dtype of a cast, whether a size is provably another, in-place ops,
and dead-code removal up a rewritten chain."""
import contextlib
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.node import map_arg
from torch.fx.experimental.symbolic_shapes import statically_known_true

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Node predicates on Dynamo torch-IR. `call_method` nodes carry `self` as args[0], so argument
# index i below counts the input tensor as 0 for both call_method and call_function spellings.

def _is(n: Any, fns=(), methods=()) -> bool:
    return isinstance(n, Node) and (
        (n.op == "call_function" and n.target in fns)
        or (n.op == "call_method" and n.target in methods))


def _arg(n: Node, i: int, name: str, default: Any = _MISSING) -> Any:
    if i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, default)


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("example_value") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _last_dim(d: Any, ndim: int) -> bool:
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return isinstance(d, int) and not isinstance(d, bool) and d in (-1, ndim - 1)


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_MATMUL = (operator.matmul, torch.matmul, torch.mm)
_EINSUM = (torch.einsum, torch.functional.einsum)
_GATHER = (torch.gather, torch.take_along_dim)
_LINEAR = (F.linear,)
_LOG_SOFTMAX = (torch.log_softmax, F.log_softmax, torch.special.log_softmax)
_SOFTMAX = (torch.softmax, F.softmax, torch.special.softmax)
_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)
_ADD = (operator.add, torch.add)
_NEG = (operator.neg, torch.neg)
_TANH = (torch.tanh, F.tanh)
_VIEW = (torch.reshape, torch.flatten)
_MUTATING_FNS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem)
_REGION_FNS = tuple(f for f in (torch._C._set_grad_enabled,
                                getattr(torch.amp.autocast_mode, "_enter_autocast", None),
                                getattr(torch.amp.autocast_mode, "_exit_autocast", None)) if f)


def _cast_dtype(n: Node) -> Optional[torch.dtype]:
    """Dtype of a pure cast (`.float()`, `.half()`, `.bfloat16()`, `.to(dtype)`), else None."""
    if n.op != "call_method":
        return None
    simple = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}
    if n.target in simple and len(n.args) == 1 and not n.kwargs:
        return simple[n.target]
    if n.target == "to" and not (set(n.kwargs) - {"dtype"}):
        rest = list(n.args[1:]) + list(n.kwargs.values())
        if len(rest) == 1 and isinstance(rest[0], torch.dtype):
            return rest[0]
    return None


def _same_size(a: Any, size) -> bool:
    """a (an int or SymInt, or a node of one) is the size `size`, provably: equal ints, or
    SymInts that Dynamo's shape env decides (the same symbol, a size it specialized when it
    unrolled a loop over it, value ranges); unknown is not equal."""
    if isinstance(a, Node):
        a = a.meta.get("example_value")
    if isinstance(a, bool) or not isinstance(a, (int, torch.SymInt)):
        return False
    if isinstance(a, int) and isinstance(size, int):
        return a == size
    return statically_known_true(a == size)


def _mutating(n: Node) -> bool:
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (n.op == "call_function" and n.target in _MUTATING_FNS) or (
        n.op in ("call_method", "call_function") and isinstance(name, str)
        and name.endswith("_") and not name.endswith("__"))


def _is_gemm(n: Node) -> bool:
    """A matmul / mm / linear / einsum node: what the pass tries as the lm_head GEMM."""
    return _is(n, _MATMUL + _LINEAR + _EINSUM, ("matmul", "mm"))


def _record(n: Node) -> tuple:
    """What _recreate needs to make n again: (node, op, target, args, kwargs, meta)."""
    return (n, n.op, n.target, n.args, dict(n.kwargs), dict(n.meta))


def _erase_dead(graph: Graph, seeds: list, record: Optional[list] = None) -> None:
    """Erase the seeds that have no users, then their inputs that are left without users, up the
    graph. record: each erased node's (node, op, target, args, kwargs, meta) appended, users
    before their inputs (what loops.Fold.undo needs to put them back)."""
    work = list(seeds)
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method") \
                or _mutating(n) or (n.op == "call_function" and n.is_impure()):
            continue
        inputs = n.all_input_nodes
        if record is not None:
            record.append(_record(n))
        graph.erase_node(n)
        work.extend(inputs)


def _recreate(graph: Graph, records: list, before: Node) -> dict:
    """Nodes erased with a record (_erase_dead's: users before their inputs) made again before
    `before`, inputs first, reading each other's re-creations; {erased node: re-creation}."""
    back: dict = {}
    with graph.inserting_before(before):
        for n, op, target, args, kwargs, meta in reversed(records):
            b = graph.create_node(op, target, map_arg(args, lambda a: back.get(a, a)),
                                  map_arg(kwargs, lambda a: back.get(a, a)))
            b.meta = meta
            back[n] = b
    return back


def _refresh(graph: Graph, nodes: list) -> None:
    """example_value of the new nodes, computed from their inputs' (fake) values."""
    for n in nodes:
        def val(a):
            if isinstance(a, Node):
                return a.meta.get("example_value")
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a
        args, kwargs = val(n.args), {k: val(v) for k, v in n.kwargs.items()}
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        # the mode the values were made in (the tracing context may hold another one)
        fake = next((t.fake_mode for t in tensors if hasattr(t, "fake_mode")), None)
        with fake if fake is not None else contextlib.nullcontext():
            if n.op == "call_method":
                v = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                v = n.target(*args, **kwargs)
        n.meta["example_value"] = v
