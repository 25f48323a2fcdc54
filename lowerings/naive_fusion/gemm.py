"""The lm_head GEMM of the naive-fusion pass: `_match_gemm` finds logits = GEMM(h, W) in the
spellings the pass knows (matmul / mm / F.linear / nn.Linear / einsum, the transposes of W, fp32
casts before or after, inside an autocast region: `autocast_dtypes`). It reads the graph only."""
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from lowerings.naive_fusion.nodes import (_EINSUM, _FLOATS, _LINEAR, _MATMUL, _REGION_FNS, _arg, _cast_dtype,
                                          _is, _val)


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
