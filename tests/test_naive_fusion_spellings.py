"""The naive-fusion pass on more spellings of per-token log-probs, entropy and cross-entropy than
the trainers' own functions (tests/test_naive_fusion_trainers.py), CPU: OpenRLHF's chunked
logsumexp, NeMo-RL's sliced log-probs, ROLL's in-place masked labels, verl's in-place temperature
and chunked entropy written into a buffer, HF's causal-LM loss and cross_entropy in its forms
(mean / sum / [B, V, T] / class weights / nll_loss of log_softmax), arange indexing, numpy's
axis=, gather's keywords, loss modules, torch.distributions.Categorical, `.contiguous()` /
`.clone()` copies of the logits, sequence slices written into a buffer, log-probs through the
complement's softplus (MORE). Each: the pass's
counters, no [N, V] buffer in Inductor's code, outputs and gradients equal to the same code run
unfused; normalize.py's respellings counted where a rewrite kept them. The harness is
naive_fusion_harness.py's.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from naive_fusion_harness import B, H, T, V, check, fired, fusion_on, make, nv_buffers, pass_on_graph  # noqa: F401


def openrlhf_log_probs(h, w, b, ids):
    """OpenRLHF's log_probs_from_logits, fp32 branch without flash-attn: the target logit minus a
    logsumexp taken in row chunks (its _logsumexp_by_chunk)."""
    logits = F.linear(h, w, b)
    labels = torch.gather(logits, dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    flat = logits.reshape(-1, V)
    lse = torch.cat([torch.logsumexp(c, dim=-1) for c in torch.split(flat, 8, dim=0)])
    return (labels - lse.view(B, T),)


def logsumexp_head(h, w, b, ids):
    logits = h @ w.T
    return (logits.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(logits, -1),)


def log_softmax_dtype_kwarg(h, w, b, ids):
    """F.log_softmax(..., dtype=torch.float32), NeMo-RL's and many scripts' upcast."""
    return (F.log_softmax(F.linear(h, w), dim=-1, dtype=torch.float32)
            .gather(-1, ids[..., None]).squeeze(-1),)


def entropy_p_logp(h, w, b, ids):
    """Entropy as -(softmax * log_softmax).sum(-1), next to the log-probs of the same logits."""
    logits = h @ w.T
    p, logp = logits.softmax(-1), logits.log_softmax(-1)
    return logp.gather(-1, ids[..., None])[..., 0], -(p * logp).sum(-1)


def flat_cross_entropy(h, w, b, ids):
    """-cross_entropy over the flattened [B T, V] logits, viewed back to [B, T]."""
    logits = F.linear(h, w, b)
    return (-F.cross_entropy(logits.view(-1, V), ids.view(-1), reduction="none").view(B, T),)


MORE = [(openrlhf_log_probs, (1, 0)), (logsumexp_head, (1, 0)), (log_softmax_dtype_kwarg, (1, 0)),
        (entropy_p_logp, (1, 1)), (flat_cross_entropy, (1, 0))]


def verl_inplace_temperature(h, w, b, ids):
    """verl's dp_actor: logits.squeeze(0), then logits.div_(temperature) in place."""
    logits = F.linear(h.reshape(1, B * T, H), w).squeeze(0)                   # [nnz, V]
    logits.div_(0.8)
    return (logits.log_softmax(-1).gather(-1, ids.reshape(-1, 1)).squeeze(-1),)


def inplace_true_divide(h, w, b, ids):
    """`logits /= temperature` (older TRL), then `*=` by a 0-dim tensor, the entropy beside."""
    logits = h @ w.T
    logits /= 0.7
    logits *= torch.tensor(1.25)
    return (logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0],
            -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))


