"""Inductor pre-grad pass: a user's naive log-prob / entropy code -> `linear_logprobs`.

Legend: H hidden size, V vocab size, [...] the leading dims of hidden (B, T or N), N = prod([...]).

Rewrites, on the Dynamo torch-IR graph (before AOTAutograd, so the backward is the op's own
autograd and training, inference, frozen and trainable W are all one rewrite):

    logits = GEMM(h, W)                    # h @ W.T | torch.matmul(h, W.t()) | F.linear(h, W[, b])
                                           #   | nn.Linear | W.mT, W.transpose(0, 1), torch.mm
                                           #   | einsum("...h,vh->...v") | inside torch.autocast
    (first, loops.fold_row_loops: TRL / verl's per-row and per-chunk loops, as one computation)
      .float() / .to(float32) on h and W   -> fp32_lm_head=True             (cast before the GEMM)
      .float() / .to(dtype) on the logits  -> bf16 GEMM, fp32 accumulation  (cast after)
      + b, / c, * c (c a Python number)    -> bias=, temperature= (b added after a scale: b*T)
      c * tanh(z * s / c) (HF softcap), * s -> final_logit_softcapping=, logit_scale= (one tanh;
                                              after it only scales, casts and views)
      [:, :-1], [:, -k:], .view(-1, V)     -> the same leading-dim view applied to h (TRL, verl)
      .squeeze(0), / t, * t (0-dim / per-row t) -> h.squeeze(0), h / t (verl's remove-padding path)
      (first, normalize.py: logits.div_(t), logits /= t as z / t; log_softmax(z)[:, :-1] as
       log_softmax(z[:, :-1]); nll_loss(log_softmax(z), t) as cross_entropy(z, t);
       logp[arange(N), ids] as a gather; Categorical's log_prob / entropy spellings;
       complement.py: -softplus(logsumexp(where(is_target, min, z)) - z_t) as the log-prob)
    consumers of the logits z (all of them must be one of these):
      log_softmax(z, -1).gather(-1, ids.unsqueeze(-1) | ids[..., None])     -> logprobs
      z.gather(-1, idx) - z.logsumexp(-1, keepdim=True), logsumexp(z, -1)  -> logprobs + lse, lse
      -F.cross_entropy(z.view(-1, V), ids.view(-1), reduction="none")       -> where(ign, 0, -lp)
        (or of z.transpose(1, 2), [B, V, T]; "sum" / "mean": summed / over the kept targets;
         weight=w: each term w[t] * nll, the mean over the kept targets' weights; label_smoothing
         without a softcap: the mean logit is linear in the head, cross_entropy.py)
      -(softmax(z, -1) * log_softmax(z, -1)).sum(-1), -(logp.exp() * logp).sum(-1),
      lse - (softmax(z, -1) * z).sum(-1)                                    -> entropy
      z.detach().min(-1).values, .amax(-1), z.max() under no_grad (metrics) -> linear_logits_extrema
        (of z or of a node of its chain: extrema.py; one forward GEMM more, no [N, V] logits)
    (F.* / torch.* / Tensor-method spellings, dim=-1 or the last dim's index, keepdim either way)

into one `linear_logprobs(h, W, ids, b, temperature=, fp32_lm_head=, with_entropy=)` call per
logits node: when log-prob and entropy read the same logits, one call with with_entropy=True
serves both. The `[N, V]` logits then never exist (4*N*V bytes per copy; naive training code
keeps two to three copies). cross_entropy keeps its `ignore_index` semantics exactly: the op
sees `ids.masked_fill(ids == ignore_index, 0)` and the result is
`(-logprobs).masked_fill(ids == ignore_index, 0)`, as are the gradients.

The pass is conservative: it rewrites only when *every* user of the logits is one of the matched
consumers (otherwise the logits are needed anyway), when no in-place op (but a write, before the
first consumer, to a tensor the graph made and the fused call does not read) lies between the
GEMM and its consumers, nor a grad-mode switch before the first consumer (an autocast switch is
fine: gemm.autocast_dtypes; a no_grad region of later consumers too: region.no_grad_nodes), and
when the dtypes are fp32/bf16/fp16 (fp64 code is left alone: the CUDA kernels compute in fp32).
Each replaced node gets the dtype the naive node had.
Every rewrite bumps `torch._dynamo.utils.counters["compiled_grpo"]["naive_logprob_fusion"]`
and/or `["naive_entropy_fusion"]`. Every log_softmax / logsumexp / cross_entropy the pass leaves
in a graph bumps `counters["compiled_grpo_unfused"][reason]` (UNFUSED_REASONS) and logs a warning
the first time a process meets that reason.

Usage: `enable_naive_logprob_fusion()` before the first call of a `torch.compile`d function
(Dynamo caches compiled frames, so a later toggle does not recompile them).
"""
import contextlib
import glob
import logging
import operator
import os
import sys
from typing import Any, Optional

