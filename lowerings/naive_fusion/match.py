"""Matchers of the naive-fusion pass (`lowerings/naive_fusion/`) on Dynamo torch-IR graphs.

Legend: H hidden size, V vocab size, [...] the leading dims of hidden, N = prod([...]).
From the GEMM that gemm.py's `_match_gemm` finds, `_walk_logits` walks the casts, copies
(`.contiguous()`, `.clone()`), bias, temperature, softcap and leading-dim views to the logits; `_match_consumers` checks that every
user of the logits is a log-prob, lse, cross-entropy or entropy spelling (region.py: which
in-place ops and switches a rewrite may move across). They read the graph only;
`naive_fusion._rewrite` edits it.
"""
import operator
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from lowerings.naive_fusion.extrema import extrema_consumer
from lowerings.naive_fusion.trl_kernel import trl_kernel_call
from lowerings.naive_fusion.nodes import (_ADD, _DIV, _FLOATS, _GATHER, _LOG_SOFTMAX, _MUL, _NEG,
                                          _SOFTMAX, _TANH, _VIEW, _arg, _cast_dtype, _is, _last_dim, _mutating,
                                          _number, _same_size, _val)


def _lead_key(key: Any, ndim: int) -> Optional[tuple]:
    """`key` if `x[key]` only indexes leading dims of an ndim-D x (so `h[key]` picks the same
    rows of h); ints, slices (of ints / SymInt nodes) and one Ellipsis, no None, no tensors."""
    key = key if isinstance(key, tuple) else (key,)
    parts = [p for k in key for p in ((k.start, k.stop, k.step) if isinstance(k, slice) else (k,))]
    if any(k is None and not isinstance(k, slice) for k in key) or key.count(Ellipsis) > 1:
        return None
    if any(isinstance(p, Node) and not isinstance(p.meta.get("example_value"), (int, torch.SymInt))
           for p in parts) or any(not isinstance(p, (int, Node, type(None), type(Ellipsis)))
                                  for p in parts):
        return None
    if Ellipsis in key:
        return key if key[-1] in (Ellipsis, slice(None)) else None
    return key if len(key) < ndim or (len(key) == ndim and key[-1] == slice(None)) else None


def _lead_op(n: Node, cur: Node) -> Optional[tuple]:
    """A view of the logits' leading dims (`[:, :-1]`, `.view(-1, V)`, `.flatten(0, 1)`) as the
    (method, args) that does the same to h; None for anything else."""
    vin, vout = _val(cur), _val(n)
    if vin is None or vout is None or vout.dim() < 1 or vout.shape[-1] != vin.shape[-1]:
        return None
    if n.op == "call_function" and n.target is operator.getitem and n.args[0] is cur:
        key = _lead_key(n.args[1], vin.dim())
        return None if key is None else ("__getitem__", (key,))
    if _is(n, (torch.reshape,), ("view", "reshape")) and n.args[0] is cur and len(n.args) >= 2 \
            and not n.kwargs:
        one_arg = len(n.args) == 2 and isinstance(n.args[1], (list, tuple))
        sizes = n.args[1] if one_arg else n.args[1:]
        if sizes and _same_size(sizes[-1], vin.shape[-1]) \
                and all(isinstance(x, (int, Node)) for x in sizes):
            return ("reshape", tuple(sizes[:-1]))       # h.reshape(*sizes[:-1], H)
    if _is(n, (torch.squeeze,), ("squeeze",)) and n.args[0] is cur and len(n.args) == 2 \
            and not n.kwargs and isinstance(n.args[1], int) and not isinstance(n.args[1], bool):
        d = n.args[1] % vin.dim()       # verl's remove-padding .squeeze(0): a leading dim of 1
        if d < vin.dim() - 1 and vin.shape[d] == 1:
            return ("squeeze", (d,))
    if _is(n, (torch.flatten,), ("flatten",)) and n.args[0] is cur:
        start, end = _arg(n, 1, "start_dim", 0), _arg(n, 2, "end_dim", -1)
        if isinstance(start, int) and isinstance(end, int) and end % vin.dim() < vin.dim() - 1:
            return ("flatten", (start, end))
    return None


