"""Trainers' spellings put into the matchers' form before they run, tentatively.

In-place scales of the logits, which trainers use to save a copy:

    logits = output.logits.squeeze(0)       # verl's dp_actor (remove-padding path)
    logits.div_(temperature)
    logits /= self.temperature              # older TRL, many scripts

Dynamo records `div_` / `mul_` (call_method, its result unused, later code reading `logits`) or
`operator.itruediv` / `imul` (later code reading its result). The matchers refuse any in-place op
between the GEMM and its consumers (match._region_is_clean). ``scales_out_of_place`` replaces
``m = x.div_(c)`` by ``y = x / c`` and points every later reader of x (and of m) at y, when that is
provably the same program:

  - x is the lm_head's output or a chain of single-user ops from it (casts, views, scales), so no
    other name for x's memory exists: nothing else reads the write;
  - every other reader of x comes after m (a read before it saw the old values; none exists);
  - x / c has x's dtype and shape (in place, the result keeps x's; a [N, 1] fp32 t would promote a
    bf16 x out of place).

That is what AOTAutograd's functionalization does with the op anyway.

Leading-dim views taken of the log-probs instead of the logits (NeMo-RL's `get_logprobs`):

    log_probs = F.log_softmax(logits.to(torch.float32), dim=-1)[:, :-1]   # then .gather(...)

``views_before_log_softmax`` makes that `F.log_softmax(logits[:, :-1], dim=-1)`: log_softmax is
row by row over the last dim, so a view of the leading dims commutes with it exactly (the same
values and gradients, bitwise), and the matchers read leading-dim views of the logits.

Each edit is tentative (``Edit``): ``settle`` puts the user's spelling back when no rewrite
consumed the edited nodes, so the pass changes nothing where it does not fuse.
"""
import dataclasses
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from lowerings.naive_fusion.loops import _refresh
from lowerings.naive_fusion.match import _lead_op
from lowerings.naive_fusion.nodes import (_EINSUM, _LINEAR, _LOG_SOFTMAX, _MATMUL, _arg, _is, _last_dim,
                                          _same_size, _val)

# in-place op (method name or function) -> its out-of-place function
_METHODS = {"div_": operator.truediv, "mul_": operator.mul}
_FNS = {operator.itruediv: operator.truediv, operator.imul: operator.mul}


@dataclasses.dataclass
class Edit:
    """One normalization: the nodes it erased ((node, op, target, args, kwargs, meta), users
    before their inputs), the nodes it created (in graph order; the last one stands for `old`)
    and `old`, what the readers of the last created node read before (an erased node or not)."""
    erased: list
    created: list
    old: Node

    def used(self) -> bool:
        """Whether a rewrite consumed the edited computation (erased a created node)."""
        return any(getattr(n, "_erased", False) for n in self.created)

    def undo(self, graph: Graph) -> None:
        """The erased nodes back (inputs first, before the first created node), the readers
        back on them, the created nodes erased."""
        back: dict = {}
        with graph.inserting_before(self.created[0]):
            for n, op, target, args, kwargs, meta in reversed(self.erased):
                b = graph.create_node(op, target, map_arg(args, lambda a: back.get(a, a)),
                                      map_arg(kwargs, lambda a: back.get(a, a)))
                b.meta = meta
                back[n] = b
        # every reader, also one a row-loop fold's undo made after the edit (loops.Fold.undo)
        self.created[-1].replace_all_uses_with(back.get(self.old, self.old))
        for n in reversed(self.created):
            graph.erase_node(n)


def _record(n: Node) -> tuple:
    return (n, n.op, n.target, n.args, dict(n.kwargs), dict(n.meta))


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


def _in_place_scale(m: Node) -> Optional[tuple]:
    """(x, c, fn) for m = x.div_(c) / x.mul_(c) / x /= c / x *= c; None otherwise."""
    if m.kwargs or len(m.args) != 2 or not isinstance(m.args[0], Node):
        return None
    fn = _METHODS.get(m.target) if m.op == "call_method" else (
        _FNS.get(m.target) if m.op == "call_function" else None)
    return None if fn is None else (m.args[0], m.args[1], fn)


def _keeps_x(x: Node, c: Any) -> bool:
    """x * c or x / c out of place has x's dtype and shape."""
    vx = _val(x)
    if vx is None or not vx.is_floating_point():
        return False
    if isinstance(c, Node):
        vc = _val(c)
        if vc is None or not vc.is_floating_point() or vc.dim() > vx.dim() \
                or torch.result_type(vx, vc) != vx.dtype:
            return False
        # broadcast into x's shape: each of c's dims (from the right) 1 or x's
        return all((isinstance(b, int) and b == 1) or _same_size(b, a)
                   for a, b in zip(reversed(vx.shape), reversed(vc.shape)))
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def scales_out_of_place(graph: Graph) -> list:
    """Every provable in-place scale of a GEMM's output made out of place; the Edits."""
    edits = []
    for m in list(graph.nodes):
        parts = _in_place_scale(m)
        if parts is None:
            continue
        x, c, fn = parts
        order = {n: i for i, n in enumerate(graph.nodes)}
        if not _from_gemm(x) or not _keeps_x(x, c) \
                or any(order[u] < order[m] for u in x.users if u is not m):
            continue
        with graph.inserting_before(m):
            new = graph.call_function(fn, (x, c))
        new.meta = dict(m.meta)
        _refresh(graph, [new])      # its own value (m's is x's, the same tensor)
        readers = [u for u in x.users if u is not m and u is not new]
        if readers and m.users:     # both names read after the write: not worth a case
            graph.erase_node(new)
            continue
        old = m if m.users else x
        for reader in readers or list(m.users):
            reader.replace_input_with(old, new)
        edits.append(Edit([_record(m)], [new], old))
        graph.erase_node(m)
    return edits


def views_before_log_softmax(graph: Graph) -> list:
    """Every log_softmax of a GEMM's output whose one reader is a leading-dim view of it,
    swapped: the view first, then log_softmax over the last dim; the Edits."""
    edits = []
    for ls in list(graph.nodes):
        if not (_is(ls, _LOG_SOFTMAX, ("log_softmax",)) and ls.args and isinstance(ls.args[0], Node)
                and len(ls.users) == 1):
            continue
        x, view = ls.args[0], next(iter(ls.users))
        vx = _val(x)
        if vx is None or len(x.users) != 1 or not _from_gemm(x) \
                or not _last_dim(_arg(ls, 1, "dim", None), vx.dim()) \
                or _lead_op(view, ls) is None or view.args[0] is not ls:
            continue
        with graph.inserting_before(view):
            v2 = graph.create_node(view.op, view.target, (x, *view.args[1:]), dict(view.kwargs))
            args = list(ls.args)
            args[0] = v2
            kwargs = dict(ls.kwargs)
            if len(args) > 1:
                args[1] = -1        # the last dim, whatever the view's rank
            else:
                kwargs["dim"] = -1
            ls2 = graph.create_node(ls.op, ls.target, tuple(args), kwargs)
        v2.meta, ls2.meta = dict(view.meta), dict(ls.meta)
        _refresh(graph, [v2, ls2])
        view.replace_all_uses_with(ls2)
        erased = [_record(view), _record(ls)]
        graph.erase_node(view)
        graph.erase_node(ls)
        edits.append(Edit(erased, [v2, ls2], view))
    return edits


def settle(graph: Graph, edits: list) -> int:
    """After the matchers: undo every edit no rewrite consumed, latest first; how many were kept."""
    kept = 0
    for e in reversed(edits):
        if e.used():
            kept += 1
        else:
            e.undo(graph)
    return kept