import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from lowerings.naive_fusion.cross_entropy import cross_entropy_results
from lowerings.naive_fusion.gemm import _match_gemm, autocast_dtypes
from lowerings.naive_fusion.match import _ids_source, _match_consumers, _replaced, _walk_logits
from lowerings.naive_fusion.region import _region_is_clean, no_grad_nodes
from lowerings.naive_fusion.nodes import _erase_dead, _is_gemm, _val
from lowerings.linear_logprobs.op import linear_logprobs
from lowerings.naive_fusion.loops import fold_row_loops, settle_folds
from lowerings.naive_fusion import categorical, complement, extrema, normalize, separable
from lowerings.naive_fusion.unfused import UNFUSED_REASONS, _report_unfused

# The fused-gradient rewrite (separable.py) after the log-prob rewrite; False: the recompute op
# always (the op's own backward: one more head GEMM, no [N, V] logits either).
FUSED_GRADIENT = True

log = logging.getLogger(__name__)


def linear_logprobs_call(hidden, weight, ids, bias, temperature, fp32_lm_head, with_entropy,
                         logit_scale=1.0, final_logit_softcapping=None):
    """The call the pass inserts: a stable FX target returning (logprobs, entropy, lse) [...]."""
    out = linear_logprobs(hidden, weight, ids, bias, temperature=temperature,
                          fp32_lm_head=fp32_lm_head, with_entropy=with_entropy,
                          logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping)
    return out.logprobs, out.entropy, out.lse


