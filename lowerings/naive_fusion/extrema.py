"""Logits min / max metrics beside the log-probs: matched as consumers, replaced by
`linear_logits_extrema` (lowerings/linear_logprobs/extrema.py).

Trainers log each row's least and greatest logit next to the loss:

    z.detach().min(-1).values, z.detach().max(-1)[0], z.detach().amax(-1, keepdim=True),
    torch.amin(z.detach(), dim=-1), z.detach().max()          (or the same under torch.no_grad())

Each reads the [N, V] logits through one [N] reduction, which kept the logits whole
(`logits_users`). Matched here, they become the extrema op's (min, max) of the same h, W, b and
scaling as the log-prob call, so the logits never exist; the op costs one forward GEMM more
(its docstring). Only values without a gradient are replaced: a `.detach()` between, a
`torch.no_grad()` region (region.no_grad_nodes), or logits that need no grad; a differentiable
max (its argmax's gradient) and the indices of `.max(-1)` stay `logits_users`.
"""
import operator
from typing import NamedTuple, Optional

import torch
from torch.fx import Graph, Node

from lowerings.linear_logprobs.extrema import linear_logits_extrema
from lowerings.naive_fusion.nodes import _FLOATS, _arg, _cast_dtype, _is, _last_dim, _val

_MIN = ((torch.min, torch.amin), ("min", "amin"))
_MAX = ((torch.max, torch.amax), ("max", "amax"))


class Extremum(NamedTuple):
    """One metric: `node` the value replaced, `kind` "min" / "max", `keepdim`, `whole` (a
    reduction over every element: the rows' extrema reduced again), `detached` (read through a
    `.detach()`), `reduction` the min / max node itself."""
    node: Node
    kind: str
    keepdim: bool
    whole: bool
    detached: bool
    reduction: Node


def linear_logits_extrema_call(hidden, weight, bias, temperature, fp32_lm_head, logit_scale=1.0,
                               final_logit_softcapping=None):
    """The call the pass inserts: a stable FX target returning (min, max) [...] fp32."""
    return linear_logits_extrema(hidden, weight, bias, temperature=temperature,
                                 fp32_lm_head=fp32_lm_head, logit_scale=logit_scale,
                                 final_logit_softcapping=final_logit_softcapping)


def _reduction(r: Node, x: Node, nd: int, detached: bool) -> Optional[list]:
    """The Extremum list of a min / max / amin / amax `r` of `x` (the logits or their detach),
    None for anything else (another dim, the indices read, dtype arguments)."""
    kind = "min" if _is(r, *_MIN) else "max" if _is(r, *_MAX) else None
    if kind is None or not r.args or r.args[0] is not x or len(r.args) + len(r.kwargs) > 3:
        return None
    amin_amax = r.target in (torch.amin, torch.amax, "amin", "amax")
    dim, keepdim = _arg(r, 1, "dim", None), _arg(r, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else (None if amin_amax and not dim else False)
    if not isinstance(keepdim, bool) or dim is False or any(
            k not in ("dim", "keepdim") for k in r.kwargs):
        return None
    if dim is None:                              # every element: z.max(), torch.amax(z)
        return None if keepdim else [Extremum(r, kind, False, True, detached, r)]
    if not _last_dim(dim, nd):
        return None
    if amin_amax:
        return [Extremum(r, kind, keepdim, False, detached, r)]
    # min / max with a dim: (values, indices); only the values may be read
    if not r.users or any(not (g.op == "call_function" and g.target is operator.getitem
                               and g.args[0] is r and g.args[1] == 0) for g in r.users):
        return None
    return [Extremum(g, kind, keepdim, False, detached, r) for g in r.users]


def extrema_consumer(u: Node, Ls: set, nd: int, detached: bool = False, depth: int = 3) -> Optional[list]:
    """The metrics that logits user `u` (of a node in Ls: the logits, or a float cast of them)
    computes: a reduction of them, or a `.detach()` / float cast of them read by such users
    only. None when `u` is something else."""
    if not u.args or u.args[0] not in Ls:
        return None
    if depth and u.users and ((_is(u, (torch.detach,), ("detach",)) and len(u.args) == 1
                               and not u.kwargs) or _cast_dtype(u) in _FLOATS):
        is_detach = _cast_dtype(u) not in _FLOATS
        found = [extrema_consumer(r, {u}, nd, detached or is_detach, depth - 1) for r in u.users]
        return None if any(f is None for f in found) else [e for f in found for e in f]
    return _reduction(u, u.args[0], nd, detached)


def grad_free(extrema: list, frozen: set, L: Node) -> bool:
    """Every metric's value carries no gradient: detached, computed under no_grad, or of logits
    that need none (a reference model's head, an inference graph)."""
    vL = _val(L)
    return all(e.detached or e.reduction in frozen or (vL is not None and not vL.requires_grad)
               for e in extrema)


def replace_extrema(graph: Graph, extrema: list, h: Node, w: Node, bias: Optional[Node],
                    scaling: tuple, fp32_lm_head: bool) -> list:
    """Insert one extrema call of h, W, b and the op's (temperature, logit_scale, cap) scaling (at
    the graph's insertion point) and give each metric its value in its own dtype; returns the
    nodes to erase."""
    temperature, scale, cap = scaling
    extra = () if cap is None else (float(scale), float(cap))
    out = graph.call_function(linear_logits_extrema_call,
                              (h, w, bias, float(temperature), bool(fp32_lm_head), *extra))
    lo, hi = (graph.call_function(operator.getitem, (out, i)) for i in range(2))
    for e in extrema:
        r = lo if e.kind == "min" else hi
        if e.whole:
            r = graph.call_method("amin" if e.kind == "min" else "amax", (r,))
        elif e.keepdim:
            r = graph.call_method("unsqueeze", (r, -1))
        dt = _val(e.node).dtype
        e.node.replace_all_uses_with(r if dt == torch.float32 else graph.call_method("to", (r, dt)))
    return [e.node for e in extrema] + [e.reduction for e in extrema]


def replace_side(graph: Graph, side: dict, h: Node, w: Node, bias: Optional[Node],
                 fp32_lm_head: bool) -> list:
    """replace_extrema for the metrics of a chain node before the logits (match._walk_logits'
    "sides"): h with that node's leading-dim views, the bias if it was added by then (scaled as
    the rewrite scales it: a bias added before a scale)."""
    b = None if side["bias"] is None else bias
    if b is not None and side["bias_temp"] != side["temp"]:
        b = graph.call_function(operator.mul, (b, side["temp"] / side["bias_temp"]))
    return replace_extrema(graph, side["extrema"], h, w, b, side["scaling"], fp32_lm_head)


def all_extrema(c: dict, wk: dict) -> list:
    """Every min / max metric of a match: of the logits (c) and of chain nodes before them (wk)."""
    return c["extrema"] + [e for side in wk["sides"] for e in side["extrema"]]
