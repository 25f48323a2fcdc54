"""F.cross_entropy's result from the fused op's per-token values, as torch defines it.

The op gives lp[i] = log p(t_i) and lse[i] at the kept targets (ignored ones see target 0 and are
masked here). With class weights w (none: w = 1), ignore_index and label smoothing eps over V
classes, torch's cross_entropy is, per token and 0 where t_i is ignored,

    nll[i]    = -w[t_i] lp[i]
    smooth[i] = -sum_v w_v log p_v(i) = (sum_v w_v) lse[i] - sum_v w_v z_iv
    loss[i]   = (1 - eps) nll[i] + eps / V smooth[i]

reduced by "sum", or by "mean": both sums over the kept tokens divided by the sum of w[t_i] there
(their count without weights; nan when none is kept, as torch's). The smoothing term needs every
logit only through sum_v w_v z_iv, which is linear in the head when no softcap follows the GEMM:
with z = (h W^T + b) / T it is (h . (w W) + w . b) / T: one [H] vector (a reduction of W over
the vocabulary) and a dot product a token, never the [N, V] logits. A softcap makes z
non-linear: the matcher leaves label smoothing under one alone. The weights get no gradient
(torch's cross_entropy gives them none).
"""
import operator

import torch
from torch.fx import Graph, Node


def cross_entropy_results(graph: Graph, ce: list, lp: Node, lse: Node, ignored: Node, kept_tg: Node,
                          head: tuple) -> list:
    """For each matched cross_entropy (match.CrossEntropy) the node of its value (fp32: the caller
    casts); `head` = (h, w, bias, temperature) as the op was called."""
    h, w, bias, temperature = head

    def masked(t: Node) -> Node:      # [...] -> the targets' shape ([N] | [B, T]), 0 where ignored
        return graph.call_method("masked_fill", (graph.call_method("view_as", (t, ignored)), ignored, 0.0))

    nll = masked(graph.call_function(operator.neg, (lp,)))
    n_classes = graph.call_method("size", (w, 0)) if any(x.label_smoothing for x in ce) else None   # V
    out = []
    for x in ce:
        reduction, weight, eps = x.reduction, x.weight, x.label_smoothing
        wd = None if weight is None else graph.call_method("float", (graph.call_method("detach", (weight,)),))
        wsel = None if wd is None else masked(graph.call_function(operator.getitem, (wd, kept_tg)))
        terms = [nll if wsel is None else graph.call_function(operator.mul, (nll, wsel))]
        if eps:
            terms.append(masked(_smoothing(graph, h, w, bias, temperature, wd, lse, n_classes)))
        if reduction != "none":
            count = graph.call_function(operator.invert, (ignored,)) if wsel is None else wsel
            denom = graph.call_method("sum", (count,)) if reduction == "mean" else None
            terms = [graph.call_method("sum", (t,)) for t in terms]
            if denom is not None:
                terms = [graph.call_function(operator.truediv, (t, denom)) for t in terms]
        r = terms[0]
        if eps:     # (1 - eps) nll + eps / V smooth
            share = graph.call_function(operator.truediv, (eps, n_classes))
            r = graph.call_function(operator.add, (graph.call_function(operator.mul, (r, 1.0 - eps)),
                                                   graph.call_function(operator.mul, (terms[1], share))))
        out.append(r)
    return out


def _smoothing(graph: Graph, h: Node, w: Node, bias, temperature: float, wd, lse: Node,
               n_classes: Node) -> Node:
    """-sum_v w_v log p_v [...] = (sum_v w_v) lse - (h . (w W) + w . b) / T, in fp32. Written as
    reductions of products (w * wd[:, None]).sum(0), (h * wv).sum(-1): Inductor fuses each into one
    kernel, where w.float() @ ... would first copy W (and h) to fp32."""
    f32 = {"dtype": torch.float32}
    if wd is None:
        wv, total = graph.call_method("sum", (w, 0), f32), n_classes                      # [H], V
    else:
        wcol = graph.call_method("unsqueeze", (wd, -1))                                     # [V, 1]
        wv = graph.call_method("sum", (graph.call_function(operator.mul, (w, wcol)), 0), f32)
        total = graph.call_method("sum", (wd,))
    zsum = graph.call_method("sum", (graph.call_function(operator.mul, (h, wv)), -1), f32)   # [...]
    if bias is not None:
        bw = bias if wd is None else graph.call_function(operator.mul, (bias, wd))
        zsum = graph.call_function(operator.add, (zsum, graph.call_method("sum", (bw,), f32)))
    zsum = graph.call_function(operator.truediv, (zsum, float(temperature)))
    return graph.call_function(operator.sub, (graph.call_function(operator.mul, (lse, total)), zsum))
