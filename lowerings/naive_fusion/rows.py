"""Which rows of the fused log-probs the graph reads: the fused-gradient rewrite (separable.py)
skips the rest on the device, as grpo_loss skips masked tokens, so a padded batch costs its
valid tokens only.

Legend: [...] the log-probs' shape (the ids'), N = prod, M a tensor outside D (the nodes that
depend on the log-probs / entropy) broadcast to [...].

For each node of D that is per-token in [...] (an elementwise op whose D operands are [...] too,
or a cast / copy / same-shape view of one), keep(n) is the set of rows at which n's value
depends on the log-probs, a formula of masks:

    lp, ent                      all rows
    x * M   (M outside D)        keep(x) and M != 0
    where(c, x, y)  (c outside)  (c and keep(x)) or (not c and keep(y))
    masked_fill(x, c, v)         keep(x) and not c
    other elementwise ops        the union of their D operands' keeps

Every other consumer of a D node (a reduction, a slice, a gather, a graph output) reads it at
keep(x): their union is the rows the graph needs. If it is not all rows (a mask stands between
the log-probs and everything that reads them), only those rows are computed and the others
read 0. A product is then rewritten `where(M != 0, x, 0) * M`: it was `x * 0` = 0 at a skipped
row for a finite x; with the row's log-prob now 0, x (exp(0 - old) for a very negative old
log-prob) may be inf, and inf * 0 would put a nan in the loss. The where keeps it 0 (and an inf
or nan that the unfused graph had at a masked position too: never in the loss).

Which of these holds is counted in ``counters["compiled_grpo_rows"]`` (ROW_REASONS).
"""
from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

from lowerings.naive_fusion.nodes import _MUL, _cast_dtype, _is, _mutating, _refresh, _same_size, _val

ROW_REASONS = {
    "masked": "the rows no mask selects are skipped (computed by no GEMM)",
    "returned": "a graph output holds the log-probs (or a per-token function of them) at rows no mask selects",
    "read": "an op reads the log-probs at rows no mask selects (a reduction, slice or gather before any mask)",
    "mutated": "a mask is written in place in the graph",
}

ALL, NONE = True, False   # keep formulas: True (all rows), False (none), or tuples of nodes

# ops that keep each element where it is (a view, a copy, a cast), between the two forms
_SAME_METHODS = ("view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "contiguous",
                 "clone", "detach", "float", "half", "bfloat16", "double", "to", "type_as",
                 "broadcast_to")
_SAME_FNS = (torch.reshape, torch.clone, torch.detach, torch.broadcast_to)


def _and(a, b):
    if a is NONE or b is NONE:
        return NONE
    if a is ALL:
        return b
    if b is ALL or a == b:
        return a
    return ("and", a, b)


def _or(a, b):
    if a is ALL or b is ALL:
        return ALL
    if a is NONE:
        return b
    if b is NONE or a == b:
        return a
    return ("or", a, b)


def _form_of(shape, lead: tuple):
    """0: shape is [...]; 1: [..., 1] (a gather's unsqueezed index, before its squeeze); a
    static shape of N elements (a view of the rows in their order: [B, T] of a flat [N]) when
    [...] is static too: that shape; None."""
    if shape is None:
        return None
    shape = tuple(shape)
    if len(shape) == len(lead) and all(_same_size(a, b) for a, b in zip(shape, lead)):
        return 0
    if len(shape) == len(lead) + 1 and _same_size(shape[-1], 1) and _form_of(shape[:-1], lead) == 0:
        return 1
    if all(type(d) is int for d in shape + tuple(lead)) and math.prod(shape) == math.prod(lead):
        return shape
    return None


def form_shape(form, lead: tuple) -> tuple:
    """The shape of a node of this form (_form_of)."""
    return tuple(lead) if form == 0 else (*lead, 1) if form == 1 else form


def _dim_arg(n: Node):
    return n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")


