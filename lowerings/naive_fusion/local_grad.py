"""A row block's gradient of a token-separable loss (separable.py), from its own rows where the
loss allows (R elementwise work a block, not N): the grad_fn the fused schedule calls.

Legend: [...] the log-probs' shape, N = prod, G blocks of R rows, E / A separable.py's classes.

The loss f(lp, ent, inputs) is E nodes (per-token) feeding A nodes (affine, coefficients outside
D). Cut it at the E nodes the A nodes read (the frontier e_1 .. e_k):

    f = f_A(e_1, .., e_k, inputs),   e_j = f_E_j(lp, ent, inputs)

f_A is affine, so c_j = df_A / de_j is one tensor of e_j's shape whatever the e's are: computed
once before the blocks (autograd of f_A; the e's it is evaluated at are only their shapes and
dtypes, which Inductor then drops). A block's gradient is the vector-Jacobian product of f_E at
its rows with the c_j at those rows as cotangents: with every E node per-token in [...] (or
[..., 1], a gather's index before its squeeze: rows.py's forms), f_E runs on [R] vectors, its
views dropped and each input broadcast to [...], flattened and taken at the block's rows (once
for all blocks, in the blocks' row order: fused_linear_logprobs' on_order).

Where an E node is not per-token in that sense (a slice, a gather, a stack of the log-probs)
placed_grad_fn keeps the placement (the block's values at their places in [...], zeros
elsewhere, f's gradient over all N).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from lowerings.naive_fusion.nodes import _cast_dtype, _is, _val
from lowerings.naive_fusion.rows import form_shape

# ops the [R] body drops (a view between the forms, a copy): each row's value stays its own
_DROP_METHODS = ("view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "contiguous",
                 "clone", "broadcast_to", "unsqueeze", "squeeze")
_DROP_FNS = (torch.reshape, torch.clone, torch.broadcast_to, torch.unsqueeze, torch.squeeze)


class LocalLoss(NamedTuple):
    f_full: GraphModule    # (sources, e_inputs) -> the frontier, in [...]
    f_rows: GraphModule    # (sources [R], e_inputs at the rows) -> the frontier at the rows [R]
    f_affine: GraphModule  # (frontier, a_inputs) -> the loss
    e_inputs: list         # nodes outside D that f_E reads
    e_forms: list          # the form of each e_input's consumers (rows.py's), None: not a tensor row input
    a_inputs: list         # nodes outside D that f_A reads


def split(body: list, cls: dict, sources: list, dep: set, loss: Node, forms: dict,
          e_cls: str) -> Optional[LocalLoss]:
    """The loss cut at its frontier (module doc), or None where an E node is not per-token."""
    e_nodes = [n for n in body if cls[n] == e_cls]
    if loss in e_nodes or any(n not in forms for n in e_nodes):
        return None
    e_set = set(e_nodes)
    rest = [n for n in body if n not in e_set]          # A nodes and sizes
    frontier = [n for n in e_nodes if any(u in rest for u in n.users)]
    if not frontier:
        return None
    e_inputs, e_forms = [], []
    for n in e_nodes:
        for a in ([] if n in sources else n.all_input_nodes):
            if a in dep or a in e_inputs:
                continue
            if any(u in e_set and u in forms and forms[u] != forms[n] for u in a.users):
                return None                             # read by nodes of both forms
            if a.meta.get("example_value") is None:
                return None                             # a node the pass inserted: no shape known
            e_inputs.append(a)
            v = _val(a)
            e_forms.append(forms[n] if v is not None and v.dim() > 0 else None)
    try:
        f_full = _graph(sources, e_nodes, e_inputs, frontier, drop=False)
        f_rows = _graph(sources, e_nodes, e_inputs, frontier, drop=True)
    except KeyError:   # an E op reads a size of the log-probs (it would not run on [R] rows)
        return None
    g = Graph()
    env = {n: g.placeholder(f"e{i}") for i, n in enumerate(frontier)}
    a_inputs = []
    for n in rest:
        for a in n.all_input_nodes:
            if a not in env and a not in dep:
                env[a] = g.placeholder(f"in{len(a_inputs)}")
                a_inputs.append(a)
    try:
        for n in rest:
            env[n] = copy_node(g, n, env)
    except KeyError:   # a size of an E node that is not on the frontier
        return None
    g.output(env[loss])
    return LocalLoss(f_full, f_rows, GraphModule(torch.nn.Module(), g), e_inputs, e_forms, a_inputs)


def copy_node(g: Graph, n: Node, env: dict) -> Node:
    """n copied into g (its inputs from env); a value the user computed without a gradient
    (no_grad, .detach()) detached there too."""
    c = g.node_copy(n, lambda a: env[a])
    v = _val(n)
    if v is not None and v.is_floating_point() and not v.requires_grad:
        c = g.call_method("detach", (c,))
    return c


def _graph(sources, e_nodes, e_inputs, frontier, drop: bool) -> GraphModule:
    """f_E as a GraphModule of (sources, e_inputs) -> the frontier; ``drop``: its views and
    copies dropped (the [R] body)."""
    g = Graph()
    env = {s: g.placeholder(f"src{i}") for i, s in enumerate(sources)}
    env.update((a, g.placeholder(f"in{i}")) for i, a in enumerate(e_inputs))
    for n in e_nodes:
        if n in env:
            continue
        if drop and _is(n, _DROP_FNS, _DROP_METHODS) and _cast_dtype(n) is None:
            env[n] = env[n.args[0]]
        else:
            env[n] = copy_node(g, n, env)
    g.output(tuple(env[n] for n in frontier))
    return GraphModule(torch.nn.Module(), g)


def rows_of(t, form, lead: torch.Size):
    """An input of f_E as one value a row ([N]), or as it is (form None: a scalar, a 0-dim
    tensor)."""
    if form is None:
        return t
    return torch.broadcast_to(t, form_shape(form, lead)).reshape(-1)


def coefficients(local: LocalLoss, srcs: list, e_in: list, a_in: list) -> list:
    """c_j [N] (module doc): autograd of the affine part, at the frontier's values (their shapes
    and dtypes are what is read)."""
    fr = local.f_full(*srcs, *e_in)
    grads = torch.func.grad(lambda *e: local.f_affine(*e, *a_in).reshape(()),
                            argnums=tuple(range(len(fr))))(*(x.detach() for x in fr))
    return [c.reshape(-1) for c in grads]


def block_grads(local: LocalLoss, srcs: list, e_rows: list, coefs: list) -> tuple:
    """The gradient of the loss w.r.t. the block's sources [R]: f_E's vector-Jacobian product at
    the block's rows."""
    _, vjp = torch.func.vjp(lambda *s: local.f_rows(*s, *e_rows), *srcs)
    return vjp(tuple(coefs))


