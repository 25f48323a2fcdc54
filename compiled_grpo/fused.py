"""grpo_loss's fused-gradient mode: the loss's gradient formed while each row block's logits
exist, so the logits are computed once (6NHV FLOPs) instead of again in the backward (8NHV).

Shape legend: B sequences, T positions, N tokens (B*T padded, or packed), H hidden, V vocab,
G row blocks of R rows.

The gradient of the loss w.r.t. a token's log-prob p_t and entropy H_t is

    dL/dp_t = sum_u w_u * d l_u / d p_t,     dL/dH_t = e_t

where l = per_token_loss(p) (objective.py: the one composition of loss.py's functions), w =
d aggregate(l) / d l (the loss type's normalizer: it depends on the mask and
num_items_in_batch, never on p, so it is formed once from aggregate itself) and e = d(-coef *
masked_mean(H)) / d H. Token-level importance sampling makes d l_u / d p_t zero for u != t, so
any block of rows can be differentiated alone (fused_grads.py): per block, ``torch.func.grad`` of
sum(w * per_token_loss(p_block)) + sum(e * H_block) at the block's log-probs. No second,
hand-written derivative exists: these are autograd's gradients of the loss functions.

Sequence-level importance sampling (GSPO) couples a sequence's tokens through its mean
log-ratio, so a block must hold whole sequences: padded rows of [B, T] (B sequences of T) and
packed sequences alike are packed first-fit decreasing by their valid tokens into blocks of R
slots (lowerings' fused/order.py pack_sequences: on the device, no host sync; order_rows_grouped
puts each block's valid tokens in its slots, masked tokens get none), and the block's gradient
sums per sequence with ``Segments``. Every sequence must fit a block, which packed inputs
guarantee on the host with ``max_seqlen`` (grpo_loss's argument, flash-attn's name; padded ones
with T). Without it, or with T (max_seqlen) > R, "auto" uses the recompute path (a statistics
pre-pass over all tokens would cost the same 2NHV the recompute does) and "fused" raises. The
cost of whole sequences: blocks hold only the sequences that fit, so they are less full than
token blocks, and every extra block adds a read-modify-write of dW (up to ~1.35 ms at
qwen3-8b on H100, docs/performance.md) and a partial wave to its GEMMs. The host launches the first-fit bound
min(cdiv(S, R // T), 2 cdiv(N, R) - 1) of blocks; the ones past the last sequence are empty.
The same holds for everything else that reads a whole sequence's current log-probs
(``sequence_coupled``: VESPO's gamma weight, the off-policy sequence mask, a sequence_* vLLM IS
weight with old_logprobs=None). What depends on inputs only (the vLLM IS weight from old and
sampler log-probs, the normalizers) is formed once before the blocks.
``top_entropy_quantile < 1`` thresholds on a quantile of every token's current entropy, known
only after the last block: never fused ("auto" recomputes, "fused" raises).

The loss VALUE is computed by the same code as the recompute path, from the block log-probs
(detached); ``attach`` gives it the stored gradients: backward multiplies d_hidden, d_weight,
d_bias by the incoming scalar gradient. So in this mode per_token_loss, logprobs and entropy
come back detached (only ``loss`` carries a gradient).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from compiled_grpo import distributed as _tp
from compiled_grpo import fused_grads as _grads
from compiled_grpo.logprobs import _prepare, check_model_scaling
from lowerings.linear_logprobs.device import static_value
from lowerings.linear_logprobs.op import upcast_lm_head
from compiled_grpo.loss import aggregate, masked_mean
from compiled_grpo.segments import segments_from_cu_seqlens
from lowerings.linear_logprobs import LinearLogprobs
from lowerings.linear_logprobs.fused import schedule as _op
from lowerings.linear_logprobs.fused import steps as _steps
from lowerings.linear_logprobs.device import cdiv, is_static, size_hint

from lowerings.linear_logprobs.fused.plan import (CPU_BLOCK_ROWS, budget_rows, compiled_blocks,
                                                  token_blocks)


def _plan_vocab(weight: Tensor, shard) -> int:
    """The vocab rows a block's workspace is planned for: the weight's, or under TP the largest
    shard's (ceil(V / ranks)), so every rank plans the same blocks."""
    if shard is None:
        return weight.shape[0]
    return cdiv(shard.vocab_size, shard.world)