def _form(n: Node, ins: list, forms: dict, lead: tuple):
    """n's form (_form_of) from its example value or, for a node the pass inserted (no example
    value), from its D operands': an unsqueeze / squeeze of the last dim moves between 0 and 1,
    a reshape to a given shape takes that shape's, anything else its operands' common form."""
    v = _val(n)
    if v is not None:
        return _form_of(v.shape, lead)
    if n.meta.get("example_value") is not None or not ins:
        return None
    f = forms.get(n.args[0]) if n.args and isinstance(n.args[0], Node) else None
    if _is(n, (torch.unsqueeze,), ("unsqueeze",)):
        return 1 if f == 0 and _dim_arg(n) in (-1, len(lead)) else None
    if _is(n, (torch.squeeze,), ("squeeze",)):
        return 0 if f == 1 and _dim_arg(n) in (-1, len(lead)) else None
    if _is(n, (torch.reshape,), ("reshape", "view")) and len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        return _form_of(n.args[1], lead)
    common = {forms.get(a) for a in ins}
    return common.pop() if len(common) == 1 else None


def _value(m: Node, depth: int = 8):
    """m's example value; for a node the pass inserted outside D (cross_entropy's ignore_index
    test, a guard's M != 0), computed from its inputs' (and kept in its meta)."""
    v = _val(m)
    if v is None and depth and m.meta.get("example_value") is None \
            and m.op in ("call_function", "call_method"):
        if all(_value(a, depth - 1) is not None for a in m.all_input_nodes):
            try:
                _refresh(m.graph, [m])
            except Exception:                           # noqa: BLE001 (unknown: not a mask)
                m.meta.pop("example_value", None)
            v = _val(m)
    return v


def _broadcasts(m: Node, form: int, lead: tuple) -> bool:
    """m is a tensor node that broadcasts to a node of this form, one value a row."""
    v = _value(m)
    shape = form_shape(form, lead)
    if v is None or v.dim() > len(shape):
        return False
    return all(_same_size(a, 1) or _same_size(a, b) for a, b in zip(reversed(v.shape), reversed(shape)))


def selection(n: Node):
    """(kind, condition, x, y) of where(c, x, y) / x.where(c, y) / masked_fill(x, c, y), else None."""
    if _is(n, (torch.where,), ()) and len(n.args) == 3:
        return "where", n.args[0], n.args[1], n.args[2]
    if _is(n, (), ("where",)) and len(n.args) == 3:           # x.where(c, y)
        return "where", n.args[1], n.args[0], n.args[2]
    if _is(n, (torch.masked_fill,), ("masked_fill",)) and len(n.args) == 3:
        return "fill", n.args[1], n.args[0], n.args[2]
    return None


class RowPlan:
    """The outcome: ``reason`` (ROW_REASONS' key), ``keep`` (the formula of the rows read, when
    "masked"), ``products`` (the x * M nodes to guard), ``forms`` (the per-token nodes, whose keep
    was tracked: node -> _form_of; local_grad.py reads them too)."""

    def __init__(self, reason: str, forms: dict, keep=ALL, products=()):
        self.reason, self.forms, self.keep, self.products = reason, forms, keep, list(products)


def plan_rows(graph: Graph, sources: list, dep: set, elementwise, lead: tuple) -> RowPlan:
    """The rows of [...] the graph reads. ``sources``: the op's output getitems ([...] each);
    ``dep``: D; ``elementwise(n)``: n is an elementwise op (separable's classifier)."""
    keep = {s: ALL for s in sources}
    forms = {s: 0 for s in sources}
    needed, products, returned = NONE, [], False
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in graph.nodes:
        if n not in dep or n in keep or n.op == "output":
            continue
        if n.meta.get("example_value") is not None and _val(n) is None:
            continue                                   # a size or dtype: no log-prob value
        ins = [a for a in n.all_input_nodes if a in keep]
        k = _row_keep(n, ins, keep, forms, lead, elementwise, dep)
        if k is None:   # not per-token: it reads its D operands wherever they depend on the rows
            for a in ins:
                needed = _or(needed, keep[a])
            keep[n] = NONE   # what it depends on is counted in needed
            continue
        keep[n] = k
        if _is(n, _MUL, ("mul",)) and len(ins) == 1 and k != keep[ins[0]]:
            products.append(n)
    for leaf in out.all_input_nodes:
        if leaf in keep and keep[leaf] is not NONE:
            needed = _or(needed, keep[leaf])
            returned = returned or keep[leaf] is ALL
    if needed is ALL:
        return RowPlan("returned" if returned else "read", forms)
    if any(_mutating(u) for m in _leaves(needed) for u in m.users):
        return RowPlan("mutated", forms)
    return RowPlan("masked", forms, needed, products)


