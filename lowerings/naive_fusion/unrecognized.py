"""Log-prob computations the pass does not recognize, found so that none is left in silence: a
GEMM it matched as logits = h @ W.T whose logits reach a reduction over the vocabulary through
an exp (a softmax or log-sum-exp written by hand: max, exp, sum), or enter a user
``torch.autograd.Function`` (Dynamo records its body as a subgraph of
``autograd_function_apply``: the log-softmax inside is not in this graph).

RMSNorm's reduction over the hidden size has no exp before it, nor does any reduction of an MLP
or attention projection the pass matched; attention's own softmax is torch's, over a q @ k.T
the pass does not match as an lm_head.
"""
from __future__ import annotations

from torch.fx import Node

import torch

from lowerings.naive_fusion.nodes import _arg, _is, _val

_REDUCTIONS = ((torch.sum, torch.amax, torch.max, torch.logsumexp, torch.mean),
               ("sum", "amax", "max", "logsumexp", "mean"))
_EXP = ((torch.exp, torch.exp2), ("exp", "exp2"))
DEPTH = 12


def _over_last(n: Node, vocab: int) -> bool:
    """n reduces its input's last dim, of size vocab."""
    x, dim = n.args[0] if n.args else None, _arg(n, 1, "dim", None)
    v = _val(x) if isinstance(x, Node) else None
    if v is None or v.dim() == 0 or v.shape[-1] != vocab:
        return False
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d % v.dim() == v.dim() - 1 for d in dims)


def vocab_reduction(gemm: Node) -> bool:
    """Whether the logits of ``gemm`` (matched as an lm_head) reach, within DEPTH ops, a user
    autograd.Function or a reduction over the vocabulary after an exp (module docstring)."""
    v = _val(gemm)
    if v is None or v.dim() == 0:
        return False
    vocab = v.shape[-1]
    frontier, seen = [(gemm, False)], set()
    for _ in range(DEPTH):
        nxt = []
        for n, after_exp in frontier:
            for u in n.users:
                if (u, after_exp) in seen:
                    continue
                seen.add((u, after_exp))
                if u.op == "call_function" and "autograd_function_apply" in str(u.target):
                    return True
                if after_exp and _is(u, *_REDUCTIONS) and _over_last(u, vocab):
                    return True
                nxt.append((u, after_exp or _is(u, *_EXP)))
        frontier = nxt
    return False