def _budget_rows(hidden: Tensor, weight: Tensor, cfg, shard=None) -> int:
    """R of the workspace budget: fused_workspace_mib / (V * element size), whole tiles (plan.py)."""
    return budget_rows(hidden, weight, static_value(cfg.fused_workspace_mib), _plan_vocab(weight, shard))


def _auto_device_ok(hidden: Tensor) -> bool:
    return hidden.device.type == "cuda"


def _guard_location_bug() -> bool:
    """True on torch versions (2.11) whose Dynamo cannot print a shape guard that has no source
    location (torch._guards.SLoc.__str__ of framework_loc=None raises AttributeError; fixed by
    2.13). Compiling the whole-sequence fused blocks on CUDA with dynamic shapes creates such a
    guard (InternalTorchDynamoError "'NoneType' object has no attribute 'filename'", H200,
    torch 2.11, tests/test_dynamic.py), so "auto" recomputes those losses inside torch.compile
    there. Checked once, at import (outside any trace)."""
    try:
        str(torch._guards.SLoc(None, None))
        return False
    except AttributeError:
        return True


_GUARD_LOCATION_BUG = _guard_location_bug()


def sequence_coupled(cfg, old_logprobs=None, sampling_logprobs=None) -> Optional[str]:
    """What, if anything, makes a token's loss depend on its whole sequence's CURRENT log-probs
    (so a row block must hold whole sequences, as for GSPO), else None."""
    if cfg.importance_sampling_level == "sequence":
        return "sequence-level importance sampling"
    if cfg.loss_type == "vespo":
        return "loss_type='vespo' (a sequence's gamma weight sums its log-ratios)"
    if cfg.off_policy_mask_threshold is not None:
        return "off_policy_mask_threshold (a sequence's mean drift from the sampler)"
    if (sampling_logprobs is not None and old_logprobs is None and cfg.vllm_importance_sampling_correction
            and cfg.vllm_importance_sampling_mode.startswith("sequence")):
        return ("a sequence_* vllm_importance_sampling_mode with old_logprobs=None (the weight sums the "
                "current log-probs)")
    return None


def why_not_fused(hidden: Tensor, weight: Tensor, cfg, segments, shard, old_logprobs=None,
                  sampling_logprobs=None, max_seqlen: Optional[int] = None) -> Optional[str]:
    """None when the fused path computes this loss exactly, else the reason it cannot. ``shard``:
    the VocabShard of a tensor-parallel head (weight is then its local rows), else None.
    ``max_seqlen``: grpo_loss's bound on packed sequences' lengths (None: unknown)."""
    if shard is not None and shard.vocab_size is None:
        return ("vocab_start (uneven vocab shards) leaves the global V unknown on each rank, so the "
                "ranks could plan different row blocks; pass an even split or a DTensor weight")
    if hidden.device.type == "cuda" and torch.float64 in (hidden.dtype, weight.dtype):
        return "float64 on CUDA has no fused kernels"
    if cfg.top_entropy_quantile < 1.0:
        # the threshold is a quantile of every token's current entropy: no block's gradient is
        # known before the last block's logits exist (a pre-pass would cost the recompute's 2NHV)
        return "top_entropy_quantile < 1 thresholds on the whole batch's current entropies"
    coupled = sequence_coupled(cfg, old_logprobs, sampling_logprobs)
    if coupled is not None:
        if segments is not None and max_seqlen is None:
            return (f"{coupled} on packed inputs needs whole sequences in a row block: pass max_seqlen "
                    f"(a bound on the lengths of cu_seqlens' sequences)")
        longest = size_hint(hidden.shape[1]) if segments is None else max_seqlen
        if longest > _budget_rows(hidden, weight, cfg, shard):
            what = "T" if segments is None else "max_seqlen"
            return f"{coupled} needs a whole sequence ({what} rows) in the workspace: raise fused_workspace_mib"
    return None


