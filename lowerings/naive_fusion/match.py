"""Matchers of the naive-fusion pass (`lowerings/naive_fusion.py`) on Dynamo torch-IR graphs.

Legend: H hidden size, V vocab size, [...] the leading dims of hidden, N = prod([...]).
`_match_gemm` finds `GEMM(h, W)` (with casts, bias, temperature and leading-dim views walked by
`_walk_logits`); `_match_consumers` checks that every user of the logits is a log-prob, lse,
cross-entropy or entropy spelling; `_region_is_clean` refuses a rewrite across in-place ops and
grad-mode / autocast switches. They read the graph only; `naive_fusion._rewrite` edits it.
"""
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Node predicates on Dynamo torch-IR. `call_method` nodes carry `self` as args[0], so argument
# index i below counts the input tensor as 0 for both call_method and call_function spellings.

def _is(n: Any, fns=(), methods=()) -> bool:
    return isinstance(n, Node) and (
        (n.op == "call_function" and n.target in fns)
        or (n.op == "call_method" and n.target in methods))


def _arg(n: Node, i: int, name: str, default: Any = _MISSING) -> Any:
    if i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, default)


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("example_value") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _last_dim(d: Any, ndim: int) -> bool:
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return isinstance(d, int) and not isinstance(d, bool) and d in (-1, ndim - 1)


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_MATMUL = (operator.matmul, torch.matmul, torch.mm)
_EINSUM = (torch.einsum, torch.functional.einsum)
_GATHER = (torch.gather, torch.take_along_dim)
_LINEAR = (F.linear,)
_LOG_SOFTMAX = (torch.log_softmax, F.log_softmax, torch.special.log_softmax)
_SOFTMAX = (torch.softmax, F.softmax, torch.special.softmax)
_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)
_ADD = (operator.add, torch.add)
_NEG = (operator.neg, torch.neg)
_TANH = (torch.tanh, F.tanh)
_VIEW = (torch.reshape, torch.flatten)
_MUTATING_FNS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem)
_REGION_FNS = tuple(f for f in (torch._C._set_grad_enabled,
                                getattr(torch.amp.autocast_mode, "_enter_autocast", None),
                                getattr(torch.amp.autocast_mode, "_exit_autocast", None)) if f)


def _cast_dtype(n: Node) -> Optional[torch.dtype]:
    """Dtype of a pure cast (`.float()`, `.half()`, `.bfloat16()`, `.to(dtype)`), else None."""
    if n.op != "call_method":
        return None
    simple = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}
    if n.target in simple and len(n.args) == 1 and not n.kwargs:
        return simple[n.target]
    if n.target == "to" and not (set(n.kwargs) - {"dtype"}):
        rest = list(n.args[1:]) + list(n.kwargs.values())
        if len(rest) == 1 and isinstance(rest[0], torch.dtype):
            return rest[0]
    return None


# W.T / W.mT / W.H / W.mH as torch 2.15's Dynamo records them: aten ops (OpOverloadPackets) where
# earlier releases recorded getattr(W, "T"). For a real W, H and mH are its transpose.
_ATTR_T = tuple(getattr(torch.ops.aten, name) for name in ("numpy_T", "mT", "matrix_H", "mH")
                if hasattr(torch.ops.aten, name))
_ATTR_T = _ATTR_T + tuple(p.default for p in _ATTR_T if hasattr(p, "default"))


def _transposed(n: Node) -> Optional[Node]:
    """W for a node that is W.T / W.mT / W.H / W.mH / W.t() / W.adjoint() / W.transpose(0, 1) /
    W.permute(1, 0) of a 2-D real W."""
    v = _val(n)
    if v is None or v.dim() != 2 or v.is_complex():
        return None
    if n.op == "call_function" and n.target is getattr and n.args[1] in ("T", "mT", "H", "mH"):
        return n.args[0]
    if _is(n, _ATTR_T, ("adjoint",)) and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if _is(n, (torch.t,), ("t",)) and len(n.args) == 1:
        return n.args[0]
    if _is(n, (torch.transpose,), ("transpose",)):
        dims = (_arg(n, 1, "dim0"), _arg(n, 2, "dim1"))
        if all(isinstance(d, int) for d in dims) and sorted(d % 2 for d in dims) == [0, 1]:
            return n.args[0]
    if _is(n, (torch.permute,), ("permute",)):
        dims = n.args[1:] if n.op == "call_method" and len(n.args) == 3 else _arg(n, 1, "dims")
        if isinstance(dims, (list, tuple)) and [d % 2 for d in dims] == [1, 0]:
            return n.args[0]
    return None


