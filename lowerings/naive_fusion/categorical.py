"""torch.distributions.Categorical's log_prob and entropy put into the matchers' form.

Categorical(logits=z) normalizes with
`lp = z - z.logsumexp(-1, keepdim=True)` (a log_softmax to the matchers), and then

    v, log_pmf = torch.broadcast_tensors(ids.long().unsqueeze(-1), lp); log_pmf.gather(-1, v[..., :1])
    -(torch.clamp(lp, min=torch.finfo(lp.dtype).min) * F.softmax(lp, dim=-1)).sum(-1)      # entropy

``categorical_spelling`` reads the first as `lp.gather(-1, ids.long().unsqueeze(-1))` (the index
already has lp's leading shape and one column: broadcasting changes nothing, and `[..., :1]` takes
that column back) and the product as `lp * F.softmax(z, dim=-1)`: the clamp only moves a -inf
log-prob, which finite logits (a GEMM of finite operands) do not have, and softmax is invariant to
the per-row shift lse, so softmax(lp) = softmax(z) (a rounding apart). Dynamo records no
`validate_args` check, whether it is on (the default) or off. Each edit is a normalize.Edit,
undone by normalize.settle when no rewrite used it.
"""
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from lowerings.naive_fusion.match import _log_softmax_by_lse
from lowerings.naive_fusion.nodes import _LOG_SOFTMAX, _arg, _is, _last_dim, _record, _val
from lowerings.naive_fusion.normalize import Edit, _found, _from_gemm, _made


def _log_probs_of(lp: Node) -> Optional[Node]:
    """z when lp = log_softmax(z, -1) or z - z.logsumexp(-1, keepdim=True) of a GEMM's output z;
    None otherwise."""
    z = lp.args[0] if lp.args and isinstance(lp.args[0], Node) else None
    vz = _val(z) if z is not None else None
    if vz is None or not _from_gemm(z):
        return None
    if _is(lp, _LOG_SOFTMAX, ("log_softmax",)):
        return z if _last_dim(_arg(lp, 1, "dim", None), vz.dim()) else None
    return z if _log_softmax_by_lse(lp, z, vz.dim()) else None


def _broadcast_gather(g: Node) -> Optional[tuple]:
    """(lp, idx, erased) when g = log_pmf.gather(-1, v[..., :1]) with (v, log_pmf) =
    broadcast_tensors(idx, lp), idx of lp's leading shape and one column, and nothing else
    reading the broadcast; None otherwise."""
    if not (_is(g, (torch.gather,), ("gather",)) and len(g.args) == 3 and not g.kwargs):
        return None
    pmf, dim, sl = g.args
    if not (isinstance(pmf, Node) and isinstance(sl, Node) and pmf.target is operator.getitem
            and pmf.args[1] == 1 and sl.op == "call_function" and sl.target is operator.getitem
            and sl.args[1] == (Ellipsis, slice(None, 1, None)) and isinstance(sl.args[0], Node)):
        return None
    v, bt = sl.args[0], pmf.args[0]
    if not (v.target is operator.getitem and v.args == (bt, 0)
            and _is(bt, (torch.broadcast_tensors, torch.functional.broadcast_tensors))
            and len(bt.args) == 2 and not bt.kwargs and set(bt.users) == {v, pmf}
            and set(pmf.users) == {g} and set(v.users) == {sl} and set(sl.users) == {g}):
        return None
    idx, lp = bt.args
    vi, vl = _val(idx), _val(lp)
    if vi is None or vl is None or vi.dtype != torch.int64 or not _last_dim(dim, vl.dim()) \
            or tuple(vi.shape) != tuple(vl.shape[:-1]) + (1,) or _log_probs_of(lp) is None:
        return None
    return lp, idx, [g, sl, v, pmf, bt]


def _clamped_entropy_product(m: Node) -> Optional[tuple]:
    """(lp, z, erased) when m = clamp(lp, min=finfo.min) * softmax(lp, -1) (either order), lp a
    log_softmax of z, the clamp and the softmax read by m alone; None otherwise."""
    if not (_is(m, (operator.mul, torch.mul), ("mul",)) and len(m.args) == 2 and not m.kwargs
            and all(isinstance(a, Node) for a in m.args)):
        return None
    c, sm = m.args if _is(m.args[0], (torch.clamp, torch.clip), ("clamp", "clip")) else m.args[::-1]
    if not (_is(c, (torch.clamp, torch.clip), ("clamp", "clip"))
            and _is(sm, (F.softmax, torch.softmax), ("softmax",))
            and set(c.users) == {m} and set(sm.users) == {m} and c.args and sm.args
            and c.args[0] is sm.args[0] and isinstance(c.args[0], Node)):
        return None
    lp = c.args[0]
    vl = _val(lp)
    lo = c.kwargs.get("min", c.args[1] if len(c.args) > 1 else None)
    if vl is None or not vl.is_floating_point() or set(c.kwargs) - {"min"} or len(c.args) > 2 \
            or lo != torch.finfo(vl.dtype).min or not _last_dim(_arg(sm, 1, "dim", None), vl.dim()) \
            or _arg(sm, 3 if sm.target is F.softmax else 2, "dtype", None) is not None:
        return None
    z = _log_probs_of(lp)
    return None if z is None else (lp, z, [m, c, sm])


def _latest_first(nodes: list) -> list:
    """nodes in reverse graph order (a walk back from the latest, which nodes[0] is)."""
    left, out, n = set(nodes), [], nodes[0]
    while left and n.op != "root":
        if n in left:
            left.discard(n)
            out.append(n)
        n = n.prev
    return out


def categorical_spelling(graph: Graph) -> list:
    """torch.distributions.Categorical's log_prob and entropy of a GEMM's logits in the
    matchers' form (the module docstring says why each is the same); the Edits."""
    edits = []
    for n in list(graph.nodes):     # what an edit erases precedes n: never visited after
        bg = _found(_broadcast_gather, n)
        cp = None if bg else _found(_clamped_entropy_product, n)
        if not (bg or cp):
            continue
        with graph.inserting_before(n):
            if bg:
                lp, idx, erased = bg
                created = [graph.call_method("gather", (lp, -1, idx))]
            else:
                lp, z, erased = cp
                sm = graph.call_function(F.softmax, (z,), {"dim": -1})
                created = [sm, graph.call_function(operator.mul, (lp, sm))]
        for c in created:
            c.meta = dict(n.meta)
        if not _made(graph, created):
            continue
        n.replace_all_uses_with(created[-1])
        records = [_record(e) for e in _latest_first(erased)]   # users before their inputs (undo)
        for e in erased:
            graph.erase_node(e)
        edits.append(Edit(records, created, {created[-1]: n}))
    return edits