def _rewrite(graph: Graph, m: dict, wk: dict, c: dict, frozen: frozenset = frozenset()) -> Node:
    """Replace the matched GEMM and consumers by one linear_logprobs_call; returns that node.
    ``frozen``: consumers that ran under no_grad (region.no_grad_nodes): their values detached."""
    vL, temp, bias, bias_temp = _val(wk["L"]), wk["temp"], wk["bias"], wk["bias_temp"]
    replaced = _replaced(c)
    trl_lp, trl_ent = (any(i == j for k in c["trl"] for _, i in k["outs"]) for j in (0, 1))
    bodies = [b for k in c["trl"] for g, _ in k["outs"][:1] for b in g.args[0].args[:2]]
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(replaced, key=order.__getitem__)

    def cast(node: Node, like: Node) -> Node:
        dt = _val(like).dtype
        node = node if dt == torch.float32 else graph.call_method("to", (node, dt))
        return graph.call_method("detach", (node,)) if like in frozen else node

    with graph.inserting_before(anchor):
        h, w = m["h"], m["w"]
        if m["autocast"] is not None:   # autocast's casts of the operands, made explicit
            h, w = (graph.call_method("to", (x, m["autocast"])) for x in (h, w))
            if bias is not None:
                bias = graph.call_method("to", (bias, m["autocast"]))
        if m["mixed"]:          # e.g. bf16 h, fp32 W, both cast by the user: keep fp32 inputs
            h, w = (x if _val(x).dtype == torch.float32 else graph.call_method("float", (x,))
                    for x in (h, w))
        dead = []           # min / max metrics of chain nodes before the logits, at their views

        def metrics(k: int, h: Node) -> None:
            dead.extend(n for s in wk["sides"] if s["lead"] == k
                        for n in extrema.replace_side(graph, s, h, w, bias, m["fp32_lm_head"]))
        metrics(0, h)
        for i, (method, args) in enumerate(wk["lead_ops"]):   # the logits' leading-dim views, on h
            if method == "reshape":
                args = (*args, graph.call_method("size", (h, -1)))
            h = graph.call_method(method, (h, *args))
            metrics(i + 1, h)
        for t, op in wk["tensor_temps"]:         # z / t = (h / t) @ W.T, z * t likewise
            h = graph.call_function(op, (h, t))
        if bias is not None and bias_temp != temp:   # b added before a scale: fold the ratio in
            bias = graph.call_function(operator.mul, (bias, temp / bias_temp))
        lead_ref = graph.call_function(operator.getitem, (h, (Ellipsis, 0)))    # [...]
        ignored = None
        if c["gathers"]:
            idx = c["gathers"][0][1]
            ids = _ids_source(idx)
            ids = graph.call_method("squeeze", (idx, -1)) if ids is None else ids
        elif c["ce"]:
            tg = c["ce"][0].target
            ignored = graph.call_function(operator.eq, (tg, c["ce"][0].ignore_index))  # [N]
            kept_tg = graph.call_method("masked_fill", (tg, ignored, 0))             # [N]
            ids = graph.call_method("view_as", (kept_tg, lead_ref))                 # [...]
        elif trl_lp:                                # TRL's kernel: (logits / T)[ids]
            ids = next(k["ids"] for k in c["trl"] if any(i == 0 for _, i in k["outs"]))
            if _val(ids).dtype != torch.int64:
                ids = graph.call_method("long", (ids,))
        else:
            ids = graph.call_function(torch.zeros_like, (lead_ref,), {"dtype": torch.int64})
        temperature, scale, cap = wk["scaling"]
        if c["extrema"]:        # the logits' min / max metrics
            dead += extrema.replace_extrema(graph, c["extrema"], h, w, bias, wk["scaling"],
                                            m["fp32_lm_head"])
        if c["trl"]:                                # the kernel's TEMPERATURE on top of the chain's
            temperature = temperature * c["trl"][0]["temperature"]
        extra = () if cap is None else (float(scale), float(cap))      # a softcap in the chain
        out = graph.call_function(linear_logprobs_call, (
            h, w, ids, bias, float(temperature), bool(m["fp32_lm_head"]), bool(c["sums"] or trl_ent),
            *extra))
        out.meta["lead"] = tuple(vL.shape[:-1])   # the outputs' [...] (separable's rows plan)
        lp, ent, lse = (graph.call_function(operator.getitem, (out, i)) for i in range(3))
        for k in c["trl"]:                          # TRL's (logprobs, entropy), fp32 as the op's
            for g, i in k["outs"]:
                g.replace_all_uses_with(cast(lp if i == 0 else ent, g))
        for g, _, on_logits in c["gathers"]:        # logp[t]; z[t] = logp[t] + lse
            r = graph.call_function(operator.add, (lp, lse)) if on_logits else lp
            g.replace_all_uses_with(cast(graph.call_method("unsqueeze", (r, -1)), g))
        for s, sign, keepdim, p_times_z in c["sums"]:
            # sum(p*logp) = -H, sum(p*z) = lse - H; sign -1: the product was negated, then summed
            if p_times_z:
                r = graph.call_function(operator.sub, (lse, ent) if sign > 0 else (ent, lse))
            else:
                r = graph.call_function(operator.neg, (ent,)) if sign > 0 else ent
            r = graph.call_method("unsqueeze", (r, -1)) if keepdim else r
            s.replace_all_uses_with(cast(r, s))
        for u, keepdim in c["lses"]:
            u.replace_all_uses_with(cast(graph.call_method("unsqueeze", (lse, -1)) if keepdim
                                         else lse, u))
        for sz in c["sizes"]:                      # logits.size([d]) from h's view and W
            d = sz.args[1] % vL.dim() if len(sz.args) == 2 else None
            if d is not None and d < vL.dim() - 1:
                r = graph.call_method("size", (lead_ref, d))
            elif d is not None:
                r = graph.call_method("size", (w, 0))
            else:
                r = graph.call_function(operator.add, (graph.call_method("size", (lead_ref,)),
                                                       (graph.call_method("size", (w, 0)),)))
            sz.replace_all_uses_with(r)
        if c["ce"]:     # torch's cross_entropy from lp and lse: cross_entropy.py
            results = cross_entropy_results(graph, c["ce"], lp, lse, ignored, kept_tg,
                                            (h, w, bias, temperature))
            for x, r in zip(c["ce"], results):
                x.node.replace_all_uses_with(cast(r, x.node))
    _erase_dead(graph, [lead_ref, lp, ent, lse, *replaced, *c["sizes"], *dead])  # cascades up the naive chain
    for b in bodies:            # TRL's autograd.Function bodies (get_attr), once their call is gone
        if not b.users and not getattr(b, "_erased", False):
            graph.erase_node(b)
    return out