def _strip_fp32_casts(n: Any) -> tuple:
    """(source, stripped?) with casts to float32 removed."""
    stripped = False
    while isinstance(n, Node) and _cast_dtype(n) == torch.float32:
        n, stripped = n.args[0], True
    return n, stripped


def _einsum_operands(n: Node) -> Optional[tuple]:
    """(h, W) of an lm_head einsum: "<lead>h,vh-><lead>v" in any letters, with or without
    "...", operands given in order or as one list; None for any other einsum."""
    if not _is(n, _EINSUM) or n.kwargs or len(n.args) < 2 or not isinstance(n.args[0], str):
        return None
    ops = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
    eq = n.args[0].replace(" ", "")
    if len(ops) != 2 or "->" not in eq or eq.count(",") != 1:
        return None
    ins, out = eq.split("->")
    a, b = ins.split(",")
    lead = a[:-1]
    if len(b) != 2 or not a or b[1] != a[-1] or b[0] in a or out != lead + b[0] \
            or len(set(lead.replace("...", ""))) != len(lead.replace("...", "")):
        return None
    return ops[0], ops[1]


def autocast_dtypes(graph: Graph) -> dict:
    """{node: (device_type, dtype)} of the enabled autocast region each node runs in (Dynamo
    records `with torch.autocast(...)` as _enter_autocast / _exit_autocast calls)."""
    enter, leave = _REGION_FNS[1:] if len(_REGION_FNS) == 3 else (None, None)
    stack, out = [], {}
    for n in graph.nodes:
        if n.op == "call_function" and enter is not None and n.target is enter:
            device, dtype, enabled = (list(n.args) + [None, None, True])[:3]
            stack.append((n, (device, dtype) if enabled and isinstance(dtype, torch.dtype) else None))
        elif n.op == "call_function" and leave is not None and n.target is leave and stack:
            stack.pop()
        out[n] = stack[-1][1] if stack else None
    return out


def _match_gemm(n: Node, autocast: Optional[tuple] = None) -> Optional[dict]:
    """logits = h @ W.T in any supported spelling -> dict(h, w, bias, fp32_lm_head, gemm).
    ``autocast`` (device_type, dtype): the region the GEMM runs in; its operands are then cast
    to that dtype (the rewrite casts them explicitly: "autocast" in the result)."""
    if _is(n, _LINEAR):
        h, wt, bias = n.args[0], _arg(n, 1, "weight"), _arg(n, 2, "bias", None)
        w, w_cast = _strip_fp32_casts(wt)
    elif _is(n, _MATMUL, ("matmul", "mm")) and len(n.args) == 2 and not n.kwargs:
        h, bias, wt = n.args[0], None, n.args[1]
        w, pre = _strip_fp32_casts(wt)
        w = _transposed(w) if isinstance(w, Node) else None
        if w is None:
            return None
        w, post = _strip_fp32_casts(w)
        w_cast = pre or post
    elif _einsum_operands(n) is not None:
        (h, wt), bias = _einsum_operands(n), None
        w, w_cast = _strip_fp32_casts(wt)
    else:
        return None
    h_gemm = h
    h, h_cast = _strip_fp32_casts(h)
    out, vh, vw, vwt, vh_gemm = _val(n), _val(h), _val(w), _val(wt), _val(h_gemm)
    if any(v is None for v in (out, vh, vw, vwt, vh_gemm)):
        return None
    # Same dtype into and out of the GEMM (mixed-dtype GEMMs excluded), or autocast's: floating
    # operands on its device, the output in its dtype
    cast = None
    if autocast is not None and autocast[0] == out.device.type and out.dtype == autocast[1] \
            and out.dtype in _FLOATS and out.dtype != vh_gemm.dtype:
        if vh_gemm.dtype not in _FLOATS or vwt.dtype not in _FLOATS:
            return None
        cast = out.dtype
    elif not (out.dtype == vh_gemm.dtype == vwt.dtype) or out.dtype not in _FLOATS:
        return None
    if vw.dim() != 2 or vh.dim() < 2 or vh.shape[-1] != vw.shape[1] or out.shape[-1] != vw.shape[0]:
        return None
    if vh.dtype not in _FLOATS or vw.dtype not in _FLOATS:
        return None
    if bias is not None and (_val(bias) is None or _val(bias).dim() != 1):
        return None
    if cast is not None:   # autocast: the GEMM of the operands cast to its dtype (a bias too)
        return dict(h=h, w=w, bias=bias, fp32_lm_head=False, gemm=n, mixed=False, autocast=cast)
    return dict(h=h, w=w, bias=bias, fp32_lm_head=h_cast or w_cast, gemm=n,
                mixed=vh.dtype != vw.dtype, autocast=None)


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


