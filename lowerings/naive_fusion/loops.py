"""Row loops folded back into one batched computation, before the matchers run.

Trainers loop over the rows of the logits to bound their memory, and Dynamo unrolls the loop:

    torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])            # TRL, verl (fp32)
    torch.stack([F.log_softmax(r, -1).gather(-1, i) for r, i in zip(logits, index)])   # (bf16)
    torch.cat([entropy(c) for c in logits.reshape(-1, V).split(k, dim=0)], dim=0)      # TRL

    buf = torch.zeros(N); for i in range(0, N, k): buf[i:i + k] = entropy(X[i:i + k].float())  # verl

records one copy of the row's ops per row: ``f(X[0]), f(X[1]), ...`` then stack,
``f(S[0]), f(S[1]), ...`` of ``S = X.split(k, 0)`` then cat, or ``buf[a:b] = f(X[a:b])`` writes
into a fresh buffer. Every copy reads the logits, so the
matchers see them used by B getitems and leave them alone. ``fold_row_loops`` replaces such a
stack / cat by ``f(X)`` (f's ops once, on the whole tensor) when it can prove that equal:

  - the items are f applied to row i (``X[i]``, ``Y[i]``: one int index per row input, in order,
    covering X's leading dim) or to chunk i of splits of dim 0 covering X, for every i (every
    split of the same chunk size over the same number of rows, so chunk i is the same rows);
    for writes, slices ``[a_i:b_i]`` of dim 0, contiguous from 0 to the buffer's (and X's)
    length, the buffer a fresh zeros / empty that nothing reads between the writes (its later
    readers read f(X), cast to the buffer's dtype as the writes cast);
  - the copies are the same ops with the same non-tensor arguments (the same graph up to the row
    inputs), and every op is row-wise: elementwise ops and casts, and last-dim ops
    (log_softmax, softmax, logsumexp, gather, sum, unsqueeze, squeeze, with their dims given)
    whose dims are rewritten counting from the end, so that they name the same dim of X; no
    tensor other than the row inputs enters f (a shared tensor could broadcast differently).

Anything else is left as it is (the matchers then count it as ``logits_users``). The folded
graph computes the same values: each row's result is f of that row, and stack over dim 0 (cat
of the chunks) is what f on the whole tensor gives row by row. A fold is tentative: the loop's
erased nodes are recorded (``Fold``), and ``settle_folds`` puts back every loop whose fold no
rewrite used, so the pass changes nothing where it does not fuse.
"""
import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from lowerings.naive_fusion.loop_items import (_dim_spec, _row_input, _row_ndim, _signature, _slice_key, _subgraph,
                                               _whole)
from lowerings.naive_fusion.nodes import _erase_dead, _recreate, _record, _refresh, _same_size, _val

@dataclasses.dataclass
class Fold:
    """One folded loop: `out` (the last of the `created` nodes) stands where the stack / cat
    `joint` was; `erased` records the loop's nodes (nodes._erase_dead's record)."""
    joint: Node
    out: Node
    created: list
    erased: list

    def used(self) -> bool:
        """Whether a rewrite consumed the folded computation (erased some of its nodes)."""
        return any(getattr(n, "_erased", False) for n in self.created)

    def undo(self, graph: Graph) -> None:
        """Put the loop back as it was (its nodes recreated, inputs first, before `out`) and
        erase the folded computation."""
        new = _recreate(graph, self.erased, self.out)
        self.out.replace_all_uses_with(new[self.joint])
        _erase_dead(graph, [self.out])