def _row_keep(n: Node, ins: list, keep: dict, forms: dict, lead: tuple, elementwise, dep: set):
    """keep(n) if n is per-token (module doc; its form recorded in forms), else None."""
    if not ins or any(forms.get(a) is None for a in ins):
        return None
    f = _form(n, ins, forms, lead)
    if f is None:
        return None
    same = _is(n, _SAME_FNS + (torch.unsqueeze, torch.squeeze), _SAME_METHODS + ("unsqueeze", "squeeze"))
    if same or _cast_dtype(n) is not None:
        if n.args[0] is not ins[0] or len(ins) != 1:
            return None
        forms[n] = f
        return keep[ins[0]]
    if not elementwise(n) or any(forms[a] != f for a in ins):
        return None
    forms[n] = f
    sel = selection(n)
    if sel is not None:
        kind, cond, x, y = sel
        if cond in dep:                                 # a condition of the log-probs
            return _union(ins, keep)
        if not (isinstance(cond, Node) and _broadcasts(cond, f, lead)):
            forms.pop(n)
            return None
        kx = keep.get(x, NONE) if isinstance(x, Node) else NONE
        ky = keep.get(y, NONE) if isinstance(y, Node) else NONE
        c = ("cond", cond, f)
        if kind == "fill":
            if ky is not NONE:
                forms.pop(n)
                return None
            return _and(kx, ("not", c))
        return _or(_and(c, kx), _and(("not", c), ky))
    if _is(n, _MUL, ("mul",)) and len(ins) == 1 and len(n.args) == 2 and not n.kwargs:
        other = n.args[1] if n.args[0] is ins[0] else n.args[0]
        if isinstance(other, Node) and other not in dep and _broadcasts(other, f, lead):
            return _and(keep[ins[0]], ("ne0", other, f))
    return _union(ins, keep)


def _union(ins: list, keep: dict):
    k = NONE
    for a in ins:
        k = _or(k, keep[a])
    return k


def _leaves(k) -> list:
    if not isinstance(k, tuple):
        return []
    if k[0] in ("ne0", "cond"):
        return [k[1]]
    return [m for part in k[1:] for m in _leaves(part)]


def emit_row_mask(graph: Graph, plan: RowPlan, lead_like: Node, lead_shape: tuple) -> Node:
    """Nodes computing the plan's rows as [N] bool (inserted at the graph's current point);
    ``lead_like``: a node of [...] (the ids) to broadcast to, ``lead_shape`` [...]."""
    def build(k):
        if k is NONE:
            return graph.call_function(torch.zeros_like, (lead_like,), {"dtype": torch.bool})
        op = k[0]
        if op in ("ne0", "cond"):   # a mask of a [..., 1] node: its last dim is 1 (or absent)
            m, form = k[1], k[2]
            if form == 1 and _value(m).dim() > 0:
                m = graph.call_method("squeeze", (m, -1))
            elif form not in (0, 1):   # of a static view of the rows: broadcast there, then [...]
                m = graph.call_method("reshape", (graph.call_function(torch.broadcast_to, (m, form)),
                                                  tuple(lead_shape)))
            return graph.call_function(torch.ne, (m, 0)) if op == "ne0" else m
        if op == "not":
            return graph.call_function(torch.logical_not, (build(k[1]),))
        fn = torch.logical_and if op == "and" else torch.logical_or
        return graph.call_function(fn, (build(k[1]), build(k[2])))

    m = build(plan.keep)
    m = graph.call_function(torch.broadcast_to, (m, graph.call_method("size", (lead_like,))))
    return graph.call_method("reshape", (m, -1))


def guard_products(graph: Graph, plan: RowPlan) -> None:
    """x * M -> where(M != 0, x, 0) * M for the products that drop rows (module doc)."""
    for n in plan.products:
        x = next(a for a in n.args if isinstance(a, Node) and a in plan.forms)
        other = n.args[1] if n.args[0] is x else n.args[0]
        with graph.inserting_before(n):
            nz = graph.call_function(torch.ne, (other, 0))
            g = graph.call_function(torch.where, (nz, x, 0))
        _value(nz)
        plan.forms[g] = plan.forms[x]   # per-token as x (local_grad.split reads the forms)
        n.replace_input_with(x, g)