def _same_size(a: Any, size) -> bool:
    """a (an int, or a node of a SymInt) is the size `size`, provably (dynamic V: the same symbol)."""
    if isinstance(a, Node):
        a = a.meta.get("example_value")
    if isinstance(a, bool) or not isinstance(a, (int, torch.SymInt)):
        return False
    if isinstance(a, int) and isinstance(size, int):
        return a == size
    return statically_known_true(a == size)


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


def _walk_logits(m: dict) -> dict:
    """Follow single-user casts, `+ b`, `/ c`, `* c`, leading-dim views and at most one tanh
    from the GEMM to the logits node L. Before a tanh, a = lead_ops(GEMM) / temp + bias /
    bias_temp (a bias added before a scale is scaled with the GEMM, so then bias_temp == temp)
    and L = a without one; with one (a softcap, HF: c * tanh(a * s / c), then / T),
    L = tanh(a) / post, and only casts, scales and views may follow it.

    A division by a 0-dim or per-row tensor t before any tanh ("tensor_temps"; verl's temperature
    tensors) is the same as dividing h by it: z / t = (h / t) @ W.T; not with a bias, and a per-row
    t only after the last leading-dim view (it is shaped like the logits' rows there).

    "scaling" is the op's (temperature, logit_scale, final_logit_softcapping) for L in terms of
    (GEMM + bias * temp / bias_temp): (temp, 1.0, None) without a tanh; with one, the cap c is
    the first factor multiplied after the tanh (the `c *` of `c * tanh(z / c)`; temp when there
    is none), logit_scale c / temp and temperature c * post, so that c * tanh(. * s / c) / T is
    tanh(. / temp) / post. None when a factor is not > 0."""
    cur, chain, temp, bias, bias_temp, lead_ops = m["gemm"], [m["gemm"]], 1.0, m["bias"], 1.0, []
    post, cap = None, None          # after a tanh: its divisor, and the first factor multiplied
    tensor_temps = []               # (t, len(lead_ops) then): z / t by a 0-dim or per-row tensor
    while len(cur.users) == 1:
        nxt = next(iter(cur.users))
        if nxt.op == "call_method" and nxt.args and nxt.args[0] is not cur:
            break
        other = [a for a in list(nxt.args) + list(nxt.kwargs.values()) if a is not cur]
        lead = _lead_op(nxt, cur)           # commutes with the casts, the bias and the scales
        if _cast_dtype(nxt) in _FLOATS:
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
                and not nxt.kwargs and post is None and _row_scale(nxt.args[1], cur):
            tensor_temps.append((nxt.args[1], len(lead_ops)))
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
        cur = nxt
    if post is None:
        scaling = (temp, 1.0, None) if temp > 0 else None
    else:
        cap = float(temp if cap is None else cap)
        scaling = (cap * post, cap / temp, cap) if min(temp, post, cap) > 0 else None
    if tensor_temps and (bias is not None or any(
            _val(t).dim() and k < len(lead_ops) for t, k in tensor_temps)):
        scaling = None   # a bias (scaled or not), or a per-row t read through a later view
    return dict(L=cur, chain=chain, temp=temp, bias=bias, bias_temp=bias_temp, lead_ops=lead_ops,
                scaling=scaling, tensor_temps=[t for t, _ in tensor_temps])


def _row_scale(t: Any, cur: Node) -> bool:
    """t divides the logits row by row: a floating tensor, 0-dim or [..., 1] over the logits'
    leading dims (verl's per-token temperature). z / t = (h / t) @ W.T: the pass divides h."""
    vt, vc = _val(t), _val(cur)
    if vt is None or vc is None or not vt.is_floating_point():
        return False
    return vt.dim() == 0 or (vt.dim() == vc.dim() and vt.shape[-1] == 1
                             and tuple(vt.shape[:-1]) == tuple(vc.shape[:-1]))


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


