"""In-place scales of the logits made out of place before the matchers run.

Trainers scale the logits in place to save a copy:

    logits = output.logits.squeeze(0)       # verl's dp_actor (remove-padding path)
    logits.div_(temperature)
    logits /= self.temperature              # older TRL, many scripts

Dynamo records `div_` / `mul_` (call_method, its result unused, later code reading `logits`) or
`operator.itruediv` / `imul` (later code reading its result). The matchers refuse any in-place op
between the GEMM and its consumers (match._region_is_clean), so these graphs kept their logits.
``make_scales_out_of_place`` replaces such an op ``m = x.div_(c)`` by ``y = x / c`` and points
every later reader of x (and of m) at y, when that is provably the same program:

  - x is the lm_head's output or a chain of single-user ops from it (casts, views, scales), so no
    other name for x's memory exists: nothing else reads the write;
  - every other reader of x comes after m (a read before it saw the old values; none exists);
  - x / c has x's dtype and shape (in place, the result keeps x's; a [N, 1] fp32 t would promote a
    bf16 x out of place).

That is what AOTAutograd's functionalization does with the op anyway. A swap is tentative:
``Swap.undo`` puts the in-place op back when no rewrite consumed y (``settle_swaps``), so the pass
changes nothing where it does not fuse.
"""
import dataclasses
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from lowerings.naive_fusion.loops import _refresh
from lowerings.naive_fusion.nodes import _EINSUM, _LINEAR, _MATMUL, _is, _same_size, _val

# in-place op (method name or function) -> its out-of-place function
_METHODS = {"div_": operator.truediv, "mul_": operator.mul}
_FNS = {operator.itruediv: operator.truediv, operator.imul: operator.mul}


@dataclasses.dataclass
class Swap:
    """One in-place op `m` (recorded: op, target, args, kwargs, meta) replaced by `new`;
    `moved` the readers pointed at `new`, each with what it read before (x or m)."""
    record: tuple
    x: Node
    new: Node
    moved: list

    def used(self) -> bool:
        return getattr(self.new, "_erased", False)

    def undo(self, graph: Graph) -> None:
        op, target, args, kwargs, meta = self.record
        with graph.inserting_before(self.new):
            m = graph.create_node(op, target, args, kwargs)
        m.meta = meta
        for user, was in self.moved:
            user.replace_input_with(self.new, self.x if was == "x" else m)
        graph.erase_node(self.new)


def _from_gemm(x: Node, depth: int = 12) -> bool:
    """x is a GEMM's output, or reached from one through single-user nodes."""
    n = x
    for _ in range(depth):
        if _is(n, _MATMUL + _LINEAR + _EINSUM, ("matmul", "mm")):
            return True
        ins = [a for a in n.all_input_nodes if _val(a) is not None]
        if n.op not in ("call_function", "call_method") or not ins or len(ins[0].users) != 1 \
                or not (n.args and n.args[0] is ins[0]):
            return False
        n = ins[0]
    return False


def _out_of_place(m: Node) -> Optional[tuple]:
    """(x, c, fn) for m = x.div_(c) / x.mul_(c) / x /= c / x *= c; None otherwise."""
    if m.kwargs or len(m.args) != 2 or not isinstance(m.args[0], Node):
        return None
    fn = _METHODS.get(m.target) if m.op == "call_method" else (
        _FNS.get(m.target) if m.op == "call_function" else None)
    return None if fn is None else (m.args[0], m.args[1], fn)


def _same_result(x: Node, c: Any, fn) -> bool:
    """x `fn` c out of place has x's dtype and shape."""
    vx = _val(x)
    if vx is None or not vx.is_floating_point():
        return False
    if isinstance(c, Node):
        vc = _val(c)
        if vc is None or not vc.is_floating_point() or vc.dim() > vx.dim():
            return False
        if torch.result_type(vx, vc) != vx.dtype:
            return False
        # broadcast into x's shape: each of c's dims (from the right) 1 or x's
        return all((isinstance(b, int) and b == 1) or _same_size(b, a)
                   for a, b in zip(reversed(vx.shape), reversed(vc.shape)))
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def make_scales_out_of_place(graph: Graph) -> list:
    """Swap every provable in-place scale of a GEMM's output (module docstring); the Swaps."""
    swaps = []
    for m in list(graph.nodes):
        parts = _out_of_place(m)
        if parts is None:
            continue
        x, c, fn = parts
        order = {n: i for i, n in enumerate(graph.nodes)}
        if not _from_gemm(x) or not _same_result(x, c, fn) \
                or any(order[u] < order[m] for u in x.users if u is not m):
            continue
        with graph.inserting_before(m):
            new = graph.call_function(fn, (x, c))
        new.meta = dict(m.meta)
        _refresh(graph, [new])      # its own value (m's is x's, the same tensor)
        moved = []
        for u in [u for u in x.users if u is not m and u is not new]:
            u.replace_input_with(x, new)
            moved.append((u, "x"))
        for u in list(m.users):
            u.replace_input_with(m, new)
            moved.append((u, "m"))
        swaps.append(Swap((m.op, m.target, m.args, m.kwargs, m.meta), x, new, moved))
        graph.erase_node(m)
    return swaps


def settle_swaps(graph: Graph, swaps: list) -> int:
    """After the matchers: put back every in-place op whose swap no rewrite consumed, latest
    first; returns how many swaps were kept."""
    kept = 0
    for s in reversed(swaps):
        if s.used():
            kept += 1
        else:
            s.undo(graph)
    return kept
