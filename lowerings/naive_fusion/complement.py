"""Log-probs written through the complement, put into the matchers' form.

Some trainers compute a token's log-prob from the log-sum-exp of every other logit:

    others = torch.logsumexp(torch.where(is_target, torch.finfo(z.dtype).min, z), dim=-1)
    logp = -F.softplus(others - z.gather(-1, ids[..., None]).squeeze(-1))

(is_target = `torch.arange(V) == ids[..., None]`), or the same over vocab chunks
`z[..., a:b]` with `torch.arange(a, b)`, the chunks' log-sum-exps stacked on the last dim and
log-sum-exp'ed once more. With o = log sum_{v != t} e^{z_v}, -softplus(o - z_t) =
-log(1 + e^{o - z_t}) = z_t - log(e^{z_t} + e^{o}) = log_softmax(z)[t]: the same quantity
(softplus is linear past its threshold of 20, a difference below 1e-8, under fp32 rounding of a
log-prob below -20). The fill must vanish under exp: -inf, or at most finfo(z.dtype).min.

``complement_as_log_softmax`` reads such a `-softplus(...)` as
`z.log_softmax(-1).gather(-1, idx).squeeze(-1)` (idx the target gather's own index), a
normalize.Edit: undone by normalize.settle when no rewrite used it, so unfused code keeps the
user's spelling.
"""
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from lowerings.naive_fusion.match import _ids_source
from lowerings.naive_fusion.nodes import _GATHER, _NEG, _arg, _erase_dead, _is, _last_dim, _number, _val
from lowerings.naive_fusion.normalize import Edit, _found, _from_gemm, _made

_EQ = (operator.eq, torch.eq)
# torch 2.11's Dynamo records `torch.arange(V) == ids[..., None]` as call_method __eq__ (2.13: operator.eq)
_EQ_METHODS = ("eq", "__eq__")
_LSE = (torch.logsumexp,)


def _ids_of(n: Any) -> Any:
    """ids for `ids[..., None]` / `ids.unsqueeze(-1)`, else n itself."""
    return (_ids_source(n) or n) if isinstance(n, Node) else n


def _arange(n: Any) -> Optional[tuple]:
    """(a, b) of torch.arange(b) / torch.arange(a, b) (options device / dtype only)."""
    if not (isinstance(n, Node) and _is(n, (torch.arange,))) or set(n.kwargs) - {"device", "dtype"} \
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in n.args):
        return None
    return (0, n.args[0]) if len(n.args) == 1 else tuple(n.args) if len(n.args) == 2 else None


def _is_target(n: Any, ids: Node, a: int, b: int) -> bool:
    """n = (torch.arange(a, b) == ids[..., None]), either order."""
    if not (isinstance(n, Node) and _is(n, _EQ, _EQ_METHODS) and len(n.args) == 2 and not n.kwargs):
        return False
    x, y = n.args
    return any(_arange(p) == (a, b) and _ids_of(q) is ids for p, q in ((x, y), (y, x)))


def _last_dim_lse(o: Node, nd: int) -> bool:
    """o = logsumexp(x, -1) without keepdim."""
    return _is(o, _LSE, ("logsumexp",)) and _last_dim(_arg(o, 1, "dim"), nd) \
        and not _arg(o, 2, "keepdim", False) and len(o.args) + len(o.kwargs) <= 3


def _masked_lse(o: Node, z: Node, ids: Node, nd: int) -> Optional[tuple]:
    """(a, b) when o = logsumexp(where(arange(a, b) == ids[..., None], fill, z[..., a:b]), -1)
    (z itself for (0, V)) with a fill that vanishes under exp; None otherwise."""
    if not _last_dim_lse(o, nd):
        return None
    w = o.args[0]
    if not (isinstance(w, Node) and _is(w, (torch.where,)) and len(w.args) == 3 and not w.kwargs):
        return None
    cond, fill, x = w.args
    fill = _number(fill)
    if fill is None or not (fill == float("-inf") or fill <= torch.finfo(_val(z).dtype).min):
        return None
    V = _val(z).shape[-1]
    if x is z:
        a, b = 0, V
    else:
        key = x.args[1] if isinstance(x, Node) and x.op == "call_function" \
            and x.target is operator.getitem and x.args[0] is z else None
        key = key if isinstance(key, tuple) else (key,)
        last = key[-1] if key else None
        lead = key[:-1]
        if not isinstance(last, slice) or last.step is not None or not isinstance(last.stop, int) \
                or not (lead == (Ellipsis,) or (len(lead) == nd - 1 and all(k == slice(None) for k in lead))):
            return None
        a, b = last.start or 0, min(last.stop, V)
    return (a, b) if isinstance(a, int) and _is_target(cond, ids, a, b) else None


