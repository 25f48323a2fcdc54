"""The pass's fused-gradient rewrite: a loss that sums per-token terms of the fused log-probs gets
its gradient while each row block's logits exist (6NHV FLOPs), not from the op's backward,
which computes the logits again (8NHV).

Legend: N tokens (the op's rows), [...] the log-probs' shape (N = prod), G row blocks of R rows.

After the rewrite to `linear_logprobs_call` (__init__.py), let D be the nodes that depend on its
log-probs / entropy, and L the graph output that D reaches with a gradient. The loss is
*token-separable* when every node of D on L's ancestry is

    E  per-token: each element a function of one token's values (elementwise ops of E nodes and
       of tensors outside D, views, casts, slices, gathers by indices outside D), or
    A  affine in E's elements with coefficients outside D (sum / mean over any dims, +, -, neg,
       and * or / by a tensor outside D),

and a nonlinear op takes E operands only. Then dL/dlp_t = sum_e (dL/de) (de/dlp_t), where dL/de
does not depend on any log-prob (A is affine) and e only on token t's: token t's gradient is a
function of its own log-prob and entropy alone. That holds for the losses trainers write
(per-token ratio, clip, KL, masks, any normalizer of the mask; TRL's and verl's GRPO / DAPO /
Dr. GRPO / BNPO aggregations), and not for GSPO's sequence-mean log-ratio (a nonlinear function
of a sum) or a normalizer computed from the log-probs: those keep the recompute op.

So the loss subgraph f(lp, ent, inputs) -> L (the nodes of D that L depends on, the tensors
outside D as inputs) is cut out, and the op is replaced by the fused schedule
(lowerings/linear_logprobs/fused) whose per-block gradient is autograd's: a vector-Jacobian
product of f's per-token part at the block's own rows, with the affine part's coefficients
(local_grad.py), or, where the per-token part is not per-token in [...], the gradient of f
(``torch.func.grad``) with the block's log-probs in their places and zeros elsewhere: the other
tokens' values do not enter a token's gradient (A's coefficients are constants, and an
elementwise backward moves nothing across tokens). The rows no mask selects are not computed at
all (rows.py). The schedule returns dX, dW and d_bias;
the loss output is replaced by ``attach(L, ...)``, whose backward hands them to hidden, weight
and bias times the incoming gradient and passes that gradient on to L's own graph, computed from
the detached log-probs (so a gradient of L through anything besides the log-probs, an auxiliary
loss, a learnable coefficient, is autograd's as before).

Where it does not apply, the recompute op stays and the reason is counted in
``counters["compiled_grpo_gradient"]`` (FUSED_GRADIENT_REASONS); ``["fused"]`` counts the rewrites.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node
from torch.utils._pytree import tree_flatten

from lowerings.linear_logprobs.device import is_static
from lowerings.linear_logprobs.fused import plan as _plan
from lowerings.linear_logprobs.fused import schedule as _op
from lowerings.linear_logprobs.fused import steps as _steps
from lowerings.linear_logprobs.op import upcast_lm_head
from lowerings.naive_fusion import local_grad as _local
from lowerings.naive_fusion import rows as _rows
from lowerings.naive_fusion.nodes import _DIV, _MUL, _cast_dtype, _erase_dead, _is, _val

# Where the rewrite applies: CUDA (the Triton blocks) and CPU (the PyTorch body: the CPU tests).
FUSED_GRADIENT_ON = ("cuda", "cpu")
# The workspace of one block's [R, V] logits (the pass has no config): grpo_loss's default.
WORKSPACE_MIB = _plan.WORKSPACE_MIB

FUSED_GRADIENT_REASONS = {
    "fused": "rewritten: the loss's gradient formed in the forward's blocks",
    "no_grad": "neither hidden nor weight requires a gradient (the forward alone)",
    "device": "a device without the fused schedule (FUSED_GRADIENT_ON)",
    "no_loss": "no single scalar graph output takes a gradient from the log-probs",
    "not_separable": "the loss is not a sum of per-token terms of the log-probs (GSPO, a normalizer "
                     "of the log-probs, an op the classifier does not know)",
    "lse": "the loss reads the log-sum-exp itself (the schedule forms no gradient for it)",
}

E, A = "E", "A"
_SIZE = "size"   # a non-tensor node of D (a size): no value of the log-probs

_LINEAR_FNS = (operator.add, torch.add, operator.sub, torch.sub, operator.neg, torch.neg)
_LINEAR_METHODS = ("add", "sub", "neg")
_REDUCE_FNS = (torch.sum, torch.mean)
_REDUCE_METHODS = ("sum", "mean")
# ops that move or copy elements (each output element is one input element) or cast them
_LAYOUT_FNS = (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze, torch.transpose,
               torch.permute, torch.movedim, operator.getitem, torch.gather, torch.take_along_dim,
               torch.index_select, torch.stack, torch.cat, torch.concat, torch.broadcast_to)
_LAYOUT_METHODS = ("view", "reshape", "unsqueeze", "squeeze", "flatten", "expand", "expand_as",
                   "permute", "transpose", "t", "contiguous", "clone", "view_as", "reshape_as",
                   "gather", "index_select", "take_along_dim", "float", "half", "bfloat16", "double",
                   "to", "type_as", "detach", "movedim", "broadcast_to")
# elementwise ops, nonlinear in general (so: E operands only)
_POINTWISE_FNS = (torch.exp, torch.log, torch.log1p, torch.expm1, torch.exp2, torch.sigmoid,
                  torch.tanh, torch.abs, torch.sqrt, torch.rsqrt, torch.clamp, torch.clip,
                  torch.clamp_min, torch.clamp_max, torch.minimum, torch.maximum, torch.where,
                  torch.pow, torch.square, torch.sign, torch.relu, F.relu, F.softplus, F.logsigmoid,
                  torch.nan_to_num, torch.masked_fill, torch.lt, torch.gt, torch.le, torch.ge,
                  torch.eq, torch.ne, torch.logical_and, torch.logical_or, torch.logical_not,
                  torch.isfinite, torch.isnan, torch.reciprocal, operator.lt, operator.gt,
                  operator.le, operator.ge, operator.eq, operator.ne, operator.and_, operator.or_,
                  operator.invert, operator.pow, torch.rsub) + _MUL + _DIV
_POINTWISE_METHODS = ("exp", "log", "log1p", "expm1", "exp2", "sigmoid", "tanh", "abs", "sqrt",
                      "rsqrt", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum",
                      "pow", "square", "sign", "relu", "nan_to_num", "masked_fill", "where", "lt",
                      "gt", "le", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not",
                      "isfinite", "isnan", "reciprocal", "mul", "div", "rsub", "__rsub__",
                      # torch 2.11's Dynamo records some `a == b` of tensors as call_method __eq__
                      "__eq__", "__ne__", "__lt__", "__gt__", "__le__", "__ge__")
# torch.min / max: elementwise with a second tensor, a reduction (nonlinear) with a dim or alone
_MINMAX_FNS = (torch.min, torch.max)
_MINMAX_METHODS = ("min", "max")


def _tensor_like(n: Node) -> bool:
    """A node of a tensor (or one the pass inserted, which has no example value yet)."""
    v = n.meta.get("example_value")
    return v is None or isinstance(v, Tensor)


def _requires_grad(n: Node) -> bool:
    v = n.meta.get("example_value")
    return True if v is None else isinstance(v, Tensor) and v.requires_grad


def _classify(n: Node, cls: dict) -> Optional[str]:
    """n's class (E or A) given its D operands' classes in ``cls``; None: not separable."""
    if any(a in cls and cls[a] is None for a in n.all_input_nodes):
        return None
    # D operands by occurrence (x * x is two: all_input_nodes would count x once)
    ins = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, Node) and cls.get(a) in (E, A)]
    kinds = {cls[a] for a in ins}
    worst = A if A in kinds else E
    if _is(n, _LAYOUT_FNS, _LAYOUT_METHODS):
        # an index that depends on the log-probs would move values across tokens
        if any(a in ins for a in n.all_input_nodes[1:]) and not _is(n, (torch.stack, torch.cat, torch.concat)):
            return None
        return worst
    if _is(n, _REDUCE_FNS, _REDUCE_METHODS):
        return A
    if _is(n, _LINEAR_FNS, _LINEAR_METHODS):
        return worst
    if _is(n, _MUL, ("mul",)) and len(ins) == 1:
        return worst                                   # a constant (outside D) times E or A
    if _is(n, _DIV, ("div",)) and len(ins) == 1 and n.args[0] in cls:
        return worst                                   # E or A over a constant
    sel = _rows.selection(n)
    if sel is not None:   # where(c, x, y) / masked_fill(x, m, v), c / m outside D: each element
        cond = sel[1]        # one of x's or y's, so affine where they are
        if cond in ins:
            return E if kinds == {E} else None
        return worst
    if _is(n, _MINMAX_FNS, _MINMAX_METHODS):
        other = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
        if not isinstance(other, Node) or not _tensor_like(other):
            return None                                # a reduction: nonlinear across tokens
        return E if kinds == {E} else None
    if _is(n, _POINTWISE_FNS, _POINTWISE_METHODS):
        return E if kinds == {E} else None
    return None


def _loss_output(graph: Graph, dep: set) -> Optional[Node]:
    """The one graph output that D reaches with a gradient, a one-element tensor, else None."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = [a for a in tree_flatten(out.args)[0] if isinstance(a, Node)]
    grads = {a for a in leaves if a in dep and _requires_grad(a)}
    if len(grads) != 1:
        return None
    (loss,) = grads
    v = _val(loss)
    return loss if v is not None and v.numel() == 1 else None


