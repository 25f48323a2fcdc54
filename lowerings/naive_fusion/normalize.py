"""Trainers' spellings put into the matchers' form before they run, tentatively.

In-place scales of the logits, which trainers use to save a copy:

    logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))   # verl 0.9.1's megatron engine
    logits /= self.temperature                                    # older TRL, many scripts

Dynamo records `div_` / `mul_` (call_method, its result unused, later code reading `logits`) or
`operator.itruediv` / `imul` (later code reading its result). The matchers refuse any in-place op
between the GEMM and its consumers (region._region_is_clean). ``scales_out_of_place`` replaces
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

Two more spellings of a matched consumer: ``nll_of_log_softmax`` reads
`F.nll_loss(F.log_softmax(z, -1), t, ...)` as `F.cross_entropy(z, t, ...)` (its definition), and
``fancy_index_as_gather`` reads `logp[torch.arange(N), ids]` (and the [B, T] form with
broadcast aranges) as `logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)`.

torch.distributions.Categorical's spellings: categorical.py (its edits are Edits too).

Each edit is tentative (``Edit``): ``settle`` puts the user's spelling back when no rewrite
consumed the edited nodes, so the pass changes nothing where it does not fuse.
"""
import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from lowerings.naive_fusion.match import _lead_op
from lowerings.naive_fusion.nodes import (_LOG_SOFTMAX, _arg, _is, _is_gemm, _last_dim, _recreate, _record, _refresh,
                                          _same_size, _val)

# in-place op (method name or function) -> its out-of-place function
_METHODS = {"div_": operator.truediv, "mul_": operator.mul}
_FNS = {operator.itruediv: operator.truediv, operator.imul: operator.mul}


@dataclasses.dataclass
class Edit:
    """One normalization: the nodes it erased ((node, op, target, args, kwargs, meta), users
    before their inputs), the nodes it created (in graph order) and `stands_for`: for each
    created node readers read, what they read before (an erased node or not)."""
    erased: list
    created: list
    stands_for: dict

    def used(self) -> bool:
        """Whether a rewrite consumed the edited computation (erased a created node)."""
        return any(getattr(n, "_erased", False) for n in self.created)

    def undo(self, graph: Graph) -> dict:
        """The erased nodes back (inputs first, before the first created node), the readers
        back on them, the created nodes erased; returns {erased node: its re-creation}."""
        back = _recreate(graph, self.erased, self.created[0])
        # every reader, also one a row-loop fold's undo made after the edit (loops.Fold.undo)
        for new, old in self.stands_for.items():
            new.replace_all_uses_with(back.get(old, old))
        for n in reversed(self.created):
            graph.erase_node(n)
        return back


def _found(match, *args) -> Any:
    """match(*args); None when it raises: a matcher bug costs the edit, never the user's compile."""
    try:
        return match(*args)
    except Exception:   # noqa: BLE001
        return None


def _safely(check) -> bool:
    """check() as a bool; False when it raises (_found)."""
    return bool(_found(check))


def _made(graph: Graph, nodes: list) -> bool:
    """The created nodes' values computed from their inputs'; when that fails they are erased
    (nothing reads them yet) and the edit is not made."""
    if _safely(lambda: _refresh(graph, nodes) or True):
        return True
    for n in reversed(nodes):
        graph.erase_node(n)
    return False


def _from_gemm(x: Node, depth: int = 12) -> bool:
    """x is a GEMM's output, or reached from one through single-user nodes."""
    n = x
    for _ in range(depth):
        if _is_gemm(n):
            return True
        ins = [a for a in n.all_input_nodes if _val(a) is not None]
        if n.op not in ("call_function", "call_method") or not ins or len(ins[0].users) != 1 \
                or not (n.args and n.args[0] is ins[0]):
            return False
        n = ins[0]
    return False


def _all_after(graph: Graph, m: Node, nodes: list) -> bool:
    """Every node of `nodes` comes after m in the graph (a walk from m; only in-place ops on a
    GEMM's output get here, so the walk is rare)."""
    left = set(nodes)
    n = m.next
    while left and n.op != "root":
        left.discard(n)
        n = n.next
    return not left


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
        readers = [u for u in x.users if u is not m]
        if (readers and m.users) or not _safely(     # both names read after it: not a case
                lambda: _from_gemm(x) and _keeps_x(x, c) and _all_after(graph, m, readers)):  # noqa: B023
            continue
        with graph.inserting_before(m):
            new = graph.call_function(fn, (x, c))
        new.meta = dict(m.meta)
        if not _made(graph, [new]):     # its own value (m's is x's, the same tensor)
            continue
        old = m if m.users else x
        for reader in readers or list(m.users):
            reader.replace_input_with(old, new)
        edits.append(Edit([_record(m)], [new], {new: old}))
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
        if vx is None or len(x.users) != 1 or not _safely(
                lambda: _from_gemm(x) and _last_dim(_arg(ls, 1, "dim", None), vx.dim())  # noqa: B023
                and _lead_op(view, ls) is not None and view.args[0] is ls):  # noqa: B023
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
        if not _made(graph, [v2, ls2]):
            continue
        view.replace_all_uses_with(ls2)
        erased = [_record(view), _record(ls)]
        graph.erase_node(view)
        graph.erase_node(ls)
        edits.append(Edit(erased, [v2, ls2], {ls2: view}))
    return edits