def _value_copy(n: Node) -> bool:
    """`.contiguous()` / `.clone()` / `torch.clone(x)`, no options: the same values, another
    layout or buffer (trainers call it before the log-softmax: a layout the fused op ignores)."""
    return _is(n, (torch.clone,), ("contiguous", "clone")) and len(n.args) == 1 and not n.kwargs


def _walk_logits(m: dict) -> dict:
    """Follow single-user casts, `+ b`, `/ c`, `* c`, leading-dim views and at most one tanh
    from the GEMM to the logits node L. Before a tanh, a = lead_ops(GEMM) / temp + bias /
    bias_temp (a bias added before a scale is scaled with the GEMM, so then bias_temp == temp)
    and L = a without one; with one (a softcap, HF: c * tanh(a * s / c), then / T),
    L = tanh(a) / post, and only casts, scales and views may follow it.

    A division by a 0-dim or per-row tensor t, or a symbolic float, before any tanh
    ("tensor_temps"; verl's temperature tensors, a float under dynamic=True) is the same as dividing
    h by it: z / t = (h / t) @ W.T; not with a bias, and a per-row t only after the last
    leading-dim view (it is shaped like the logits' rows there).

    "sides": min / max metrics of a chain node before L (`logits.detach().max(-1)` beside
    `log_softmax(logits / T)`), each with the chain's state there (the leading-dim views applied
    so far, the scaling, the bias); not past a tensor temperature.

    "scaling" is the op's (temperature, logit_scale, final_logit_softcapping) for L in terms of
    (GEMM + bias * temp / bias_temp): (temp, 1.0, None) without a tanh; with one, the cap c is
    the first factor multiplied after the tanh (the `c *` of `c * tanh(z / c)`; temp when there
    is none), logit_scale c / temp and temperature c * post, so that c * tanh(. * s / c) / T is
    tanh(. / temp) / post. None when a factor is not > 0."""
    cur, chain, temp, bias, bias_temp, lead_ops = m["gemm"], [m["gemm"]], 1.0, m["bias"], 1.0, []
    post, cap = None, None          # after a tanh: its divisor, and the first factor multiplied
    tensor_temps = []               # (t, len(lead_ops) then): z / t by a 0-dim or per-row tensor
    sides = []                      # min / max metrics of a chain node before L (extrema.py)
    while True:
        users, side = list(cur.users), []
        if len(users) > 1 and not tensor_temps and _val(cur) is not None:
            side = [extrema_consumer(u, {cur}, _val(cur).dim()) for u in users]
            users = [u for u, x in zip(users, side) if x is None]
            side = [e for x in side if x is not None for e in x]
        if len(users) != 1:
            break
        nxt = users[0]
        state = dict(lead=len(lead_ops), scaling=_scaling(temp, post, cap), bias=bias,
                     bias_temp=bias_temp, temp=temp, extrema=side)
        if nxt.op == "call_method" and nxt.args and nxt.args[0] is not cur:
            break
        other = [a for a in list(nxt.args) + list(nxt.kwargs.values()) if a is not cur]
        lead = _lead_op(nxt, cur)           # commutes with the casts, the bias and the scales
        if _cast_dtype(nxt) in _FLOATS or _value_copy(nxt):
            pass
        elif lead is not None:
            lead_ops.append(lead)
        elif _is(nxt, _DIV, ("div", "true_divide")) and nxt.args[0] is cur and len(nxt.args) == 2 \
                and not nxt.kwargs and _number(nxt.args[1]):
            if post is None:
                temp, bias_temp = temp * nxt.args[1], bias_temp * nxt.args[1]
            else:
                post = post * nxt.args[1]
        elif _is(nxt, _DIV, ("div", "true_divide")) and nxt.args[0] is cur and len(nxt.args) == 2 \
                and not nxt.kwargs and post is None and (_row_scale(nxt.args[1], cur)
                                                         or _sym_float(nxt.args[1])):
            tensor_temps.append((nxt.args[1], len(lead_ops), operator.truediv))
        elif _is(nxt, _MUL, ("mul",)) and len(nxt.args) == 2 and not nxt.kwargs and len(other) == 1 \
                and post is None and (_row_scale(other[0], cur) or _sym_float(other[0])):
            tensor_temps.append((other[0], len(lead_ops), operator.mul))   # z * s = (h * s) @ W.T
        elif _is(nxt, _MUL, ("mul",)) and len(nxt.args) == 2 and not nxt.kwargs \
                and len(other) == 1 and _number(other[0]):
            if post is None:
                temp, bias_temp = temp / other[0], bias_temp / other[0]
            else:
                cap = other[0] if cap is None and post == 1.0 else cap
                post = post / other[0]
        elif _is(nxt, _TANH, ("tanh",)) and post is None and len(nxt.args) == 1 and not nxt.kwargs:
            post = 1.0
        elif _is(nxt, _ADD, ("add",)) and len(nxt.args) == 2 and not nxt.kwargs and bias is None \
                and post is None \
                and len(other) == 1 and _val(other[0]) is not None \
                and tuple(_val(other[0]).shape) == tuple(_val(m["w"]).shape[:1]) \
                and _val(other[0]).dtype in _FLOATS:
            bias, bias_temp = other[0], 1.0
        else:
            break
        chain.append(nxt)
        if side:
            sides.append(state)
        cur = nxt
    scaling = _scaling(temp, post, cap)
    if sides and (scaling is None or any(x["scaling"] is None for x in sides)):
        scaling = None
    if tensor_temps and (bias is not None or any(
            _val(t) is not None and _val(t).dim() and k < len(lead_ops) for t, k, _ in tensor_temps)):
        scaling = None   # a bias (scaled or not), or a per-row t read through a later view
    return dict(L=cur, chain=chain, temp=temp, bias=bias, bias_temp=bias_temp, lead_ops=lead_ops,
                scaling=scaling, tensor_temps=[(t, op) for t, _, op in tensor_temps], sides=sides)