def use_fused(hidden: Tensor, weight: Tensor, bias, cfg, segments, shard, old_logprobs=None,
              sampling_logprobs=None, max_seqlen: Optional[int] = None) -> bool:
    """gradient_mode 'recompute' never, 'auto' on CUDA when exact and a gradient is wanted
    (tensor-parallel heads included: NCCL-measured, bench/tp.py), 'fused' whenever a gradient
    is wanted (any device: the CPU body serves the tests), raising when it cannot be exact."""
    if cfg.gradient_mode == "recompute":
        return False
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not wants_grad:   # nothing to fuse: the forward alone
        return False
    if size_hint(hidden.shape[:-1].numel()) == 0:
        # no token (an empty packed batch): nothing to fuse, and the blocks' slots would index
        # rows that do not exist (Dynamo specializes a size of 0, so this is no guard on N)
        return False
    if cfg.gradient_mode == "auto" and not _auto_device_ok(hidden):
        # CPU: the recompute body streams 16 MiB tiles; the fused body's block holds several
        # [R, V] float32 temporaries (logits, p, dlogits) for no FLOP saving that matters there
        return False
    if (cfg.gradient_mode == "auto" and _GUARD_LOCATION_BUG and torch.compiler.is_compiling()
            and sequence_coupled(cfg, old_logprobs, sampling_logprobs) is not None):
        return False   # see _guard_location_bug
    why = why_not_fused(hidden, weight, cfg, segments, shard, old_logprobs, sampling_logprobs, max_seqlen)
    if why is not None and cfg.gradient_mode == "fused":
        raise ValueError(f"GRPOConfig.gradient_mode='fused' cannot be exact here: {why}; use 'auto' or "
                         f"'recompute'")
    return why is None


class Fused(NamedTuple):
    tok: LinearLogprobs                   # detached log-probs / entropy, token_ids' layout
    attach: Callable[[Tensor], Tensor]    # loss value -> the same value carrying the gradients


def _linear_weights(fn, like: Tensor) -> Tensor:
    """d fn(x) / dx of a function linear in x (the normalizers), at zeros shaped like `like`."""
    return torch.func.grad(fn)(torch.zeros_like(like))