def _ancestry(loss: Node, dep: set) -> list:
    """The nodes of D that ``loss`` depends on (itself included), in graph order."""
    seen, work = set(), [loss]
    while work:
        n = work.pop()
        if n in seen or n not in dep:
            continue
        seen.add(n)
        work.extend(n.all_input_nodes)
    return [n for n in loss.graph.nodes if n in seen]


def _loss_graph(sources: list, body: list, dep: set, loss: Node) -> tuple[GraphModule, list]:
    """f(*sources, *inputs) -> loss as a GraphModule, and the input nodes (outside D) it reads.
    A node the user computed without a gradient (no_grad, .detach()) is detached in f too."""
    g = Graph()
    env = {s: g.placeholder(f"src{i}") for i, s in enumerate(sources)}
    inputs = []
    for n in body:
        for a in ([] if n in env else n.all_input_nodes):
            if a not in dep and a not in env:
                env[a] = g.placeholder(f"in{len(inputs)}")
                inputs.append(a)
    for n in body:
        if n not in env:
            env[n] = _local.copy_node(g, n, env)
    g.output(env[loss])
    return GraphModule(torch.nn.Module(), g), inputs


_LOSSES: dict = {}   # key -> f, read while the rewritten graph is traced (AOTAutograd)


def fuse_loss_gradient(graph: Graph, out: Node) -> str:
    """Replace the `linear_logprobs_call` node ``out`` by the fused schedule when its log-probs
    feed a token-separable loss; returns FUSED_GRADIENT_REASONS' key (counted)."""
    reason = _try_fuse(graph, out)
    counters["compiled_grpo_gradient"][reason] += 1
    return reason