def _scaling(temp: float, post: Optional[float], cap: Optional[float]) -> Optional[tuple]:
    """The op's (temperature, logit_scale, final_logit_softcapping) of _walk_logits' state."""
    if post is None:
        return (temp, 1.0, None) if temp > 0 else None
    cap = float(temp if cap is None else cap)
    return (cap * post, cap / temp, cap) if min(temp, post, cap) > 0 else None


def _sym_float(t: Any) -> bool:
    """t is a symbolic float: under dynamic=True Dynamo passes a float default argument (a
    temperature) as a 0-dim tensor input and divides by its .item(). z / t = (h / t) @ W.T as for
    a 0-dim tensor t."""
    return isinstance(t, Node) and isinstance(t.meta.get("example_value"), torch.SymFloat)


def _row_scale(t: Any, cur: Node) -> bool:
    """t scales the logits row by row: a floating tensor, 0-dim or [..., 1] over the logits'
    leading dims (verl's per-token temperature; a per-sequence [B, 1, 1] one broadcasts).
    z / t = (h / t) @ W.T, z * t = (h * t) @ W.T: the pass scales h."""
    vt, vc = _val(t), _val(cur)
    if vt is None or vc is None or not vt.is_floating_point():
        return False
    # 0-dim, or [..., 1] broadcasting over the leading dims only (each 1 or the logits')
    return vt.dim() == 0 or (vt.dim() <= vc.dim() and vt.shape[-1] == 1 and all(
        (isinstance(a, int) and a == 1) or _same_size(a, b)
        for a, b in zip(reversed(vt.shape[:-1]), reversed(vc.shape[:-1]))))


def _gather_parts(g: Node) -> tuple:
    """(dim, index, sparse_grad) of gather(x, dim, index) or take_along_dim(x, indices, dim)."""
    if g.target in (torch.take_along_dim, "take_along_dim"):
        return _arg(g, 2, "dim", None), _arg(g, 1, "indices"), False
    return _arg(g, 1, "dim"), _arg(g, 2, "index"), _arg(g, 3, "sparse_grad", False)