def tensor_temperature_product(h, w, b, ids):
    """A multiplication by an inverse temperature held as a 0-dim tensor."""
    return ((h @ w.T * torch.tensor(1 / 0.7)).log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


def per_sequence_temperature(h, w, b, ids):
    """A [B, 1, 1] temperature tensor, one a sequence, broadcast over its tokens."""
    t = torch.linspace(0.6, 1.2, B).view(B, 1, 1)
    return ((F.linear(h, w) / t).log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


MORE += [(verl_inplace_temperature, (1, 0)), (inplace_true_divide, (1, 1)),
         (tensor_temperature_product, (1, 0)), (per_sequence_temperature, (1, 0))]


def nemo_rl_logprobs(h, w, b, ids):
    """NeMo-RL's get_logprobs: log_softmax of the fp32 logits, then the log-probs sliced
    [:, :-1] (not the logits), gathered at the next tokens, a zero column put first."""
    log_probs = torch.nn.functional.log_softmax(F.linear(h, w).to(torch.float32), dim=-1)
    next_tokens = ids[:, 1:]
    log_probs = log_probs[:, :-1]
    token_logprobs = log_probs.gather(dim=-1, index=next_tokens.unsqueeze(-1)).squeeze(-1)
    return (torch.cat([torch.zeros_like(token_logprobs[:, :1]), token_logprobs], dim=1),)


def log_softmax_by_logsumexp(h, w, b, ids):
    """log_softmax spelled out: z - z.logsumexp(-1, keepdim=True), then torch.gather(x, 2, i)."""
    z = (h @ w.T).float()
    logp = z - z.logsumexp(-1, keepdim=True)
    return (torch.gather(logp, 2, ids.unsqueeze(2)).squeeze(2),)


MORE += [(nemo_rl_logprobs, (1, 0)), (log_softmax_by_logsumexp, (1, 0))]


def roll_labels(h, w, b, ids):
    """ROLL's compute_log_probs: labels cloned and masked in place (labels[labels == -100] = 0)
    between the GEMM and the gather, a write to the graph's own tensor; an unrelated in-place
    op beside it."""
    logits = F.linear(h, w)
    labels = ids[:, 1:].clone()
    labels[labels == 5] = 0
    scratch = h.detach().clone()
    scratch.mul_(2.0)
    return logits[:, :-1, :].log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), scratch


MORE += [(roll_labels, (1, 0))]


def hf_causal_lm_loss(h, w, b, ids):
    """HF's ForCausalLMLoss (an SFT term beside the RL loss): labels shifted, -100 where ignored,
    the mean cross-entropy over the kept tokens of the flattened logits."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    labels[0, :3] = -100
    logits = F.linear(h, w, b).float()
    return (F.cross_entropy(logits.view(-1, V), labels.reshape(-1), ignore_index=-100).reshape(1),)


def summed_cross_entropy(h, w, b, ids):
    return (F.cross_entropy((h @ w.T).view(-1, V), ids.view(-1), reduction="sum").reshape(1),)


def class_dim_second_cross_entropy(h, w, b, ids):
    """cross_entropy over [B, V, T] (the logits transposed), per token and the mean."""
    z = F.linear(h, w, b)
    return (-F.cross_entropy(z.transpose(1, 2), ids, reduction="none", ignore_index=5),
            F.cross_entropy(z.permute(0, 2, 1), ids, ignore_index=5).reshape(1))


MORE += [(hf_causal_lm_loss, (1, 0)), (summed_cross_entropy, (1, 0)), (class_dim_second_cross_entropy, (1, 0))]


def chunked_entropy_written(h, w, b, ids):
    """verl's entropy_from_logits_with_chunking as verl 0.9.1 spells it (a zeros buffer, each
    chunk's fp32 entropy written into it; tests/test_verl.py runs verl's own), beside the
    log-probs of the same [nnz, V] logits."""
    logits = F.linear(h, w).reshape(B * T, V)
    entropy = torch.zeros(logits.shape[0], device=logits.device)
    for i in range(0, logits.shape[0], 8):
        chunk = logits[i:i + 8].float()
        pd = torch.nn.functional.softmax(chunk, dim=-1)
        entropy[i:i + 8] = torch.logsumexp(chunk, dim=-1) - torch.sum(pd * chunk, dim=-1)
    return logits.log_softmax(-1).gather(-1, ids.reshape(-1, 1)).squeeze(-1), entropy


MORE += [(chunked_entropy_written, (1, 1))]


def nll_of_log_softmax(h, w, b, ids):
    """F.nll_loss of the log-probs, per token (older PPO code) and the mean with ignore_index."""
    logp = F.log_softmax(F.linear(h, w, b), dim=-1).view(-1, V)
    return (-F.nll_loss(logp, ids.view(-1), reduction="none", ignore_index=5).view(B, T),
            F.nll_loss(logp, ids.view(-1), ignore_index=5).reshape(1))


def arange_indexed_logprobs(h, w, b, ids):
    """logp[arange(B)[:, None], arange(T)[None, :], ids] (advanced indexing, not gather)."""
    logp = torch.log_softmax(h @ w.T, dim=-1)
    return (logp[torch.arange(B)[:, None], torch.arange(T)[None, :], ids],)


def arange_indexed_flat_logprobs(h, w, b, ids):
    """logp.view(-1, V)[arange(N), ids.view(-1)]: the view taken of the logits, then a gather."""
    logp = F.log_softmax(F.linear(h, w, b), dim=-1).view(-1, V)
    return (logp[torch.arange(logp.shape[0]), ids.view(-1)].view(B, T),)


MORE += [(nll_of_log_softmax, (1, 0)), (arange_indexed_logprobs, (1, 0)), (arange_indexed_flat_logprobs, (1, 0))]


def ppo_entropy_axis_kwarg(h, w, b, ids):
    """TRL's PPO-era entropy_from_logits: numpy's axis= keyword on logsumexp and sum."""
    logits = h @ w.T
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return (torch.logsumexp(logits, axis=-1) - torch.sum(pd * logits, axis=-1),)


def gather_keywords(h, w, b, ids):
    """DeepSpeed-Chat's gather_log_probs / trlx's logprobs_of_labels: gather(dim=, index=)."""
    log_probs = F.log_softmax(F.linear(h, w, b), dim=-1)
    return (torch.gather(log_probs, dim=-1, index=ids.unsqueeze(-1)).squeeze(-1),)


_CE = torch.nn.CrossEntropyLoss(reduction="none")
_LOG_SOFTMAX_MODULE = torch.nn.LogSoftmax(dim=-1)


def cross_entropy_module(h, w, b, ids):
    """nn.CrossEntropyLoss(reduction="none"), a module instead of the function."""
    return (-_CE((h @ w.T).view(-1, V), ids.view(-1)).view(B, T),)


def log_softmax_module(h, w, b, ids):
    return (_LOG_SOFTMAX_MODULE(F.linear(h, w, b)).gather(-1, ids[..., None])[..., 0],)


MORE += [(ppo_entropy_axis_kwarg, (1, 1)), (gather_keywords, (1, 0)), (cross_entropy_module, (1, 0)),
         (log_softmax_module, (1, 0))]


CLASS_WEIGHTS = torch.rand(V, generator=torch.Generator().manual_seed(5)) + 0.5   # [V], in 0.5 .. 1.5


def weighted_cross_entropy(h, w, b, ids):
    """cross_entropy with class weights: per token (ignore_index too) and the weighted mean
    (torch's: the sum of weight[t] * nll over kept targets / the sum of their weights)."""
    z, cw = (h @ w.T).view(-1, V), CLASS_WEIGHTS.to(h.device)
    return (F.cross_entropy(z, ids.view(-1), weight=cw, reduction="none", ignore_index=7).view(B, T),
            F.cross_entropy(z, ids.view(-1), weight=cw, ignore_index=7).reshape(1))


def weighted_summed_nll(h, w, b, ids):
    """nll_loss of the flattened log_softmax with class weights, summed (read as cross_entropy)."""
    logp = F.log_softmax(F.linear(h, w, b), dim=-1).view(-1, V)
    return (F.nll_loss(logp, ids.view(-1), weight=CLASS_WEIGHTS.to(h.device), reduction="sum").reshape(1),)


MORE += [(weighted_cross_entropy, (1, 0)), (weighted_summed_nll, (1, 0))]


def label_smoothed_cross_entropy(h, w, b, ids):
    """cross_entropy with label_smoothing, a bias and ignore_index: per token and the mean."""
    z = F.linear(h, w, b).view(-1, V)
    return (F.cross_entropy(z, ids.view(-1), reduction="none", ignore_index=7, label_smoothing=0.1).view(B, T),
            F.cross_entropy(z, ids.view(-1), ignore_index=7, label_smoothing=0.1).reshape(1))


def label_smoothed_weighted_tempered(h, w, b, ids):
    """label_smoothing with class weights and a temperature, summed over [B, V, T]."""
    z = (h @ w.T) / 0.7
    return (F.cross_entropy(z.transpose(1, 2), ids, weight=CLASS_WEIGHTS.to(h.device), label_smoothing=0.2,
                            reduction="sum").reshape(1),)


MORE += [(label_smoothed_cross_entropy, (1, 0)), (label_smoothed_weighted_tempered, (1, 0))]


def categorical(h, w, b, ids):
    """torch.distributions.Categorical(logits=...).log_prob and .entropy (a keepdim logsumexp,
    a gather through broadcast_tensors, a clamped p * log p; Dynamo records no validation)."""
    d = torch.distributions.Categorical(logits=F.linear(h, w, b))
    return d.log_prob(ids), d.entropy()


def categorical_tempered_log_prob(h, w, b, ids):
    d = torch.distributions.Categorical(logits=(h @ w.T) / 0.8, validate_args=False)
    return (d.log_prob(ids),)


MORE += [(categorical, (1, 1)), (categorical_tempered_log_prob, (1, 0))]


def contiguous_shifted_logits(h, w, b, ids):
    """HF's causal shift: `logits[:, :-1, :].contiguous()` (then a `.clone()`) before the
    log-softmax and the entropy."""
    logits = F.linear(h, w, b)[:, :-1, :].contiguous().clone()
    return (logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1),
            -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))


