"""Which in-place ops and grad-mode switches the naive-fusion pass's rewrite may move across.

A `torch.no_grad()` region holding consumers only (no_grad_nodes) is one it may: the call then
stands before the region, and what a consumer inside computed is replaced by a detached value.

The rewrite puts one `linear_logprobs` call where the first consumer of the logits stood: it
reads h, W, b, the temperatures and the ids there, not where the GEMM stood. A write between the
two is harmless when it cannot reach anything the call reads: a tensor the graph made itself
(a clone, zeros, ...) whose memory none of those share, written before the first consumer
(ROLL's `labels = ids[:, 1:].clone(); labels[labels == -100] = 0`). Anything else refuses the
rewrite (counted as "region").
"""
import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from lowerings.naive_fusion.nodes import _REGION_FNS, _mutating

# ops whose result may share its input's memory (args[0]): what an in-place op's write reaches
_ALIAS_FNS = (operator.getitem, torch.reshape, torch.squeeze, torch.unsqueeze, torch.flatten, torch.transpose,
              torch.permute, torch.narrow, torch.select, torch.detach, torch.t, torch.split, torch.chunk,
              torch.unbind, torch.movedim, torch.swapaxes, torch.diagonal)
_ALIAS_METHODS = ("view", "view_as", "reshape", "reshape_as", "squeeze", "unsqueeze", "flatten", "unflatten",
                  "transpose", "permute", "t", "expand", "expand_as", "narrow", "select", "detach", "contiguous",
                  "float", "half", "bfloat16", "to", "type", "type_as", "split", "chunk", "unbind", "movedim",
                  "swapaxes", "diagonal", "as_strided", "__getitem__")
# ops that make a new tensor, owned by the graph
_FRESH_FNS = (torch.clone, torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like,
              torch.empty_like, torch.full_like)
_FRESH_METHODS = ("clone", "new_zeros", "new_ones", "new_empty", "new_full")


def _root(n: Any) -> Any:
    """The node whose memory n may be a view of (n itself when it makes its own)."""
    for _ in range(64):
        if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
            return n
        if not ((n.op == "call_function" and n.target in _ALIAS_FNS)
                or (n.op == "call_method" and n.target in _ALIAS_METHODS)):
            return n
        n = n.args[0]
    return n


def _private_write(n: Node, reads: set) -> bool:
    """In-place op n writes a tensor the graph made itself (a clone, zeros, ...) that is none of
    `reads` (roots of what the rewrite reads where it stands: h, W, b, temperatures): e.g. ROLL's
    `labels = ids[:, 1:].clone(); labels[labels == -100] = 0` before the gather."""
    r = _root(n.args[0]) if n.args else None
    return isinstance(r, Node) and r not in reads and (
        (r.op == "call_function" and r.target in _FRESH_FNS)
        or (r.op == "call_method" and r.target in _FRESH_METHODS))


def no_grad_nodes(graph: Graph, first: Node, last: Node) -> Optional[set]:
    """The nodes between ``first`` and ``last`` that run with grad mode off (``torch.no_grad()``
    regions: Dynamo records `_set_grad_enabled(False)` ... `_set_grad_enabled(True)`; TRL's
    entropy beside the log-probs with ``entropy_requires_grad=False``). A head wholly inside one
    region (a reference model's under no_grad) gives the empty set: the call stands there too.
    None when a switch's argument is not a constant, or grad mode is off at ``first`` (the
    graph's state from its start) and switches on before ``last``."""
    inside, off, found, off_at_first = False, False, set(), False
    for n in graph.nodes:
        if n is first:
            inside, off_at_first = True, off
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            if len(n.args) != 1 or not isinstance(n.args[0], bool) or (inside and off_at_first):
                return None
            off = not n.args[0]
        elif inside and off and not off_at_first:
            found.add(n)
        if n is last:
            break
    return found


def _region_is_clean(graph: Graph, first: Node, last: Node, anchor: Optional[Node] = None,
                     reads: tuple = (), no_grad_ok: bool = False) -> bool:
    """No in-place op or grad-mode switch between the GEMM and its last consumer, except, before
    `anchor` (where the rewrite's call goes: it reads h, W, b and the ids there, the consumers
    read the ids there too), writes to the graph's own tensors that none of `reads` shares. An
    autocast switch is harmless: the rewrite casts the GEMM's operands as autocast did
    (``autocast``) and gives each replaced value the dtype the naive node had. ``no_grad_ok``:
    grad-mode switches too (the caller detaches what the no-grad regions computed)."""
    inside, before, roots = False, anchor is not None, {_root(x) for x in reads if isinstance(x, Node)}
    for n in graph.nodes:
        inside = inside or n is first
        before = before and n is not anchor
        if inside and n.op == "call_function" and n.target in _REGION_FNS[:1] and not no_grad_ok:
            return False
        if inside and _mutating(n) and not (before and _private_write(n, roots)):
            return False
        if n is last:
            return True
    return True