def _known(n: Node) -> Optional[Tensor]:
    """The example value of n or, for a node the pass inserted, of its first input's chain."""
    while isinstance(n, Node) and _val(n) is None and n.args:
        n = n.args[0]
    return _val(n)


_VIEWS = ("unsqueeze", "squeeze", "view", "reshape")


def _strip(n: Node) -> Node:
    """n's source through views and casts to fp32 (ops that keep every value)."""
    while isinstance(n, Node) and (_is(n, (torch.unsqueeze, torch.squeeze, torch.reshape), _VIEWS)
                                   or _cast_dtype(n) == torch.float32):
        n = n.args[0]
    return n


def _cancel_lse(graph: Graph, lp: Node, lse: Node, ent: Optional[Node]) -> None:
    """The rewrite hands z[t] = lp + lse and sum(p z) = lse - ent to code that spells the log-prob
    as z[t] - logsumexp(z) (TRL's fp32 selective_log_softmax, verl's logprobs_from_logits) and the
    entropy as logsumexp(z) - sum(p z) (verl's entropy_from_logits): (lp + lse) - lse and
    lse - (lse - ent), a gradient of the lse that cancels, which the schedule cannot take. Each
    such subtraction becomes lp (or ent) itself, in its shape and dtype: the more exact value (no
    rounding of lp + lse). Static shapes only (the reshape's sizes): under dynamic ones the lse
    stays, and the loss keeps the recompute op (counted "lse")."""
    dead = []
    for n in list(graph.nodes):
        v = _val(n)
        if not (_is(n, (operator.sub, torch.sub), ("sub",)) and len(n.args) == 2 and not n.kwargs
                and v is not None and all(isinstance(d, int) for d in v.shape)):
            continue
        a, b = (_strip(x) for x in n.args)
        if b is lse and _is(a, (operator.add, torch.add), ("add",)) and a.args[:2] == (lp, lse):
            src = lp
        elif (ent is not None and a is lse and _is(b, (operator.sub, torch.sub), ("sub",))
              and b.args[:2] == (lse, ent)):
            src = ent
        else:
            continue
        with graph.inserting_before(n):
            r = graph.call_method("reshape", (src, tuple(v.shape)))
            r = r if v.dtype == torch.float32 else graph.call_method("to", (r, v.dtype))
        n.replace_all_uses_with(r)
        dead += n.args
        graph.erase_node(n)
    _erase_dead(graph, dead)   # the (lp + lse), (lse - ent) chains, up to the add / sub