def local_grad_fn(f, names, inputs, lead, h2):
    """grad_fn and on_order of a LocalLoss (local_grad.py): R work a block."""
    e_in, a_in = inputs[:len(f.e_inputs)], inputs[len(f.e_inputs):]
    dt = torch.float64 if h2.dtype == torch.float64 else torch.float32
    zeros = [h2.new_zeros(lead, dtype=dt) for _ in names]   # the frontier's shapes and dtypes
    coefs = coefficients(f, zeros, e_in, a_in)                      # [N] each
    rows_in = [rows_of(t, form, lead) for t, form in zip(e_in, f.e_forms)]
    ordered = {}

    def on_order(perm):   # perm [G R]: every per-row tensor in the blocks' order, once
        ordered["in"] = [t.index_select(0, perm) if form is not None else t
                         for t, form in zip(rows_in, f.e_forms)]
        ordered["c"] = [c.index_select(0, perm) for c in coefs]

    def grad_fn(r0, idx, lp, ent):
        r = lp.shape[0]
        e_rows = [t.narrow(0, r0, r) if form is not None else t
                  for t, form in zip(ordered["in"], f.e_forms)]
        c_rows = [c.narrow(0, r0, r) for c in ordered["c"]]
        vals = {"lp": lp, "ent": ent}
        gs = dict(zip(names, block_grads(f, [vals[k] for k in names], e_rows, c_rows)))
        zero = torch.zeros_like(lp)
        return tuple(gs[k].to(lp.dtype) if k in gs else zero for k in ("lp", "ent"))

    return grad_fn, on_order


def placed_grad_fn(f, names, inputs, lead, n, total):
    """grad_fn and on_order of a loss f that split cannot cut: the block's values placed
    in [...], zeros elsewhere, f's gradient over all N tokens (N work a block)."""
    grad = torch.func.grad(lambda *a: f(*a).reshape(()), argnums=tuple(range(len(names))))
    inv = {}

    def on_order(perm):   # perm [G R]: its first N slots are a permutation of the rows
        inv["slot"] = torch.argsort(perm.narrow(0, 0, n))                   # [N] row -> slot

    def grad_fn(r0, idx, lp, ent):   # idx: the rows of slots r0 .. r0 + R
        # (torch.cat, not F.pad: with F.pad(g.reshape(-1), (0, total - n)).narrow(0, r0, rows)
        # in the former take, torch 2.13's Inductor CPU code got a block's gradient wrong, eager
        # right: test_separable_loss_takes_the_fused_schedule[grpo-seq-mean-entropy])
        def place(t):   # the block's values at their rows in [...], zeros elsewhere
            slots = torch.cat([t.new_zeros(r0), t, t.new_zeros(total - r0 - t.shape[0])])
            return slots.index_select(0, inv["slot"]).view(lead)

        def take(g):    # the block's rows of a [...] gradient
            return g.reshape(-1).index_select(0, idx).to(lp.dtype)

        vals = {"lp": lp, "ent": ent}
        gs = dict(zip(names, grad(*(place(vals[k]) for k in names), *inputs)))
        zero = torch.zeros_like(lp)
        return (take(gs["lp"]) if "lp" in gs else zero), (take(gs["ent"]) if "ent" in gs else zero)

    return grad_fn, on_order