def naive_logprob_fusion_pass(graph: Graph) -> int:
    """Rewrite every matched naive log-prob / entropy computation in `graph`; return the count.
    What it leaves is counted by reason (UNFUSED_REASONS)."""
    rewrites = []         # the linear_logprobs_call nodes inserted
    tried: dict = {}      # GEMM node -> why it was left alone
    autocast = autocast_dtypes(graph)
    scales = normalize.scales_out_of_place(graph)      # verl's logits.div_(t), logits /= t
    views = normalize.views_before_log_softmax(graph)  # NeMo-RL's log_softmax(z)[:, :-1]
    views += normalize.nll_of_log_softmax(graph)       # F.nll_loss(log_softmax(z), t): CE
    views += normalize.fancy_index_as_gather(graph)    # logp[arange(N), ids]: a gather
    views += categorical.categorical_spelling(graph)   # torch.distributions.Categorical
    views += complement.complement_as_log_softmax(graph)   # -softplus(lse(others) - z_t)
    folds = fold_row_loops(graph)   # TRL / verl's per-row and per-chunk loops, as one computation
    for node in [n for n in graph.nodes if _is_gemm(n)]:
        if getattr(node, "_erased", False):
            continue
        try:        # a matcher bug must cost the fusion, never the user's compile
            m = _match_gemm(node, autocast.get(node))
            wk = _walk_logits(m) if m is not None else None
            c = _match_consumers(wk["L"]) if wk is not None else None
        except Exception:                           # noqa: BLE001
            log.warning("naive_logprob_fusion: matcher failed on %s; left alone", node,
                        exc_info=True)
            tried[node] = "matcher_error"
            continue
        if m is None:
            tried[node] = "gemm_unmatched"
            continue
        if c is None or wk["scaling"] is None or (wk["scaling"][2] is not None
                                                  and any(x.label_smoothing for x in c["ce"])):
            # (label smoothing reads every logit through their sum: linear only without a softcap)
            log.debug("naive_logprob_fusion: %s has unmatched users; left alone", wk["L"])
            tried[node] = "logits_users"
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_use = min(_replaced(c), key=order.__getitem__)
        reads = (m["h"], m["w"], wk["bias"], *(t for t, _ in wk["tensor_temps"]), *wk["chain"],
                 *(x.weight for x in c["ce"] if x.weight is not None))     # cross_entropy's class weights
        metrics = extrema.all_extrema(c, wk)
        last_use = max(_replaced(c) + [e.node for e in metrics], key=order.__getitem__)
        frozen = no_grad_nodes(graph, node, last_use)   # consumers under torch.no_grad()
        if frozen is None or first_use in frozen or any(x in frozen for x in wk["chain"]) \
                or not _region_is_clean(graph, node, last_use, first_use, reads, no_grad_ok=True):
            tried[node] = "region"
            continue
        if not extrema.grad_free(metrics, frozen, wk["L"]):   # a max with a gradient
            tried[node] = "logits_users"
            continue
        rewrites.append(_rewrite(graph, m, wk, c, frozenset(frozen)))
        outs = {i for k in c["trl"] for _, i in k["outs"]}     # TRL's kernel: 0 logprobs, 1 entropy
        if c["gathers"] or c["ce"] or c["lses"] or 0 in outs:
            counters["compiled_grpo"]["naive_logprob_fusion"] += 1
        if c["sums"] or 1 in outs:
            counters["compiled_grpo"]["naive_entropy_fusion"] += 1
        if metrics:
            counters["compiled_grpo"]["naive_extrema_fusion"] += 1
    kept = settle_folds(graph, folds)   # a fold no rewrite used: the user's loop back
    if kept:
        counters["compiled_grpo"]["naive_row_loop_fold"] += kept
    for name, edits in (("naive_respelled", views), ("naive_inplace_scale", scales)):
        kept = normalize.settle(graph, edits)   # likewise the user's spelling back
        if kept:
            counters["compiled_grpo"][name] += kept
    if rewrites or folds or scales or views:
        stable_topological_sort(graph)
    # then, on the sorted graph: a token-separable loss of the log-probs takes the fused schedule
    fused = [separable.fuse_loss_gradient(graph, out) for out in rewrites] if FUSED_GRADIENT else []
    if "fused" in fused:
        stable_topological_sort(graph)
    if rewrites or folds or scales or views:
        graph.lint()
    _report_unfused(graph, tried)
    return len(rewrites)