def entropy_under_no_grad(h, w, b, ids):
    """The log-probs with a gradient, the entropy (a metric) under torch.no_grad() beside them:
    the fused entropy comes back detached, as the user's was."""
    logits = h @ w.T
    lp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    with torch.no_grad():
        ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert not ent.requires_grad
    return lp, ent


def fixed_row_slices(h, w, b, ids):
    """A loop over fixed-size row slices of the flat logits, `logits[i:i + k]` (the last one
    clamped), cat'ed and viewed back: folded (loops._slices_cover) into one computation."""
    z = F.linear(h, w, b).reshape(-1, w.shape[0])
    idx = ids.reshape(-1)
    parts = [z[i:i + 8].log_softmax(-1).gather(-1, idx[i:i + 8].unsqueeze(-1)).squeeze(-1)
             for i in range(0, z.shape[0], 8)]
    return (torch.cat(parts).view(ids.shape),)


def sequence_slices_beside_entropy(h, w, b, ids):
    """Log-probs of slices along the sequence dim `logits[:, j:j + k]` written into a zeros
    buffer, beside the entropy of the whole logits: the writes fold (loop_items._slice_key: one
    sliced dim, the ids' `[:, j:j + k, None]` too), then both are one op."""
    logits = F.linear(h, w, b)
    lp = torch.zeros(B, T, device=h.device)
    for j in range(0, T, 3):
        lp[:, j:j + 3] = logits[:, j:j + 3].log_softmax(-1).gather(-1, ids[:, j:j + 3, None]).squeeze(-1)
    return lp, -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def complement_softplus(h, w, b, ids):
    """The log-prob through the complement: -softplus(logsumexp of every other logit - the
    target's), the target masked by an arange comparison (complement.py)."""
    z = F.linear(h, w, b).float()
    zt = z.gather(-1, ids[..., None]).squeeze(-1)
    is_target = torch.arange(V, device=z.device) == ids[..., None]
    others = torch.logsumexp(torch.where(is_target, torch.finfo(z.dtype).min, z), -1)
    return (-F.softplus(others - zt),)