def nll_of_log_softmax(graph: Graph) -> list:
    """Every F.nll_loss(log_softmax(z, class dim), t, ...) of a GEMM's output made
    F.cross_entropy(z, t, ...), which is that by definition (the same arguments, positions and
    names up to `reduction`), when nll_loss calls are all the log_softmax's readers; the Edits."""
    edits = []
    for ls in list(graph.nodes):
        if not (_is(ls, _LOG_SOFTMAX, ("log_softmax",)) and ls.args and isinstance(ls.args[0], Node)
                and ls.users and all(_is(u, (F.nll_loss,)) and u.args and u.args[0] is ls
                                     and "label_smoothing" not in u.kwargs for u in ls.users)):
            continue
        vz = _val(ls.args[0])
        if vz is None or vz.dim() != 2 or not _safely(
                lambda: _from_gemm(ls.args[0]) and _last_dim(_arg(ls, 1, "dim", None), 2)  # noqa: B023
                and _arg(ls, 3 if ls.target is F.log_softmax else 2, "dtype", None) is None):  # noqa: B023
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        nlls = sorted(ls.users, key=order.__getitem__)
        created, stands_for = [], {}
        for nll in nlls:
            with graph.inserting_before(nll):
                ce = graph.call_function(F.cross_entropy, (ls.args[0], *nll.args[1:]), dict(nll.kwargs))
            ce.meta = dict(nll.meta)
            nll.replace_all_uses_with(ce)
            created.append(ce)
            stands_for[ce] = nll
        erased = [_record(n) for n in reversed(nlls)] + [_record(ls)]
        for n in nlls:
            graph.erase_node(n)
        graph.erase_node(ls)
        edits.append(Edit(erased, created, stands_for))
    return edits


def _arange_of_dim(n: Any, j: int, lead: tuple) -> bool:
    """n is torch.arange(lead[j]) shaped to index dim j of `lead` by broadcasting (its size at
    dim j of the key's broadcast, 1 elsewhere), through unsqueeze / None indexing / view."""
    v = _val(n) if isinstance(n, Node) else None
    k = len(lead)
    if v is None or v.dtype != torch.int64 or v.dim() > k or v.numel() != lead[j] \
            or any(d != (lead[j] if i == j else 1) for i, d in zip(range(k - v.dim(), k), v.shape)):
        return False
    for _ in range(8):
        if _is(n, (torch.arange,)):
            args = [a for a in n.args]
            return (args == [lead[j]] or args == [0, lead[j]]) and set(n.kwargs) <= {"device", "dtype"}
        if not (isinstance(n, Node) and n.args and isinstance(n.args[0], Node)
                and (_is(n, (torch.unsqueeze,), ("unsqueeze", "view", "reshape"))
                     or (n.op == "call_function" and n.target is operator.getitem
                         and all(x is None or x == slice(None) or x is Ellipsis
                                 for x in (n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)))))):
            return False
        n = n.args[0]
    return False


def _fancy_gather(g: Node, lp: Node, key: tuple, ids: Any) -> bool:
    """g = lp[aranges..., ids] picks lp[..., ids[...]] at every leading index (see below)."""
    vl, vg = _val(lp), _val(g)
    vi = _val(ids) if isinstance(ids, Node) else None
    if vl is None or vg is None or vi is None or vi.dtype != torch.int64 or len(key) != vl.dim():
        return False
    lead = tuple(vl.shape[:-1])
    return tuple(vi.shape) == lead and tuple(vg.shape) == lead and all(isinstance(d, int) for d in lead) \
        and all(_arange_of_dim(a, j, lead) for j, a in enumerate(key[:-1])) and _from_gemm(lp.args[0])


def fancy_index_as_gather(graph: Graph) -> list:
    """Every `logp[arange(N), ids]` / `logp[arange(B)[:, None], arange(T)[None, :], ids]` of a
    log_softmax of a GEMM's output made `logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)`: the
    aranges pick every leading index once, in order, so both read logp[..., ids[...]]; the
    Edits."""
    edits = []
    for g in list(graph.nodes):
        if not (g.op == "call_function" and g.target is operator.getitem and isinstance(g.args[1], tuple)
                and isinstance(g.args[0], Node) and _is(g.args[0], _LOG_SOFTMAX, ("log_softmax",))):
            continue
        lp, key = g.args
        ids = key[-1] if key else None
        if not _safely(lambda: _fancy_gather(g, lp, key, ids)):  # noqa: B023
            continue
        with graph.inserting_before(g):
            idx = graph.call_method("unsqueeze", (ids, -1))
            gat = graph.call_method("gather", (lp, -1, idx))
            out = graph.call_method("squeeze", (gat, -1))
        for n in (idx, gat, out):
            n.meta = dict(g.meta)
        if not _made(graph, [idx, gat, out]):
            continue
        g.replace_all_uses_with(out)
        erased = [_record(g)]
        graph.erase_node(g)
        edits.append(Edit(erased, [idx, gat, out], {out: g}))
    return edits


def settle(graph: Graph, edits: list) -> int:
    """After the matchers: undo every edit no rewrite consumed, latest first; how many were kept."""
    kept, back = 0, {}
    for e in reversed(edits):
        # an edit may have erased what an earlier one created (nll_of_log_softmax the log_softmax
        # views_before_log_softmax made): that earlier edit sees the re-creation
        e.created = [back.get(n, n) for n in e.created]
        e.stands_for = {back.get(n, n): old for n, old in e.stands_for.items()}
        if e.used():
            kept += 1
        else:
            back.update(e.undo(graph))
    return kept