def _elementwise(n: Node) -> bool:
    """n computes each element from the same element of its operands (rows.py's per-token ops)."""
    if _is(n, _MINMAX_FNS, _MINMAX_METHODS):
        other = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
        return isinstance(other, Node) and _tensor_like(other)
    return _is(n, _POINTWISE_FNS + _LINEAR_FNS, _POINTWISE_METHODS + _LINEAR_METHODS)


def _classes(graph: Graph, out: Node) -> tuple[dict, dict]:
    """(the op's output getitems by index, the class of every node of D)."""
    outs = {u.args[1]: u for u in out.users if u.target is operator.getitem}
    cls = {u: E for u in outs.values()}
    for n in graph.nodes:   # D, in order: every node downstream of the op's outputs
        if n in cls or n.op == "output" or not any(a in cls for a in n.all_input_nodes):
            continue
        # a size or dtype of a D tensor carries no log-prob value: no class, copied into f
        cls[n] = _classify(n, cls) if _tensor_like(n) else _SIZE
    return outs, cls


def _try_fuse(graph: Graph, out: Node) -> str:
    h, w, bias = out.args[0], out.args[1], out.args[3]
    vh, vw = _known(h), _known(w)
    if vh is not None and vw is not None and not (vh.requires_grad or vw.requires_grad):
        return "no_grad"
    if vw is not None and vw.device.type not in FUSED_GRADIENT_ON:
        return "device"
    outs, cls = _classes(graph, out)
    if 2 in outs and (0 in outs or 1 in outs):
        _cancel_lse(graph, outs.get(0), outs[2], outs.get(1))
        outs, cls = _classes(graph, out)
    dep = set(cls)
    loss = _loss_output(graph, dep)
    if loss is None:
        return "no_loss"
    body = _ancestry(loss, dep)
    if any(cls[n] is None for n in body):
        return "not_separable"
    if 2 in outs and outs[2] in body:
        return "lse"
    lead = out.meta.get("lead")
    rp = _rows.plan_rows(graph, list(outs.values()), dep, _elementwise, lead) if lead is not None \
        else _rows.RowPlan("read", {})
    counters["compiled_grpo_rows"][rp.reason] += 1
    row_mask = None
    if rp.reason == "masked":   # the products guarded (rows.py), then D again: they are in it
        _rows.guard_products(graph, rp)
        outs, cls = _classes(graph, out)
        dep = set(cls)
        body = _ancestry(loss, dep)
        with graph.inserting_before(out):
            row_mask = _rows.emit_row_mask(graph, rp, out.args[2], lead)
    names = tuple(k for i, k in ((0, "lp"), (1, "ent")) if i in outs and outs[i] in body)
    sources = [outs[("lp", "ent").index(k)] for k in names]
    local = _local.split(body, cls, sources, dep, loss, rp.forms, E)
    counters["compiled_grpo_block_gradient"]["local" if local is not None else "placed"] += 1
    if local is not None:
        f, inputs = local, [*local.e_inputs, *local.a_inputs]
    else:
        f, inputs = _loss_graph(sources, body, dep, loss)
    code = f.f_rows.code + f.f_affine.code if local is not None else f.code
    key = hashlib.sha1(code.encode()).hexdigest()[:16]
    _LOSSES[key] = f
    args = (*out.args, 1.0, None)[:9] if len(out.args) < 9 else out.args
    with graph.inserting_before(out):
        fc = graph.call_function(fused_call, (*args, key, names, row_mask, *inputs))
    out.replace_all_uses_with(fc)
    graph.erase_node(out)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        grads = [graph.call_function(operator.getitem, (fc, i)) for i in (3, 4, 5)]
        att = graph.call_function(attach_loss, (loss, h, w, bias, *grads))
    output.replace_input_with(loss, att)
    return "fused"