def complement_softplus_vocab_chunks(h, w, b, ids):
    """The same over vocab chunks z[..., c:c + k] (the last clamped), their log-sum-exps stacked."""
    z = F.linear(h, w, b).float()
    zt = z.gather(-1, ids[..., None]).squeeze(-1)
    parts = [torch.logsumexp(torch.where(ids[..., None] == torch.arange(c, min(c + 16, V), device=z.device),
                                         float("-inf"), z[..., c:c + 16]), -1) for c in range(0, V, 16)]
    return (-F.softplus(torch.logsumexp(torch.stack(parts, -1), -1) - zt),)


def test_complement_eq_as_method():
    """torch 2.11's Dynamo records `torch.arange(V) == ids[..., None]` as call_method __eq__
    (2.13 and later: operator.eq): the complement is read the same (its first GPU run, on 2.11,
    left it unfused)."""
    def as_method(graph):
        for n in graph.nodes:
            if n.op == "call_function" and n.target is operator.eq:
                n.op, n.target = "call_method", "__eq__"

    before, _ = pass_on_graph(complement_softplus, edit=as_method)
    assert ("call_method", "__eq__") in before
    assert fired() == (1, 0)


MORE += [(contiguous_shifted_logits, (1, 1)), (entropy_under_no_grad, (1, 1)), (fixed_row_slices, (1, 0)),
         (sequence_slices_beside_entropy, (1, 1)), (complement_softplus, (1, 0)),
         (complement_softplus_vocab_chunks, (1, 0))]


