"""Vocab-parallel tensor parallelism for token_logprobs / grpo_loss (``tp_group=``): Megatron's
vocab-parallel cross entropy, extended to entropy, over torch.distributed functional collectives
that trace under ``torch.compile(fullgraph=True)``.

Legend: N tokens, H hidden, V vocab, R ranks of the TP group, rank r holds the contiguous vocab
shard [s_r, s_r + V_r) of weight [V, H] (and bias [V]); ranks in order, an even split s_r = r * V_r
unless ``vocab_start`` or a DTensor's placement says otherwise. hidden [N, H] and the global token
ids [N] are the same on every rank. z = (hidden @ weight.T + bias) / temperature [N, V] is never
stored and never gathered. Rank r runs the single-device op on its shard, ids mapped into it::

    o_r              = (s_r <= id) & (id < s_r + V_r)                          # [N] owns the target
    lp_r, H_r, lse_r = linear_logprobs(h, W_r, where(o_r, id - s_r, 0), b_r)   # [N] each
    # lse_r = z_r.logsumexp(-1), H_r = entropy of z_r.softmax(-1), z_r = z[:, s_r : s_r + V_r]

One all-gather of the stacked local statistics [k, N] (k = 3, 4 with entropy: 12-16 bytes a token
in fp32), then every rank evaluates, in the same order and so bit-identically::

    lse      = lse_r.logsumexp(0)                               # = z.logsumexp(-1)
    logprobs = (o_r * lp_r + o_r * (lse_r - lse)).sum(0)        # = z[id] - lse (the owner's lp_r, re-based)
    w_r      = exp(lse_r - lse)                                 # softmax mass of shard r, sum_r w_r = 1
    entropy  = (w_r * (H_r + lse - lse_r)).sum(0)               # = lse - E_p[z]

Entropy: E_p[z] = sum_r w_r E_{p_r}[z] and E_{p_r}[z] = lse_r - H_r, so lse - E_p[z] =
sum_r w_r (H_r + lse - lse_r); every term is >= 0, so large logits do not cancel. A shard whose
logits are all -inf (banned by bias) has w_r = 0 and is selected away before any 0 * inf.

Gradients. Every rank's loss is the same function of the gathered statistics. An autograd
all-gather (backward: reduce-scatter of the sum) would add R identical copies: R times the true
gradient. So the gather runs on detached values and only the rank's own slot is wired into the
graph (``cat([g[:r], own, g[r+1:]])``; the values are bitwise the gathered ones): rank r's
statistics receive d loss / d stats_r once. The op's own backward then gives dW_r and db_r (exactly
the rows of the single-device dW, db) and shard r's part of dX. hidden enters through Megatron's
copy-to-tensor-parallel-region (identity forward, all-reduce(sum) backward; a funcol all_reduce in a
torch.autograd.Function, which dynamo traces): the full dX = sum_r dX_r on every rank.

Communication per call: forward one all-gather of k*N*R floats; backward one all-reduce of N*H in
hidden's dtype (Megatron's vocab-parallel lm_head pays the same all-reduce). Compute per rank:
the op on V/R columns. Masked rows (``row_mask``) go to the op as on one device (no FLOPs on CUDA,
no gradient) and their outputs are zeroed here; packed inputs (cu_seqlens) are flattened above.

grpo_loss's fused-gradient mode (compiled_grpo/fused.py) runs the same combination once per row
block (``gather_shards`` + ``combine_shards``, outside autograd) between the block's logits GEMM
and its gradient: with lse and entropy global, shard r's dlogits are columns [s_r, s_r + V_r) of
the full dlogits, the one-hot term only on the owner (non-owned ids map to -1, no column), so
dW_r / db_r come out directly and the ranks' dX parts are summed once (``all_reduce_sum``).

DTensor weights: a DTensor sharded ``Shard(0)`` over a 1-D mesh takes the same path with
``weight.to_local()`` (its gradient comes back as a Shard(0) DTensor), the group from the mesh and
the shard offsets of torch.chunk (DTensor's uneven split: ceil(V / R) rows a rank).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from compiled_grpo._checks import _host_checks
from lowerings.linear_logprobs import LinearLogprobs, linear_logprobs

if dist.is_available():
    import torch.distributed._functional_collectives as funcol
    # torch 2.13 renamed all_gather_tensor (now a FutureWarning alias); 2.11 has only the old name.
    _all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - builds without DTensor
        DTensor, Shard = (), None
else:  # pragma: no cover - builds without torch.distributed
    funcol, _all_gather, DTensor, Shard = None, None, (), None


class VocabShard(NamedTuple):
    """This rank's vocab shard [start, start + weight.shape[0]) of a TP group of ``world`` ranks."""

    weight: Tensor                 # [V_r, H] local rows
    bias: Optional[Tensor]         # [V_r] local entries
    group: object                  # ProcessGroup (None: one rank, no collectives)
    rank: int
    world: int
    start: int                     # s_r, the first global id of the shard
    vocab_size: Optional[int]      # global V when known here (even split, DTensor); None for vocab_start