# ---------------------------------------------------------------------------------------------
# Installation into torch._inductor.config.pre_grad_custom_pass.

def _source_files() -> tuple:
    here = os.path.dirname(os.path.abspath(__file__))
    op_files = {os.path.abspath(sys.modules[f.__module__].__file__)
                for f in (linear_logprobs, extrema.linear_logits_extrema)}
    files = set(glob.glob(os.path.join(here, "**", "*.py"), recursive=True)) | op_files
    return tuple(sorted(files))


class NaiveLogprobFusion(CustomGraphPass):
    """The pass object; `uuid()` hashes the lowerings sources (this pass and the op it emits)."""

    def __call__(self, graph: Graph) -> None:
        naive_logprob_fusion_pass(graph)

    def uuid(self) -> Optional[Any]:
        return get_hash_for_files(_source_files())


class _Chained(CustomGraphPass):
    """The user's earlier pre-grad pass(es), then ours: torch 2.11 takes one callable per hook."""

    def __init__(self, previous: Any, ours: CustomGraphPass):
        self.previous, self.ours = previous, ours
        # torch 2.13 names a uuid-less pre-grad pass in a warning by __qualname__: name the user's
        prev = previous if isinstance(previous, (list, tuple)) else (previous,)
        self.__qualname__ = "+".join(getattr(p, "__qualname__", type(p).__qualname__) for p in prev)

    def __call__(self, graph: Graph) -> None:
        for p in (self.previous if isinstance(self.previous, (list, tuple)) else (self.previous,)):
            p(graph)
        self.ours(graph)

    def uuid(self) -> Optional[Any]:
        prev = self.previous if isinstance(self.previous, (list, tuple)) else (self.previous,)
        if not all(isinstance(p, CustomGraphPass) for p in prev):
            return None                 # a plain callable: Inductor bypasses its caches, as before
        uuids = [p.uuid() for p in prev]
        return None if any(u is None for u in uuids) else (*uuids, self.ours.uuid())


_PASS = NaiveLogprobFusion()


def is_naive_logprob_fusion_enabled() -> bool:
    cur = inductor_config.pre_grad_custom_pass
    return cur is _PASS or (isinstance(cur, _Chained) and cur.ours is _PASS)


def enable_naive_logprob_fusion() -> None:
    """Install the pass (idempotent), after any pre-grad pass the user already set."""
    if is_naive_logprob_fusion_enabled():
        return
    cur = inductor_config.pre_grad_custom_pass
    empty = cur is None or (isinstance(cur, (list, tuple)) and not cur)
    inductor_config.pre_grad_custom_pass = _PASS if empty else _Chained(cur, _PASS)


def disable_naive_logprob_fusion() -> None:
    """Remove the pass, restoring exactly the pre-grad pass that was set before enabling."""
    cur = inductor_config.pre_grad_custom_pass
    if cur is _PASS:
        inductor_config.pre_grad_custom_pass = None
    elif isinstance(cur, _Chained) and cur.ours is _PASS:
        inductor_config.pre_grad_custom_pass = cur.previous


@contextlib.contextmanager
def naive_logprob_fusion():
    """`with naive_logprob_fusion(): compiled_fn(...)`: enabled for compiles inside the block."""
    was_enabled = is_naive_logprob_fusion_enabled()
    enable_naive_logprob_fusion()
    try:
        yield
    finally:
        if not was_enabled:
            disable_naive_logprob_fusion()


__all__ = ["UNFUSED_REASONS", "NaiveLogprobFusion", "enable_naive_logprob_fusion",
           "disable_naive_logprob_fusion", "is_naive_logprob_fusion_enabled", "naive_logprob_fusion",
           "naive_logprob_fusion_pass"]