@pytest.mark.parametrize("fn,expect", MORE, ids=[f.__name__ for f, _ in MORE])
def test_more_trainer_spellings_fused(fn, expect):
    """Spellings beyond the issue's list (OpenRLHF, NeMo-RL's get_logprobs, p * log p entropy,
    in-place temperatures, tensor temperatures multiplied or per sequence, log_softmax by
    logsumexp, ROLL's labels masked in place, mean / sum / class-dim-second cross_entropy,
    verl's chunked entropy written into a buffer, nll_loss of log_softmax, arange indexing,
    cross_entropy with class weights or label smoothing, torch.distributions.Categorical,
    numpy's axis=, gather's keywords, nn.CrossEntropyLoss / nn.LogSoftmax modules)."""
    tol = 1e-4 if expect[1] else 1e-5
    assert not nv_buffers(check(fn, expect, rtol=tol, atol=tol))
    assert counters["compiled_grpo"]["naive_inplace_scale"] == (
        fn.__name__.count("inplace") + (fn is inplace_true_divide))
    respelled = {nemo_rl_logprobs: 1, nll_of_log_softmax: 2, arange_indexed_logprobs: 1,   # edits kept
                 arange_indexed_flat_logprobs: 2, categorical: 2, categorical_tempered_log_prob: 1,
                 weighted_summed_nll: 2, complement_softplus: 1, complement_softplus_vocab_chunks: 1}
    assert counters["compiled_grpo"]["naive_respelled"] == respelled.get(fn, 0), dict(counters["compiled_grpo"])


def test_mean_cross_entropy_of_no_kept_target_is_nan_as_torchs():
    """Every target ignored: torch's mean cross_entropy is 0 / 0 = nan; so is the fused one."""
    def all_ignored(h, w, b, ids):
        return (F.cross_entropy((h @ w.T).view(-1, V), torch.full_like(ids, -100).view(-1)).reshape(1),)
    h, w, b, ids = make()
    out = torch.compile(all_ignored, fullgraph=True)(h, w, b, ids)[0]
    assert fired() == (1, 0) and torch.isnan(out).all() and torch.isnan(all_ignored(h, w, b, ids)[0]).all()


def test_categorical_with_a_masked_vocab_entry():
    """A -inf bias entry (a token masked out of the vocabulary): Categorical's clamp keeps its
    entropy finite (0 * finfo.min, not 0 * -inf); the fused entropy, which drops the respelled
    clamp, is finite and equal too, and so are the gradients of lp.sum() + entropy.sum(). Under
    an entropy weight above 1, torch's own Categorical gradient overflows (c * finfo.min = -inf,
    times p = 0: nan everywhere); the fused one stays finite."""
    from naive_fusion_harness import loss_of
    h, w, b, ids = make()
    b = b.detach().clone()
    b[3] = float("-inf")
    b.requires_grad_()
    ids = ids.masked_fill(ids == 3, 4)          # no target on the masked token
    compiled = torch.compile(categorical, fullgraph=True)
    for f in (compiled, categorical):
        out = f(h, w, b, ids)
        grads = torch.autograd.grad(out[0].sum() + out[1].sum(), (h, w, b))
        if f is compiled:
            got = [*out, *grads]
            weighted = torch.autograd.grad(loss_of(f(h, w, b, ids)), (h, w, b))
            assert all(torch.isfinite(g).all() for g in weighted)
    assert fired() == (1, 1)
    for r, o in zip([*out, *grads], got):
        assert torch.isfinite(o).all() and torch.isfinite(r).all()
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


def test_label_smoothed_loss_compiled_whole():
    """An SFT-style scalar loss, cross_entropy with label smoothing and ignore_index, computed
    inside the compiled function (the pass sees the loss; the smoothing term reads lse, so the
    op's recompute backward serves it): loss and gradients of h, W and b equal eager's."""
    def sft(h, w, b, ids):
        return F.cross_entropy(F.linear(h, w, b).view(-1, V), ids.view(-1), label_smoothing=0.1, ignore_index=3)
    h, w, b, ids = make()
    got = torch.compile(sft, fullgraph=True)(h, w, b, ids)
    got_grads = torch.autograd.grad(got, (h, w, b))
    want = sft(h, w, b, ids)
    want_grads = torch.autograd.grad(want, (h, w, b))
    assert fired() == (1, 0)
    for o, r in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