def _others_lse(o: Node, z: Node, ids: Node) -> bool:
    """o = log sum_{v != ids} exp(z_v): one masked logsumexp over all of z, or chunks of z's
    last dim covering it in order, stacked on the last dim and log-sum-exp'ed."""
    nd, V = _val(z).dim(), _val(z).shape[-1]
    if _masked_lse(o, z, ids, nd) == (0, V):
        return True
    if not _last_dim_lse(o, nd):
        return False
    st = o.args[0]
    if not (isinstance(st, Node) and _is(st, (torch.stack,)) and len(st.users) == 1
            and _last_dim(_arg(st, 1, "dim", 0), nd)):
        return False
    spans = [_masked_lse(p, z, ids, nd) if isinstance(p, Node) else None for p in st.args[0]]
    return all(s is not None for s in spans) and spans[0][0] == 0 and spans[-1][1] == V \
        and all(s[0] < s[1] for s in spans) and all(p[1] == q[0] for p, q in zip(spans, spans[1:]))


def _complement(r: Node) -> Optional[tuple]:
    """(z, idx) when r = -softplus(others - z.gather(-1, idx).squeeze(-1)) of a GEMM's output z
    (module docstring); None otherwise."""
    if not (_is(r, _NEG, ("neg",)) and len(r.args) == 1):
        return None
    sp = r.args[0]
    if not (isinstance(sp, Node) and _is(sp, (F.softplus,)) and len(sp.args) == 1
            and _arg(sp, 1, "beta", 1.0) == 1.0 and _arg(sp, 2, "threshold", 20.0) == 20.0
            and len(sp.users) == 1):
        return None
    d = sp.args[0]
    if not (isinstance(d, Node) and _is(d, (operator.sub, torch.sub)) and len(d.args) == 2 and not d.kwargs):
        return None
    o, zt = d.args
    sq = zt if isinstance(zt, Node) and _is(zt, (torch.squeeze,), ("squeeze",)) else None
    g = sq.args[0] if sq is not None and _arg(sq, 1, "dim", None) is not None \
        and _last_dim(_arg(sq, 1, "dim"), _val(sq.args[0]).dim()) else None
    if not (isinstance(g, Node) and _is(g, _GATHER[:1], ("gather",)) and _last_dim(_arg(g, 1, "dim"), _val(g).dim())
            and len(g.args) + len(g.kwargs) == 3):
        return None
    z, idx = g.args[0], _arg(g, 2, "index")
    vz, vi = _val(z), _val(idx)
    if vz is None or vi is None or vi.dtype != torch.int64 or not vz.is_floating_point() \
            or tuple(vi.shape) != tuple(vz.shape[:-1]) + (1,) or not _from_gemm(z):
        return None
    ids = _ids_of(idx)
    return (z, idx) if isinstance(o, Node) and _others_lse(o, z, ids) else None


def complement_as_log_softmax(graph: Graph) -> list:
    """Every -softplus(others - z_target) of a GEMM's output made log_softmax(z)'s gather; the
    Edits."""
    edits = []
    for r in list(graph.nodes):
        if getattr(r, "_erased", False):
            continue
        found = _found(_complement, r)
        if found is None:
            continue
        z, idx = found
        with graph.inserting_before(r):
            ls = graph.call_method("log_softmax", (z, -1))
            g = graph.call_method("gather", (ls, -1, idx))
            out = graph.call_method("squeeze", (g, -1))
        for n in (ls, g, out):
            n.meta = dict(r.meta)
        if not _made(graph, [ls, g, out]):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        r.replace_all_uses_with(out)
        erased: list = []
        _erase_dead(graph, [r], record=erased)
        erased.sort(key=lambda rec: -order[rec[0]])   # undo puts them back in the user's order
        edits.append(Edit(erased, [ls, g, out], {out: r}))
    return edits