def _ids_source(idx: Node) -> Any:
    """ids for `idx = ids.unsqueeze(-1)` / `ids[..., None]`; None when idx is something else."""
    vi = _val(idx)
    if _is(idx, (torch.unsqueeze,), ("unsqueeze",)) and _last_dim(_arg(idx, 1, "dim"), vi.dim()):
        return idx.args[0]
    key = idx.args[1] if idx.op == "call_function" and idx.target is operator.getitem else None
    if isinstance(key, tuple) and key and key[-1] is None and (
            key[:-1] == (Ellipsis,)
            or (len(key) == vi.dim() and all(k == slice(None) for k in key[:-1]))):
        return idx.args[0]
    return None


def _log_softmax_by_lse(u: Node, L: Node, nd: int) -> bool:
    """u = L - L.logsumexp(-1, keepdim=True): log_softmax(L) spelled out (its logsumexp read by
    such subtractions only is no consumer of its own)."""
    if not (_is(u, (operator.sub, torch.sub), ("sub",)) and len(u.args) == 2 and not u.kwargs
            and u.args[0] is L and isinstance(u.args[1], Node)):
        return False
    lse = u.args[1]
    return _is(lse, (torch.logsumexp,), ("logsumexp",)) and lse.args[0] is L \
        and _last_dim(_arg(lse, 1, "dim"), nd) and _arg(lse, 2, "keepdim", False) is True \
        and len(lse.args) + len(lse.kwargs) <= 3


_CLASS_DIM_1 = (torch.transpose, torch.permute)


def _class_dim_1(u: Node) -> bool:
    """u = z.transpose(1, 2) / z.permute(0, 2, 1) of 3-D logits z: the class dim second, as
    cross_entropy takes [B, V, T]."""
    if _is(u, (torch.transpose,), ("transpose",)) and len(u.args) == 3 and not u.kwargs:
        return {d % 3 for d in u.args[1:] if isinstance(d, int)} == {1, 2}
    if _is(u, (torch.permute,), ("permute",)) and not u.kwargs:
        dims = u.args[1] if len(u.args) == 2 and isinstance(u.args[1], (list, tuple)) else u.args[1:]
        return [d % 3 if isinstance(d, int) else d for d in dims] == [0, 2, 1]
    return False


class CrossEntropy(NamedTuple):
    """A matched F.cross_entropy call: its node, its targets and the arguments the result needs
    (cross_entropy.py builds it; weight a [V] node or None)."""
    node: Node
    target: Node
    ignore_index: int
    reduction: str
    weight: Optional[Node]
    label_smoothing: float