def _fold(graph: Graph, joint: Node) -> Optional[Fold]:
    items = joint.args[0] if joint.args else None
    dim = joint.args[1] if len(joint.args) > 1 else joint.kwargs.get("dim", 0)
    if not isinstance(items, (list, tuple)) or not items or not isinstance(dim, int) \
            or not all(isinstance(x, Node) and _val(x) is not None for x in items):
        return None
    kind = "row" if joint.target is torch.stack else "chunk"
    subs = [_subgraph(x, i) for i, x in enumerate(items)] if dim == 0 else [None]
    if kind == "chunk" and any(s is None for s in subs):   # cat of f(X[a:b]) over fixed slices
        bounds = [_item_slice(x) for x in items]
        if all(b is not None and b[0] == dim % _val(x).dim() for b, x in zip(bounds, items)):
            kind, subs = "slice", [_subgraph(x, b) for x, b in zip(items, bounds)]
    elif dim != 0:
        return None
    f_nodes = _one_f(graph, subs, kind)
    if f_nodes is None:
        return None
    if kind == "slice" and not _slices_cover(bounds, {src for _, _, srcs in subs for src, _ in srcs}):
        return None
    # the items cover the source: rows 0..B-1 of X, or every chunk of the split(s)
    sources = {src for _, _, srcs in subs for src, _ in srcs} if kind != "slice" else set()
    for src in sources:
        if kind == "row":
            v = _val(src)
            if v is None or not _same_size(v.shape[0], len(items)):
                return None
        else:
            whole = _val(src.args[0])
            k = src.args[1]
            if whole is None or not _same_size((whole.shape[0] + k - 1) // k, len(items)):
                return None
    if kind == "chunk":   # chunk i of every source holds the same rows: one size, one length
        first = next(iter(sources))
        n0 = _val(first.args[0]).shape[0]
        if any(src.args[1] != first.args[1] or not _same_size(_val(src.args[0]).shape[0], n0)
               for src in sources):
            return None
    row_inputs0 = subs[0][1]
    env, created = {}, []
    try:
        if not _build(graph, joint, kind, f_nodes, row_inputs0, env, created):
            raise ValueError("not foldable")
        _refresh(graph, created)
    except Exception:
        for n in reversed(created):     # leave the graph as it was
            graph.erase_node(n)
        return None
    joint.replace_all_uses_with(env[items[0]])
    erased: list = []
    _erase_dead(graph, [joint], record=erased)
    return Fold(joint, env[items[0]], created, erased)


def _item_slice(item: Node) -> Optional[tuple]:
    """The one (d, a, b) of every slice row input the item reads (the first one found up its
    inputs decides; _subgraph then checks the others), else None."""
    stack, seen = [item], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        ri = _row_input(n)
        if ri is not None:
            return ri[1] if ri[2] == "slice" else None
        stack.extend(n.all_input_nodes)
    return None


def _slices_cover(bounds: list, sources: set) -> bool:
    """Slices [a_i:b_i] of one dim d, in order from 0, each starting where the one before stopped,
    the last one reaching the end of every source (Python clamps its stop), none empty: cat of f
    over them is f over the whole of each source."""
    dims = {d for d, _, _ in bounds}
    if len(dims) != 1:
        return False
    d = dims.pop()
    lengths = [_val(src).shape[d] for src in sources]
    if not sources or not all(isinstance(n, int) for n in lengths) or len(set(lengths)) != 1:
        return False
    n = lengths[0]
    starts = [a for _, a, _ in bounds]
    stops = [min(b, n) for _, _, b in bounds]
    return (starts[0] == 0 and all(a == b for a, b in zip(starts[1:], stops[:-1]))
            and stops[-1] == n and all(a < b for a, b in zip(starts, stops)))


def _one_f(graph: Graph, subs: list, kind: str) -> Optional[list]:
    """The first copy's f nodes (in graph order) when every copy in `subs` (_subgraph's) is the
    same ops on row inputs of `kind`; None otherwise."""
    if any(s is None for s in subs):
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    sigs = []
    for nodes, row_inputs, sources in subs:
        if any(k != kind for _, k in sources):
            return None
        nodes = sorted(nodes, key=order.__getitem__)
        index = {n: i for i, n in enumerate(nodes)}
        # the row inputs numbered by their source, so that the copies compare
        by_source = {n: (sources[k][0], k) for n, k in row_inputs.items()}
        sig = [_signature(n, index, {n: id(by_source[n][0]) for n in row_inputs}) for n in nodes]
        if any(s is None for s in sig):
            return None
        sigs.append((tuple(sig), nodes))
    if any(s != sigs[0][0] for s, _ in sigs):
        return None
    return sigs[0][1]


# the preallocated result a chunk loop writes into (verl's entropy_from_logits_with_chunking)
_BUFFERS = (torch.zeros, torch.empty, torch.zeros_like, torch.empty_like)


def _fold_writes(graph: Graph, buf: Node) -> Optional[Fold]:
    """buf = torch.zeros(N); buf[a_i:b_i] = f(X[a_i:b_i]) for chunks covering 0..N in order,
    nothing reading buf between the writes: buf's later readers read f(X) (cast to buf's dtype,
    as the writes cast), the writes and their chunks' copies of f erased (recorded)."""
    if sum(u.target is operator.setitem for u in buf.users) < 2:   # most zeros are no such buffer
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = sorted(buf.users, key=order.__getitem__)
    writes = [u for u in users if u.op == "call_function" and u.target is operator.setitem
              and u.args[0] is buf and len(u.args) == 3 and isinstance(u.args[2], Node)]
    vb = _val(buf)
    if len(writes) < 2 or vb is None or vb.dim() < 1 \
            or any(order[u] < order[writes[-1]] for u in users if u not in writes):
        return None
    bounds = [_slice_key(w.args[1]) for w in writes]
    if any(b is None or b[0] >= vb.dim() for b in bounds) \
            or not all(isinstance(n, int) for n in vb.shape) \
            or not _slices_cover(bounds, {buf}):
        return None
    d = bounds[0][0]
    items = [w.args[2] for w in writes]
    subs = [_subgraph(x, b) for x, b in zip(items, bounds)]
    f_nodes = _one_f(graph, subs, "slice")
    if f_nodes is None:
        return None
    sources = {src for _, _, srcs in subs for src, _ in srcs}
    vi = _val(items[0])
    if vi is None or vi.dim() != vb.dim() \
            or any(_val(src) is None or not _same_size(_val(src).shape[d], vb.shape[d]) for src in sources) \
            or any(a != b for i, (a, b) in enumerate(zip(vi.shape, vb.shape)) if i != d):
        return None
    env, created = {}, []
    try:
        if not _build(graph, writes[-1], "slice", f_nodes, subs[0][1], env, created):
            raise ValueError("not foldable")
        _refresh(graph, created)
        out = env[items[0]]
        if _val(out).dtype != vb.dtype:
            with graph.inserting_before(writes[-1]):
                out = graph.call_method("to", (out, vb.dtype))
            created.append(out)
            _refresh(graph, [out])
        if tuple(_val(out).shape) != tuple(vb.shape):
            raise ValueError("not the buffer's shape")
    except Exception:
        for n in reversed(created):     # leave the graph as it was
            graph.erase_node(n)
        return None
    for u in users:
        if u not in writes:
            u.replace_input_with(buf, out)
    erased: list = []
    for w in reversed(writes):          # recorded last write first: undo puts them back in order
        erased.append(_record(w))
        graph.erase_node(w)
    _erase_dead(graph, [buf, *items], record=erased)
    return Fold(buf, out, created, erased)


def _build(graph: Graph, joint: Node, kind: str, f_nodes: list, row_inputs0: dict, env: dict,
           created: list) -> bool:
    """f's nodes once more, on the whole tensors, before `joint` (env: old -> new nodes)."""
    unflat = {}
    if kind == "chunk":   # chunks of X.reshape(-1, V): f on X itself, its result flattened after
        flats = {r.args[0].args[0] for r in row_inputs0}
        unflat = {x: _unflatten(x) for x in flats}
        us = list(unflat.values())
        if any(u is None for u in us) or any(
                _val(u).dim() != _val(us[0]).dim()
                or not all(_same_size(a, b)
                           for a, b in zip(_val(u).shape[:-1], _val(us[0]).shape[:-1])) for u in us):
            unflat = {}     # chunk sources of different leading shapes: keep the flat ones
    with graph.inserting_before(joint):
        for r, _k in row_inputs0.items():
            src = r.args[0]
            if kind == "slice":
                env[r] = _whole(graph, r)
                if env[r] is not src:
                    created.append(env[r])
            else:
                env[r] = src if kind == "row" else unflat.get(src.args[0], src.args[0])
        for n in f_nodes:
            nd = _row_ndim(n.args[0]) if n.args and isinstance(n.args[0], Node) else None

            def sub(a):
                if isinstance(a, Node):
                    return env.get(a, a)
                if isinstance(a, (list, tuple)):
                    return type(a)(sub(x) for x in a)
                return a
            args, kwargs = list(sub(tuple(n.args))), {k: sub(v) for k, v in n.kwargs.items()}
            spec = _dim_spec(n)
            if spec is not None:
                pos, kw = spec
                d = args[pos] if pos < len(args) else kwargs.get(kw)
                if not isinstance(d, int) or isinstance(d, bool) or nd is None:
                    return False
                # the dim counted from the end: the same dim of the row and of the whole tensor
                # (unsqueeze counts in its output: one more dim)
                rank = nd + 1 if n.target in (torch.unsqueeze, "unsqueeze") else nd
                d = d - rank if d >= 0 else d
                if kind == "slice" and d != -1:
                    return False    # a slice keeps its dims: only the last one is row-wise
                if pos < len(args):
                    args[pos] = d
                else:
                    kwargs[kw] = d
            new = graph.create_node(n.op, n.target, tuple(args), kwargs)
            created.append(new)
            new.meta = dict(n.meta)
            new.meta["example_value"] = None
            env[n] = new
        if unflat:
            item = next(iter(joint.args[0]))
            tail = tuple(_val(item).shape[1:])
            if not all(isinstance(d, int) for d in tail):
                return False
            out = graph.call_method("reshape", (env[item], -1, *tail))   # [N, *tail] as the cat's
            out.meta = dict(joint.meta)
            created.append(out)
            env[item] = out
    return True


def _unflatten(x: Node) -> Optional[Node]:
    """U for x = U.reshape(-1, V) / U.view(-1, V) / U.flatten(0, -2) of a U [..., V] with at
    least two dims; None otherwise."""
    vx = _val(x)
    if vx is None or vx.dim() != 2 or not isinstance(x, Node) or not x.args or not isinstance(x.args[0], Node):
        return None
    u, vu = x.args[0], _val(x.args[0])
    if vu is None or vu.dim() < 2 or vu.shape[-1] != vx.shape[-1]:
        return None
    if (x.op == "call_method" and x.target in ("reshape", "view")) or (x.op == "call_function" and x.target is torch.reshape):
        sizes = x.args[1:] if not (len(x.args) == 2 and isinstance(x.args[1], (list, tuple))) else x.args[1]
        ok = len(sizes) == 2 and sizes[0] == -1 and _same_size(sizes[1], vu.shape[-1])
        return u if ok and not x.kwargs else None
    if (x.op == "call_method" and x.target == "flatten") or (x.op == "call_function" and x.target is torch.flatten):
        start = x.args[1] if len(x.args) > 1 else x.kwargs.get("start_dim", 0)
        end = x.args[2] if len(x.args) > 2 else x.kwargs.get("end_dim", -1)
        return u if start == 0 and end in (-2, vu.dim() - 2) else None
    return None


def fold_row_loops(graph: Graph) -> list:
    """Fold every provable row loop (module docstring); returns the Folds (the row copies are
    erased with the stack / cat, recorded for Fold.undo)."""
    folds = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in (torch.stack, torch.cat) + _BUFFERS:
            continue
        try:
            fold = _fold(graph, n) if n.target in (torch.stack, torch.cat) else _fold_writes(graph, n)
        except Exception:   # noqa: BLE001  a fold that cannot be proved is not made
            continue
        if fold is not None:
            folds.append(fold)
    return folds


def settle_folds(graph: Graph, folds: list) -> int:
    """After the matchers: undo every fold no rewrite consumed (its loop back as the user wrote
    it: the same ops, the same memory), latest first; returns how many were kept."""
    kept = 0
    for fold in reversed(folds):
        if fold.used():
            kept += 1
        else:
            fold.undo(graph)
    return kept