def fused_logprobs(hidden, weight, token_ids, bias, valid, advantages, old_logprobs, ref_logprobs,
                   sampling_ratio, num_items_in_batch, segments, cfg, want_entropy,
                   dtype, sampling_logprobs=None, shard=None,
                   max_seqlen: Optional[int] = None) -> Fused:
    """Run the fused schedule for grpo_loss (api.py). Inputs as grpo_loss after flattening
    packed ones; ``advantages`` broadcast (advantage_stats), ``dtype`` the log-prob dtype (the
    per-token loss: objective.py, differentiated per block in fused_grads.py);
    ``sampling_ratio`` includes the weight grpo_loss formed from the sampler's log-probs when
    old log-probs are given (inputs only, so before the blocks, like the normalizer weights);
    ``sampling_logprobs`` go to each block for what needs the current log-probs (the off-policy
    mask, the weight with old_logprobs=None).

    ``shard`` (tensor parallelism, distributed.py): weight / bias are this rank's vocab rows;
    each block's shard statistics are all-gathered and combined into the full vocab's
    (distributed.combine_shards) before its gradient is formed, every rank runs the same blocks,
    and the ranks' parts of dX are summed once at the end. Each rank gets its dW / db shard.

    ``max_seqlen``: packed inputs' bound on a sequence's length, which sequence-coupled losses
    need (whole sequences first-fit decreasing into R-row blocks; why_not_fused checked it fits)."""
    check_model_scaling(cfg.logit_scale, cfg.final_logit_softcapping, cfg.temperature)
    if shard is not None:
        weight, bias = shard.weight, shard.bias
    exact_tf32 = False
    if cfg.fp32_lm_head:   # as token_logprobs (lowerings op.upcast_lm_head): fp32 operands and grads
        hidden, weight, bias, exact_tf32 = upcast_lm_head(hidden, weight, bias)
    ids, _ = _prepare(hidden, weight, token_ids, bias, valid, cfg.temperature,   # checks + ids
                      vocab_size=None if shard is None else shard.vocab_size)
    lead = valid.shape                                                     # [B, T] or [N]
    seq = sequence_coupled(cfg, old_logprobs, sampling_logprobs) is not None   # blocks of whole rows
    # normalizer weights: aggregate and the entropy bonus are linear in their per-token input
    agg_w = _linear_weights(lambda l: aggregate(l, valid, cfg, num_items_in_batch,
                                                segments=segments).loss,
                            valid.to(dtype))                               # [B, T]
    ent_w = None
    if cfg.entropy_coef > 0:
        ent_w = _linear_weights(lambda e: -cfg.entropy_coef * masked_mean(e, valid), valid.to(dtype))
    if sampling_ratio is not None:
        sampling_ratio = sampling_ratio.expand(lead)
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    per_tok = dict(zip(_grads.PER_TOKEN, map(flat, (
        old_logprobs, valid, advantages, sampling_ratio, ref_logprobs, agg_w, ent_w,
        sampling_logprobs))))                                              # [N] each
    n = valid.numel()
    budget = _budget_rows(hidden, weight, cfg, shard)
    compiling = torch.compiler.is_compiling()
    if seq:   # whole sequences into blocks of R slots by their valid tokens (first-fit decreasing)
        if segments is None:   # padded [B, T]: row b is sequence b, T tokens long
            b_sz, max_seqlen = lead
            segments = segments_from_cu_seqlens(torch.arange(b_sz + 1, device=valid.device) * max_seqlen, n)
        s_num, block_rows = segments.num_sequences, budget
        if not _auto_device_ok(hidden) and max_seqlen <= CPU_BLOCK_ROWS:
            # the CPU body's blocks cost their R rows, valid or not (see the token-level
            # branch): bound R as there while a whole sequence still fits (a guard on T at most)
            block_rows = min(budget, CPU_BLOCK_ROWS)
        wave = _op.wave_rows(hidden, weight)   # whole dX waves, as token blocks, if T still fits
        if wave is not None and budget // wave * wave >= max_seqlen:
            block_rows = budget // wave * wave
        blocks = None
        if compiling and not (is_static(n) and is_static(s_num)):
            # symbolic sizes: a step at least the bound, cdiv(S, k) or 2 cdiv(N, R) - 1 blocks
            by_seq = compiled_blocks(s_num, max(1, block_rows // max_seqlen))
            by_rows = compiled_blocks(2 * cdiv(n, block_rows) - 1, 1)
            blocks = by_seq if by_rows is None else by_rows if by_seq is None else min(by_seq, by_rows)
        if blocks is None:
            blocks = _op.next_fit_blocks(size_hint(s_num), size_hint(n), block_rows, size_hint(max_seqlen))
    else:   # several blocks: whole dX waves where the budget holds one, else forward waves
        # static N (a compile of static shapes): eager's exact plan, so compiling runs the blocks
        # eager runs (qwen3-4b: 10, where the step plan's 12 cost ~0.1 ms a step)
        blocks, block_rows = token_blocks(hidden, weight, budget, n, compiling and not is_static(n))

    # the per-block gradient as one compiled graph in eager CUDA calls (fused_grads)
    compiled = (_grads.BLOCK_GRADS_COMPILED and _auto_device_ok(hidden)
                and not torch.compiler.is_compiling())

    # In a trace the per-token inputs are gathered into the blocks' order once (on_order) and each
    # block's gradient reads a slice of them: the indirect loads G blocks' index_selects put into
    # their gradient kernels cost Inductor ~0.4 s of code generation a block (H100 host; the
    # inlined gradient itself ~1.3 s more: bench/results/compile_blocks_h100.txt)
    ordered = {}

    def on_order(perm):   # perm [G R]: the blocks' rows
        ordered.update((k, None if t is None else t.index_select(0, perm)) for k, t in per_tok.items())
        if seq:
            ordered["seg_ids"] = segments.ids.index_select(0, perm)

    def grad_fn(r0, idx, lp, ent):
        if compiling and not seq:   # token blocks: one traced graph for all (fused_grads)
            return _grads.traced_block_grads(lp.to(dtype), ent.to(dtype), r0, ordered, cfg)
        if compiling:   # the block's slices of the inputs gathered once (on_order)
            return _grads.block_grads(lp.to(dtype), ent.to(dtype), None, r0, ordered, cfg,
                                      (ordered["seg_ids"], segments.num_sequences, plan[1], block_rows))
        fn = _grads.eager_call_block_grads if compiled else _grads.block_grads
        if compiled:   # idx is perm's view at r0: storage offset 0 only for the block run last,
            idx = idx.clone()   # which would recompile the graph (0/1 specialization)
        return fn(lp.to(dtype), ent.to(dtype), idx, r0, per_tok, cfg,
                  (segments.ids, segments.num_sequences, plan[1], block_rows) if seq else None)

    need = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    h2 = hidden.reshape(-1, hidden.shape[-1])                              # [N, H]
    ids, flat_valid = ids.reshape(-1), valid.reshape(-1)                   # [N]
    tp = {}
    if shard is not None:
        local = ids - shard.start
        own = (local >= 0) & (local < weight.shape[0]) & flat_valid        # [N] this rank's targets
        # -1 matches no column: the one-hot term of the dlogits is the owner rank's alone
        ids = torch.where(own, local, -1)

        def combine(idx, lp, ent, lse):   # this block's shard statistics -> the full vocab's
            st = _tp.shard_stats(lp, lse, own.index_select(0, idx), ent if want_entropy else None)
            lp, ent_g, lse = _tp.combine_shards(_tp.gather_shards(st, shard), shard,
                                                flat_valid.index_select(0, idx))
            return lp, ent if ent_g is None else ent_g, lse

        tp = dict(combine=combine, reduce_dx=lambda dx: _tp.all_reduce_sum(dx, shard.group))
    plan = None
    if seq:   # whole sequences into blocks (first-fit decreasing), each block's rows in row order
        flat_n = flat_valid.to(torch.int64)
        done = torch.cat([flat_n.new_zeros(1), flat_n.cumsum(0)])             # [N + 1]
        cu_valid = done.index_select(0, segments.offsets().to(torch.int64))   # [S + 1]
        seq_block = _op.pack_sequences(cu_valid, block_rows, blocks)           # [S]
        plan = _op.order_rows_grouped(flat_valid, seq_block.index_select(0, segments.ids), blocks,
                                      block_rows)
    res = _op.fused_linear_logprobs(
        h2, weight, ids, bias, flat_valid, grad_fn, blocks=blocks,
        block_rows=block_rows, temperature=cfg.temperature, with_entropy=want_entropy,
        logit_scale=cfg.logit_scale, softcap=cfg.final_logit_softcapping, need_x=need[0],
        need_w=need[1], need_b=need[2], entropy_grad=ent_w is not None,
        allow_scaled=cfg.fused_scaled_backward, plan=plan, round_logits=cfg.round_logits,
        compute_dtype=None if cfg.fp32_lm_head else cfg.lm_head_dtype, exact_tf32=exact_tf32,
        on_order=on_order if compiling else None, **tp)
    lp, ent, lse = (t.view(lead) for t in (res.logprobs, res.entropy, res.lse))
    tok = LinearLogprobs(lp, ent if want_entropy else None, lse)
    dx = None if res.d_hidden is None else res.d_hidden.view(hidden.shape)

    def attach(loss: Tensor) -> Tensor:
        return _steps.AttachGrads.apply(loss, hidden, weight, bias, dx, res.d_weight, res.d_bias)

    return Fused(tok, attach)