def _match_consumers(L: Node) -> Optional[dict]:
    """Classify every user of the logits; None unless all of them are matched consumers. A
    float cast of the logits that some consumers read (verl's chunked entropy reads
    `logits[i:j].float()`, folded to `logits.float()`, beside log-probs of `logits`) counts as
    the logits: the op computes in fp32, and each replaced node keeps its own dtype."""
    vL = _val(L)
    if vL is None or vL.dtype not in _FLOATS:
        return None
    nd = vL.dim()
    Ls = {L} | {c for c in L.users if _cast_dtype(c) in _FLOATS and c.args[0] is L and c.users}
    lsm, sm, ce, others, zgathers, lses, muls, sizes, trl, ext = [], [], [], [], [], [], {}, [], [], []
    for u in [u for x in Ls for u in x.users if u not in Ls]:
        if u.op == "call_method" and u.target == "size" and u.args[0] is L and not u.kwargs \
                and (len(u.args) == 1 or (len(u.args) == 2 and isinstance(u.args[1], int))):
            sizes.append(u)     # logits.shape (TRL reads it under dynamic shapes): no data needed
        elif _is(u, _LOG_SOFTMAX + _SOFTMAX, ("log_softmax", "softmax")) and u.args[0] in Ls \
                and _last_dim(_arg(u, 1, "dim", None), nd) \
                and _arg(u, 3 if u.target in (F.log_softmax, F.softmax) else 2, "dtype", None) \
                in (None,) + _FLOATS:
            (lsm if u.target in _LOG_SOFTMAX + ("log_softmax",) else sm).append(u)
        elif _is(u, _GATHER, ("gather", "take_along_dim")) and u.args[0] in Ls:      # z[target]
            zgathers.append(u)
        elif _is(u, (torch.logsumexp,), ("logsumexp",)) and u.args[0] in Ls \
                and _last_dim(_arg(u, 1, "dim"), nd) and len(u.args) + len(u.kwargs) <= 3:
            if not (u.users and all(_log_softmax_by_lse(s, u.args[0], nd) for s in u.users)):
                lses.append((u, bool(_arg(u, 2, "keepdim", False))))
        elif _log_softmax_by_lse(u, u.args[0], nd):   # z - z.logsumexp(-1, keepdim=True)
            lsm.append(u)
        elif _is(u, _MUL, ("mul",)) and len(u.args) == 2 and not u.kwargs:   # p * z (entropy)
            muls[u] = None
        elif (k := trl_kernel_call(u)) is not None:
            trl.append((u, k))
        elif (x := extrema_consumer(u, Ls, nd)) is not None:   # min / max metrics
            ext += x
        else:
            others.append(u)
    for u in others:    # cross_entropy(logits.view(-1, V) | logits.transpose(1, 2), target)
        x = u
        if _is(u, _VIEW + _CLASS_DIM_1, ("view", "reshape", "flatten", "transpose", "permute")) \
                and len(u.users) == 1:
            x = next(iter(u.users))
        if not _is(x, (F.cross_entropy,)) or (x is u and x.args[0] not in Ls) \
                or (x is not u and (x.args[0] is not u or u.args[0] not in Ls)):
            return None
        vx, tg = _val(x.args[0]), _arg(x, 1, "target")
        kw = {k: _arg(x, i, k, d) for i, k, d in ((2, "weight", None), (3, "size_average", None),
              (4, "ignore_index", -100), (5, "reduce", None), (6, "reduction", "mean"),
              (7, "label_smoothing", 0.0))}
        vt, wt = _val(tg), kw["weight"]
        vw = _val(wt) if isinstance(wt, Node) else None
        if wt is not None and (vw is None or vw.dim() != 1 or not vw.is_floating_point()
                               or not _same_size(vw.shape[0], vL.shape[-1])):
            return None     # class weights: a [V] float tensor (weight[target] scales each term)
        # [N, V] logits and [N] targets, or [B, V, T] (the class dim second) and [B, T]
        moved = x is not u and _is(u, _CLASS_DIM_1, ("transpose", "permute"))   # dims reordered
        flat = vx is not None and vx.dim() == 2 and not moved    # (a [V, V] transpose is no [N, V])
        shaped = vx is not None and moved and vL.dim() == 3 and _class_dim_1(u) \
            and vt is not None and tuple(vt.shape) == tuple(vL.shape[:-1])
        if vx is None or vt is None or not (flat or shaped) or vx.shape[1] != vL.shape[-1] \
                or (flat and vt.shape != vx.shape[:1]) or vt.dtype != torch.int64 \
                or kw["size_average"] is not None \
                or kw["reduce"] is not None or kw["reduction"] not in ("none", "mean", "sum") \
                or _number(kw["label_smoothing"]) is None or not 0.0 <= kw["label_smoothing"] <= 1.0 \
                or not isinstance(kw["ignore_index"], int):
            return None
        ce.append(CrossEntropy(x, tg, kw["ignore_index"], kw["reduction"], wt, float(kw["label_smoothing"])))
    gathers, exps = [], []
    for ls in lsm:
        for u in ls.users:
            if _is(u, _GATHER, ("gather", "take_along_dim")) and u.args[0] is ls:
                gathers.append(u)
            elif _is(u, (torch.exp,), ("exp",)) and len(u.args) == 1:
                exps.append(u)
            elif _is(u, _MUL, ("mul",)) and len(u.args) == 2 and not u.kwargs:
                muls[u] = None
            else:
                return None
    targets = []
    for g in gathers + zgathers:
        dim, idx, sparse = _gather_parts(g)
        vi = _val(idx)
        if not _last_dim(dim, nd) or sparse or vi is None \
                or vi.dtype != torch.int64 or tuple(vi.shape) != tuple(vL.shape[:-1]) + (1,):
            return None
        targets.append((g, idx, g in zgathers))
    probs = set(exps) | set(sm)
    for p in probs:
        for u in p.users:
            if not (_is(u, _MUL, ("mul",)) and len(u.args) == 2 and not u.kwargs):
                return None
            muls[u] = None
    sums = []
    for m in muls:      # p * logp or p * z (either order); then .sum(-1) or -(...) then .sum(-1)
        a, b = m.args
        rest = {a, b} - probs
        if not ({a, b} & probs) or len(rest) != 1 or not (rest <= set(lsm) or rest <= Ls) \
                or len(m.users) != 1:
            return None
        s, sign = next(iter(m.users)), 1.0
        if _is(s, _NEG, ("neg",)) and len(s.users) == 1:
            s, sign = next(iter(s.users)), -1.0
        if not (_is(s, (torch.sum,), ("sum",)) and _last_dim(_arg(s, 1, "dim", None), nd)
                and _arg(s, 3, "dtype", None) is None and len(s.args) <= 3):
            return None
        # sum(p * logp) = -entropy; sum(p * z) = lse - entropy
        sums.append((s, sign, bool(_arg(s, 2, "keepdim", False)), rest <= Ls))
    kernels = []
    for u, k in trl:   # TRL's CUDA kernel: the only consumer kind of these logits, one temperature
        outs = [(g, g.args[1]) for g in u.users]
        if k["logits"] not in Ls or any(not (g.op == "call_function" and g.target is operator.getitem
                                            and g.args[1] in (0, 1)) for g, _ in outs):
            return None
        vi = _val(k["ids"])
        if any(i == 0 for _, i in outs) and (vi is None or tuple(vi.shape) != tuple(vL.shape[:-1])):
            return None
        kernels.append(dict(k, outs=outs))
    if kernels and (targets or ce or sums or lses
                    or len({k["temperature"] for k in kernels}) > 1):
        return None
    ids = {_ids_source(i) or i for _, i, _ in targets} | {(_spelled(x.target), x.ignore_index) for x in ce} \
        | {_spelled(k["ids"]) for k in kernels if any(i == 0 for _, i in k["outs"])}
    if len(ids) > 1 or not (targets or ce or sums or lses or kernels):
        return None
    return dict(gathers=targets, ce=ce, sums=sums, lses=lses, sizes=sizes, trl=kernels, extrema=ext)


def _spelled(n: Node, depth: int = 4) -> Any:
    """n, or for a pure call on the graph's inputs (e.g. `ids[:, 1:]` computed once per TRL call)
    a string naming the call and its arguments, so that two such calls compare equal."""
    if depth == 0 or n.op not in ("call_function", "call_method") or _mutating(n) \
            or (n.op == "call_function" and n.is_impure()):
        return n
    spell = lambda a: _spelled(a, depth - 1) if isinstance(a, Node) else repr(a)  # noqa: E731
    parts = [spell(a) for a in n.args] + [f"{k}={spell(v)}" for k, v in n.kwargs.items()]
    if any(isinstance(p, Node) and p.op not in ("placeholder", "get_attr") for p in parts):
        return n
    return f"{n.op}:{n.target}({', '.join(p if isinstance(p, str) else p.name for p in parts)})"


def _replaced(c: dict) -> list:
    return ([next(iter(x)) for k in ("gathers", "sums", "ce", "lses") for x in c[k]]
            + [g for k in c["trl"] for g, _ in k["outs"]])