def fused_call(hidden, weight, ids, bias, temperature, fp32_lm_head, with_entropy, logit_scale,
               final_logit_softcapping, key, names, row_mask, *inputs):
    """What the rewrite inserts: (logprobs, entropy, lse) [...] as linear_logprobs_call returns
    them, detached, and (dX, dW, d_bias) of the loss f = _LOSSES[key] (None where not needed),
    formed block by block by the fused schedule. ``names``: which of lp / ent f's first
    arguments are; ``row_mask`` [N] bool: the rows the graph reads (rows.py; None: all), the
    others skipped, their outputs 0; ``inputs``: f's other arguments (a local_grad.LocalLoss:
    its e_inputs, then its a_inputs)."""
    f = _LOSSES[key]
    need = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    dtypes = [None if t is None else t.dtype for t in (hidden, weight, bias)]
    exact = False
    if fp32_lm_head:
        hidden, weight, bias, exact = upcast_lm_head(hidden, weight, bias)
    lead = ids.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])                              # [N, H]
    n = h2.shape[0]
    budget = _plan.budget_rows(h2, weight, WORKSPACE_MIB, weight.shape[0])
    # a symbolic N (dynamic shapes): static R and G a step of plan.COMPILED_BLOCKS, as
    # grpo_loss's compiled fused mode plans, so that a new N rarely recompiles
    blocks, rows = _plan.token_blocks(h2, weight, budget, n, not is_static(n))
    if isinstance(f, _local.LocalLoss):
        grad_fn, on_order = _local.local_grad_fn(f, names, inputs, lead, h2)
    else:
        grad_fn, on_order = _local.placed_grad_fn(f, names, inputs, lead, n, blocks * rows)
    res = _op.fused_linear_logprobs(
        h2, weight, ids.reshape(-1), bias, row_mask, grad_fn, blocks=blocks, block_rows=rows,
        temperature=float(temperature), with_entropy=bool(with_entropy),
        logit_scale=float(logit_scale), softcap=final_logit_softcapping, need_x=need[0],
        need_w=need[1], need_b=need[2], entropy_grad="ent" in names, exact_tf32=exact,
        on_order=on_order)
    dx, dw, db = (None if g is None else g.to(dt)
                  for g, dt in zip((res.d_hidden, res.d_weight, res.d_bias), dtypes))
    dx = None if dx is None else dx.view(*lead, -1)
    ent = res.entropy.view(lead) if with_entropy else None
    return res.logprobs.view(lead), ent, res.lse.view(lead), dx, dw, db


def attach_loss(loss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor]) -> Tensor:
    """The loss value carrying the gradients the fused schedule formed (fused_call)."""
    return _steps.AttachGrads.apply(loss, hidden, weight, bias, dx, dw, db)
