"""A row loop's item as a row-wise computation (loops.py): which nodes are its row inputs
(`X[i]`, a chunk of `X.split(k, 0)`, a slice `X[a:b]` of one dim), which ops may sit between
them and the item (elementwise ops and casts, last-dim ops with their dims given), and the
signature two items' computations must share to be one f applied row by row (loops.py's
module docstring says why that makes the fold equal).
"""
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from lowerings.naive_fusion.nodes import _val

# f's ops: elementwise (any tensor arguments must be row values) ...
_ELEMENTWISE_FNS = (torch.exp, torch.log, torch.neg, torch.tanh, operator.neg, operator.add, operator.sub,
                    operator.mul, operator.truediv, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide)
_ELEMENTWISE_METHODS = ("exp", "log", "neg", "tanh", "add", "sub", "mul", "div", "float", "bfloat16", "half",
                        "to")
# ... and ops on given dims: name -> (positional index of dim, keyword)
_DIM_FNS = {torch.log_softmax: (1, "dim"), F.log_softmax: (1, "dim"), torch.softmax: (1, "dim"),
            F.softmax: (1, "dim"), torch.logsumexp: (1, "dim"), torch.gather: (1, "dim"),
            torch.sum: (1, "dim"), torch.unsqueeze: (1, "dim"), torch.squeeze: (1, "dim")}
_DIM_METHODS = {"log_softmax": (1, "dim"), "softmax": (1, "dim"), "logsumexp": (1, "dim"), "gather": (1, "dim"),
                "sum": (1, "dim"), "unsqueeze": (1, "dim"), "squeeze": (1, "dim")}


def _slice_key(key) -> Optional[tuple]:
    """(d, start, stop) of a slice of one dim d with int bounds and no step, every dim before
    it whole and only new axes after it: X[a:b], X[:, a:b], ids[:, a:b, None]; None otherwise."""
    parts = key if isinstance(key, tuple) else (key,)
    at = [i for i, k in enumerate(parts) if isinstance(k, slice) and k != slice(None)]
    if len(at) != 1 or any(k != slice(None) for k in parts[:at[0]]) \
            or any(k is not None for k in parts[at[0] + 1:]):
        return None
    d, k = at[0], parts[at[0]]
    start = 0 if k.start is None else k.start
    if k.step is not None or not isinstance(start, int) or not isinstance(k.stop, int) \
            or isinstance(start, bool):
        return None
    return d, start, k.stop


def _whole(graph: Graph, r: Node) -> Node:
    """What the slice row input r = X[key] reads of all of X: X, or X with key's new axes."""
    src, key = r.args
    if not isinstance(key, tuple) or all(k is not None for k in key):
        return src
    d = _slice_key(key)[0]
    return graph.call_function(operator.getitem, (src, key[:d] + (slice(None),) + key[d + 1:]))


def _row_input(n: Node) -> Optional[tuple]:
    """(source, i, kind) for a row input: X[i] (kind 'row'), getitem(X.split(k, 0), i) (kind
    'chunk', source the split node) or a slice of one dim d, X[a:b] or X[:, a:b] (kind 'slice',
    i = (d, a, b): _slice_key)."""
    if n.op != "call_function" or n.target is not operator.getitem:
        return None
    src, i = n.args
    if not isinstance(src, Node):
        return None
    key = _slice_key(i)
    if key is not None and _val(src) is not None and _val(src).dim() > key[0]:
        return src, key, "slice"
    if not isinstance(i, int):
        return None
    if _val(src) is not None:
        return (src, i, "row") if _val(src).dim() >= 1 else None
    if (src.op == "call_method" and src.target == "split") or (src.op == "call_function" and src.target is torch.split):
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        if dim == 0 and isinstance(src.args[0], Node) and isinstance(src.args[1], int):
            return src, i, "chunk"
    return None


def _row_ndim(n: Node) -> Optional[int]:
    v = _val(n)
    return None if v is None else v.dim()


def _dim_spec(n: Node) -> Optional[tuple]:
    if n.op == "call_function":
        return _DIM_FNS.get(n.target)
    if n.op == "call_method":
        return _DIM_METHODS.get(n.target)
    return None


def _allowed(n: Node) -> bool:
    if n.op == "call_function":
        return n.target in _ELEMENTWISE_FNS or n.target in _DIM_FNS
    return n.op == "call_method" and (n.target in _ELEMENTWISE_METHODS or n.target in _DIM_METHODS)


def _signature(n: Node, nodes: dict, row_inputs: dict) -> Optional[tuple]:
    """The op with its arguments, tensor arguments named by their position in f (or as the k-th
    row input), None if some argument is a tensor from outside f."""
    def arg(a):
        if isinstance(a, Node):
            if a in row_inputs:
                return ("row", row_inputs[a])
            if a in nodes:
                return ("node", nodes[a])
            return None if _val(a) is not None else ("ext", id(a))
        if isinstance(a, (list, tuple)):
            parts = [arg(x) for x in a]
            return None if any(p is None for p in parts) else (type(a).__name__, tuple(parts))
        return ("const", a)
    args = [arg(a) for a in n.args]
    kwargs = {k: arg(v) for k, v in n.kwargs.items()}
    if any(a is None for a in args) or any(v is None for v in kwargs.values()):
        return None
    return (n.op, n.target, tuple(args), tuple(sorted(kwargs.items())))


def _subgraph(item: Node, index: int) -> Optional[tuple]:
    """(ordered f nodes, row inputs {node: k}, sources [k] -> (source, kind)) of the item's
    row-wise computation from row inputs with index `index`; None if it is not one."""
    nodes, row_inputs, sources, stack, seen = [], {}, [], [item], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        ri = _row_input(n)
        if ri is not None:
            if ri[1] != index:
                return None
            row_inputs[n] = len(sources)
            sources.append((ri[0], ri[2]))
            continue
        if not isinstance(n, Node) or not _allowed(n):
            return None
        nodes.append(n)
        for a in n.all_input_nodes:
            if _val(a) is None and _row_input(a) is None:
                return None     # e.g. a shape computation: not a row value
            stack.append(a)
    inside = set(nodes)
    if not row_inputs or any(u not in inside for n in nodes if n is not item for u in n.users):
        return None     # an intermediate value used outside the row's computation
    return nodes, row_inputs, sources
