"""Batch invariance checks shared by the CPU test (test_batch_invariance.py) and the GPU test
(test_batch_invariance_gpu.py), also run as a GPU report by bench/batch_invariance.py.

The property (docs/exactness.md): a row's log-prob and entropy are bitwise the same whatever
computed it: alone (N = 1) or in a batch of any size, at any position, padded or packed, with
any mask, by token_logprobs or by grpo_loss in either gradient mode, eager or under
torch.compile(fullgraph=True). The reference is each sequence computed alone ([1, T], its own
mask); every other way of computing it must give the same bits at the valid positions. So
old log-probs from a separate no-grad call give an on-policy ratio of exactly 1.

Legend: B sequences of T positions, H hidden, V vocab, n_b the valid tokens of sequence b."""
from typing import Callable

import torch

import compiled_grpo as cg


def make_batch(b: int, t: int, h: int, v: int, dtype, device, seed: int = 0):
    """hidden [B, T, H] (scaled like a real head's), weight [V, H], ids [B, T], mask [B, T] right
    padded with lengths from 1 to T (the last sequence full), advantages [B]."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * 2.0).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    ids = torch.randint(0, v, (b, t), generator=g).to(device)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[-1] = t
    mask = (torch.arange(t)[None, :] < lens[:, None]).to(device)
    adv = torch.randn(b, generator=g).to(device)
    return hidden, weight, ids, mask, adv


def _same(name: str, got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, out: dict) -> None:
    """Counts the valid positions where got and ref differ in any bit (NaN == NaN)."""
    g, r = got[mask], ref[mask]
    out[name] = int(((g != r) & ~(g.isnan() & r.isnan())).sum())


def reference(hidden, weight, ids, mask, with_entropy=True, **precision):
    """Each sequence alone: token_logprobs([1, T], its mask) -> (logprobs, entropy) [B, T]."""
    lp, ent = torch.zeros(ids.shape, device=ids.device), torch.zeros(ids.shape, device=ids.device)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            o = cg.token_logprobs(hidden[i:i + 1], weight, ids[i:i + 1], mask=mask[i:i + 1],
                                  with_entropy=with_entropy, **precision)
            lp[i], ent[i] = o.logprobs[0], o.entropy[0]
    return lp, ent


def mismatches(hidden, weight, ids, mask, adv, compile_fn: Callable = torch.compile,
               modes=("fused", "recompute"), singles: int = 4, **precision) -> dict:
    """{way of computing: valid positions whose log-prob or entropy differs from the reference}.
    Every value 0 is batch invariance. ``precision``: lm_head precision settings (round_logits,
    lm_head_dtype, fp32_lm_head) passed to every call alike."""
    out: dict = {}
    lp0, ent0 = reference(hidden, weight, ids, mask, **precision)
    b, t = ids.shape
    with torch.no_grad():
        for name, kw in (("padded", dict(mask=mask)), ("no mask", {})):
            o = cg.token_logprobs(hidden, weight, ids, with_entropy=True, **kw, **precision)
            _same(f"token_logprobs {name}: logprobs", o.logprobs, lp0, mask, out)
            _same(f"token_logprobs {name}: entropy", o.entropy, ent0, mask, out)
        # batch size: the first k sequences, and single rows (N = 1) at a few positions
        for k in sorted({1, max(1, b // 2), b - 1} - {0}):
            o = cg.token_logprobs(hidden[:k], weight, ids[:k], mask=mask[:k], with_entropy=True, **precision)
            _same(f"token_logprobs first {k} sequences", o.logprobs, lp0[:k], mask[:k], out)
        g = torch.Generator().manual_seed(1)
        for _ in range(singles):
            i, j = int(torch.randint(b, (1,), generator=g)), 0
            j = int(torch.randint(int(mask[i].sum()), (1,), generator=g))
            o = cg.token_logprobs(hidden[i, j:j + 1], weight, ids[i, j:j + 1], with_entropy=True, **precision)
            out.setdefault("token_logprobs one row (N = 1)", 0)
            out["token_logprobs one row (N = 1)"] += int((o.logprobs[0] != lp0[i, j]) |
                                                         (o.entropy[0] != ent0[i, j]))
        # packed: the valid tokens only, sequence after sequence
        lens = mask.sum(1)
        cu = torch.zeros(b + 1, dtype=torch.int32, device=ids.device)
        cu[1:] = torch.cumsum(lens, 0)
        o = cg.token_logprobs(hidden[mask], weight, ids[mask], cu_seqlens=cu, with_entropy=True, **precision)
        flat = torch.ones(int(lens.sum()), dtype=torch.bool, device=ids.device)
        _same("token_logprobs packed: logprobs", o.logprobs, lp0[mask], flat, out)
        _same("token_logprobs packed: entropy", o.entropy, ent0[mask], flat, out)
        # compiled token_logprobs
        f = compile_fn(lambda *a: cg.token_logprobs(*a[:3], mask=a[3], with_entropy=True, **precision),
                       fullgraph=True)
        o = f(hidden, weight, ids, mask)
        _same("token_logprobs compiled: logprobs", o.logprobs, lp0, mask, out)
        _same("token_logprobs compiled: entropy", o.entropy, ent0, mask, out)
    # grpo_loss with old log-probs from the separate calls: its logprobs are the same bits (so
    # the ratio is exactly 1), in each gradient mode, eager and compiled, padded and packed
    w = weight.detach().requires_grad_()
    for mode in modes:
        cfg = cg.GRPOConfig(loss_type="dapo", gradient_mode=mode, metrics="with_entropy", **precision)
        r = cg.grpo_loss(hidden, w, ids, adv, mask, lp0, config=cfg)
        _same(f"grpo_loss {mode}: logprobs", r.logprobs, lp0, mask, out)
        _same(f"grpo_loss {mode}: entropy", r.entropy, ent0, mask, out)
        r.loss.backward()
        step = compile_fn(lambda *a, cfg=cfg: cg.grpo_loss(*a, config=cfg), fullgraph=True)
        r = step(hidden, w, ids, adv, mask, lp0)
        _same(f"grpo_loss {mode} compiled: logprobs", r.logprobs, lp0, mask, out)
        r.loss.backward()
        r = cg.grpo_loss(hidden[mask], w, ids[mask], adv, mask[mask], lp0[mask], cu_seqlens=cu,
                         config=cfg)
        _same(f"grpo_loss {mode} packed: logprobs", r.logprobs, lp0[mask], flat, out)
    return out
