"""Why a log-prob graph was left unfused: `counters["compiled_grpo_unfused"][reason]`, and a
warning the first time a process meets each reason (a torch upgrade that changes how Dynamo
records the user's code must not turn the pass off in silence)."""
import logging

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node

from lowerings.naive_fusion import unrecognized
from lowerings.naive_fusion.nodes import _is, _is_gemm
from lowerings.naive_fusion.trl_kernel import trl_kernel_call

log = logging.getLogger("lowerings.naive_fusion")

UNFUSED_REASONS = {
    "no_gemm": "no matmul / linear / einsum the pass knows feeds the log-softmax (tensordot, "
               "or a spelling this torch records differently)",
    "gemm_unmatched": "the GEMM is not logits = h @ W.T of a 2-D W (dtypes, shapes, layout)",
    "logits_users": "the logits have users other than log-prob / entropy / lse consumers",
    "region": "an in-place op the rewrite cannot move across lies between GEMM and consumers, or a "
              "grad-mode switch before the first consumer",
    "matcher_error": "the matcher raised (a bug: please report it with the graph)",
    "unrecognized": "the lm_head's logits reach a reduction over the vocabulary the pass does not "
                    "recognize (a softmax or log-sum-exp written by hand, or one inside a user "
                    "autograd.Function)",
}
_warned: set = set()
# the ops that mark a log-prob computation (softmax alone is attention's, not counted)
_LOGPROB_SINKS = (torch.log_softmax, torch.nn.functional.log_softmax, torch.special.log_softmax,
                  torch.logsumexp, torch.nn.functional.cross_entropy)


def _unfused(reason: str, node: Node) -> None:
    counters["compiled_grpo_unfused"][reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        log.warning("naive_logprob_fusion: a log-prob computation (%s) left unfused: %s; the "
                    "[N, V] logits stay. Counted in torch._dynamo.utils.counters"
                    "['compiled_grpo_unfused'][%r]; logged once.", node, UNFUSED_REASONS[reason],
                    reason)


def _gemm_upstream(node: Node, depth: int = 16) -> list:
    """The matmul / linear nodes that feed `node` through at most `depth` ops."""
    seen, frontier, found = set(), [node], []
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                (found if _is_gemm(a) else nxt).append(a)
        frontier = nxt
    return found


def _report_unfused(graph: Graph, tried: dict) -> None:
    """Count each log-softmax / logsumexp / cross-entropy still in the graph by why (tried: the
    reason each GEMM the pass looked at was left alone)."""
    reported = set()
    for n in graph.nodes:
        if not (_is(n, _LOGPROB_SINKS, ("log_softmax", "logsumexp")) or trl_kernel_call(n) is not None):
            continue
        gemms = [g for g in _gemm_upstream(n) if g in tried]
        reported.update(gemms)
        _unfused(tried[gemms[0]] if gemms else "no_gemm", n)
    for g, reason in tried.items():   # no sink the pass knows: a hand-written one, or none at all
        if g not in reported and reason == "logits_users" and unrecognized.vocab_reduction(g):
            _unfused("unrecognized", g)