def is_dtensor(x) -> bool:
    return isinstance(x, DTensor) if DTensor else False


def _local(name: str, x):
    """A DTensor's local shard (differentiable: its grad comes back as a DTensor)."""
    if not is_dtensor(x):
        return x
    mesh, placements = x.device_mesh, tuple(x.placements)
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(f"{name} as a DTensor must be sharded Shard(0) (vocab rows) over a 1-D TP mesh, got "
                         f"placements {placements} on a {mesh.ndim}-D mesh (pass weight.to_local() with tp_group= "
                         "and vocab_start= for other layouts)")
    return x.to_local()


def _group_size_rank(tp_group) -> tuple[int, int]:
    """(world, rank) of tp_group, or a ValueError naming it (torch's own errors do not)."""
    if not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(f"tp_group must be a torch.distributed ProcessGroup (dist.new_group(...), "
                         f"mesh.get_group()), got {type(tp_group).__name__}")
    if not dist.is_initialized():
        raise ValueError("tp_group needs torch.distributed initialized (dist.init_process_group) in this "
                         "process; without tensor parallelism pass tp_group=None")
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def vocab_shard(weight, bias, tp_group, vocab_start) -> VocabShard:
    """Resolve this rank's shard from ``tp_group`` / ``vocab_start`` or a DTensor weight."""
    if is_dtensor(weight):
        if vocab_start is not None:
            raise ValueError("vocab_start must be None for a DTensor weight (its placement gives the shard)")
        mesh = weight.device_mesh
        group = mesh.get_group() if tp_group is None else tp_group
        world, rank = _group_size_rank(group)
        vocab = weight.shape[0]
        chunk = -(-vocab // world)  # torch.chunk's split, which DTensor's Shard(0) uses
        w = _local("weight", weight)
        b = _local("bias", bias)
        return VocabShard(w, b, group if world > 1 else None, rank, world, min(rank * chunk, vocab), vocab)
    if tp_group is None:
        raise ValueError("vocab_start needs tp_group= (the tensor-parallel process group whose ranks hold the "
                         "vocab shards) or a DTensor weight")
    if is_dtensor(bias):
        raise ValueError("bias is a DTensor but weight is not; pass both as DTensors or both as local shards")
    world, rank = _group_size_rank(tp_group)
    group = tp_group if world > 1 else None
    v_r = weight.shape[0]
    if vocab_start is None:
        return VocabShard(weight, bias, group, rank, world, rank * v_r, world * v_r)
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ValueError(f"vocab_start must be an int >= 0 (this rank's first vocab id), got {vocab_start!r}")
    return VocabShard(weight, bias, group, rank, world, vocab_start, None)


class _CopyToTPRegion(torch.autograd.Function):
    """Identity forward, all-reduce(sum) backward (Megatron's copy_to_tensor_model_parallel_region):
    every rank's loss depends on hidden through its own shard, so dX is the sum over ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):   # all_reduce_sum waits: eager autograd wants a plain tensor
        return all_reduce_sum(grad, ctx.group), None


def _gather_own_slot(st: Tensor, shard: VocabShard) -> Tensor:
    """[k, N] -> [R, k, N], every rank's statistics; only slot ``rank`` carries this rank's graph."""
    g = gather_shards(st.detach(), shard)  # [R, k, N], no autograd
    r = shard.rank
    return torch.cat([g[:r], st[None], g[r + 1:]])  # [R, k, N]


def _check_owned(owners: Tensor, valid: Optional[Tensor]) -> None:
    """Uneven shards (vocab_start): V is not known on one rank, so the id range is checked here:
    each valid id must be owned by exactly one rank (also catches shards that overlap or leave gaps)."""
    ok = owners == 1
    if valid is not None:
        ok = ok | ~valid
    what = ("token_ids must lie in [0, V) at unmasked positions, and the ranks' vocab shards "
            "[vocab_start, vocab_start + weight.shape[0]) must tile [0, V) without gap or overlap")
    if not _host_checks(owners):
        torch._assert_async(ok.all(), what)
    elif not bool(ok.all()):
        raise ValueError(f"{what}; {int((~ok).sum())} token(s) owned by {sorted(set(owners[~ok].tolist()))} ranks")


def tp_linear_logprobs(hidden: Tensor, shard: VocabShard, ids: Tensor, *, temperature: float = 1.0,
                       fp32_lm_head: bool = False, with_entropy: bool = False,
                       row_mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                       final_logit_softcapping: Optional[float] = None,
                       round_logits: bool = False,
                       compute_dtype: Optional[torch.dtype] = None) -> LinearLogprobs:
    """hidden [..., H], ids [...] global in [0, V) -> LinearLogprobs [...] of the full vocab, equal on
    every rank (module docstring: the math). row_mask [...] bool: rows where False report 0.
    logit_scale / final_logit_softcapping act on each logit alone, so each shard applies them."""
    lead = ids.shape
    h = hidden.reshape(-1, hidden.shape[-1])                                 # [N, H]
    ids = ids.reshape(-1)                                                    # [N]
    rm = None if row_mask is None else row_mask.reshape(-1)                  # [N]
    local = ids - shard.start                                                # [N]
    own = (local >= 0) & (local < shard.weight.shape[0])                     # [N]
    if rm is not None:
        own = own & rm
    if shard.group is not None:
        h = _CopyToTPRegion.apply(h, shard.group)
    out = linear_logprobs(h, shard.weight, torch.where(own, local, 0), shard.bias, temperature=temperature,
                          fp32_lm_head=fp32_lm_head, with_entropy=with_entropy, row_mask=rm,
                          logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping,
                          round_logits=round_logits, compute_dtype=compute_dtype)
    st = shard_stats(out.logprobs, out.lse, own, out.entropy if with_entropy else None)   # [k, N]
    st = st[None] if shard.group is None else _gather_own_slot(st, shard)    # [R, k, N]
    logprobs, entropy, lse = combine_shards(st, shard, rm)                   # [N] each
    return LinearLogprobs(logprobs.view(lead), None if entropy is None else entropy.view(lead), lse.view(lead))


def shard_stats(lp: Tensor, lse: Tensor, own: Tensor, entropy: Optional[Tensor]) -> Tensor:
    """[k, N] statistics of this rank's shard, the rows combine_shards reads: lp where the rank
    owns the target (else 0), lse, own as 0/1, and the shard's entropy when given."""
    rows = [torch.where(own, lp, 0), lse, own.to(lse.dtype)]
    return torch.stack(rows + ([] if entropy is None else [entropy]))


def combine_shards(st: Tensor, shard: VocabShard, rm: Optional[Tensor]
                   ) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """Every rank's statistics st [R, k, N] (lp_r where the rank owns the target else 0, lse_r,
    o_r[, H_r]) -> (logprobs, entropy or None, lse) [N] of the full vocab (module docstring),
    0 at rows where rm [N] is False."""
    lp_r, lse_r, o_r = st[:, 0], st[:, 1], st[:, 2]                          # [R, N]
    if shard.vocab_size is None:
        _check_owned(o_r.sum(0), rm)
    lse = torch.logsumexp(lse_r, 0)                                          # [N]
    # where, not o_r * (...): lse_r = -inf on a shard of banned tokens would give 0 * inf = NaN
    logprobs = (lp_r + torch.where(o_r > 0, lse_r - lse, 0)).sum(0)          # [N]
    entropy = None
    if st.shape[1] > 3:
        w = torch.exp(lse_r - lse)                                           # [R, N]
        term = torch.where(w > 0, st[:, 3] + (lse - lse_r), 0)               # [R, N], 0 * inf guarded
        entropy = (w * term).sum(0)                                          # [N]
    if rm is not None:  # masked rows: lse_r = 0 on every rank would give lse = log R
        logprobs, lse = torch.where(rm, logprobs, 0), torch.where(rm, lse, 0)
        entropy = None if entropy is None else torch.where(rm, entropy, 0)
    return logprobs, entropy, lse


def gather_shards(st: Tensor, shard: VocabShard) -> Tensor:
    """[k, N] -> [R, k, N]: every rank's statistics, one all-gather outside autograd."""
    if shard.group is None:
        return st[None]
    return _all_gather(st.contiguous(), 0, shard.group).view(shard.world, *st.shape)


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """x summed over the group's ranks (the full dX from each rank's part); group None: x."""
    if group is None:
        return x
    out = funcol.all_reduce(x.contiguous(), "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


__all__ = ["VocabShard", "all_reduce_sum", "combine_shards", "gather_shards", "is_dtensor",
           "tp_linear_logprobs", "vocab_shard"]