def _match_consumers(L: Node) -> Optional[dict]:
    """Classify every user of the logits; None unless all of them are matched consumers."""
    vL = _val(L)
    if vL is None or vL.dtype not in _FLOATS:
        return None
    nd = vL.dim()
    lsm, sm, ce, others, zgathers, lses, muls, sizes = [], [], [], [], [], [], {}, []
    for u in L.users:
        if u.op == "call_method" and u.target == "size" and u.args[0] is L and not u.kwargs \
                and (len(u.args) == 1 or (len(u.args) == 2 and isinstance(u.args[1], int))):
            sizes.append(u)     # logits.shape (TRL reads it under dynamic shapes): no data needed
        elif _is(u, _LOG_SOFTMAX + _SOFTMAX, ("log_softmax", "softmax")) and u.args[0] is L \
                and _last_dim(_arg(u, 1, "dim", None), nd) \
                and _arg(u, 3 if u.target in (F.log_softmax, F.softmax) else 2, "dtype", None) \
                in (None,) + _FLOATS:
            (lsm if u.target in _LOG_SOFTMAX + ("log_softmax",) else sm).append(u)
        elif _is(u, _GATHER, ("gather", "take_along_dim")) and u.args[0] is L:       # z[target]
            zgathers.append(u)
        elif _is(u, (torch.logsumexp,), ("logsumexp",)) and u.args[0] is L \
                and _last_dim(_arg(u, 1, "dim"), nd) and len(u.args) + len(u.kwargs) <= 3:
            lses.append((u, bool(_arg(u, 2, "keepdim", False))))
        elif _is(u, _MUL, ("mul",)) and len(u.args) == 2 and not u.kwargs:   # p * z (entropy)
            muls[u] = None
        else:
            others.append(u)
    for u in others:    # cross_entropy(logits | logits.view(-1, V), target, reduction="none")
        x = u
        if _is(u, _VIEW, ("view", "reshape", "flatten")) and len(u.users) == 1:
            x = next(iter(u.users))
        if not _is(x, (F.cross_entropy,)) or x.args[0] is not (L if x is u else u):
            return None
        vx, tg = _val(x.args[0]), _arg(x, 1, "target")
        kw = {k: _arg(x, i, k, d) for i, k, d in ((2, "weight", None), (3, "size_average", None),
              (4, "ignore_index", -100), (5, "reduce", None), (6, "reduction", "mean"),
              (7, "label_smoothing", 0.0))}
        vt = _val(tg)
        if vx is None or vt is None or vx.dim() != 2 or vx.shape[1] != vL.shape[-1] \
                or vt.shape != vx.shape[:1] or vt.dtype != torch.int64 \
                or kw["weight"] is not None or kw["size_average"] is not None \
                or kw["reduce"] is not None or kw["reduction"] != "none" \
                or kw["label_smoothing"] != 0.0 or not isinstance(kw["ignore_index"], int):
            return None
        ce.append((x, u if x is not u else None, tg, kw["ignore_index"]))
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
        if not ({a, b} & probs) or len(rest) != 1 or not (rest <= set(lsm) or rest == {L}) \
                or len(m.users) != 1:
            return None
        s, sign = next(iter(m.users)), 1.0
        if _is(s, _NEG, ("neg",)) and len(s.users) == 1:
            s, sign = next(iter(s.users)), -1.0
        if not (_is(s, (torch.sum,), ("sum",)) and _last_dim(_arg(s, 1, "dim", None), nd)
                and _arg(s, 3, "dtype", None) is None and len(s.args) <= 3):
            return None
        # sum(p * logp) = -entropy; sum(p * z) = lse - entropy
        sums.append((s, sign, bool(_arg(s, 2, "keepdim", False)), rest == {L}))
    ids = {_ids_source(i) or i for _, i, _ in targets} | {(t, ii) for _, _, t, ii in ce}
    if len(ids) > 1 or not (targets or ce or sums or lses):
        return None
    return dict(gathers=targets, ce=ce, sums=sums, lses=lses, sizes=sizes)


def _mutating(n: Node) -> bool:
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (n.op == "call_function" and n.target in _MUTATING_FNS) or (
        n.op in ("call_method", "call_function") and isinstance(name, str)
        and name.endswith("_") and not name.endswith("__"))


def _region_is_clean(graph: Graph, first: Node, last: Node) -> bool:
    """No in-place op or grad-mode switch between the GEMM and its last consumer. An autocast
    switch is harmless: the rewrite casts the GEMM's operands as autocast did (``autocast``) and
    gives each replaced value the dtype the naive node had."""
    inside = False
    for n in graph.nodes:
        inside = inside or n is first
        if inside and (_mutating(n) or (n.op == "call_function" and n.target in _REGION_FNS[:1])):
            return False
        if n is last:
            return True
    return True


def _erase_dead(graph: Graph, seeds: list) -> None:
    work = list(seeds)
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method") \
                or _mutating(n) or (n.op == "call_function" and n.is_impure()):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


def _replaced(c: dict) -> list:
    return [next(iter(x)) for k in ("gathers", "sums", "ce", "lses") for x in c[k]]
