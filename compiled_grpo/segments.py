"""Packed sequences' per-sequence sums and broadcasts (loss.py's ``segments=``): deterministic,
no host sync, differentiable to any order, and taken by torch.func and torch.compile.

Shape legend: S sequences laid end to end in N tokens.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class Segments(NamedTuple):
    """Packed layout: sequence s owns the flat tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``.

    ``ids`` [N] int64 is each token's sequence, ``torch.searchsorted(cu_seqlens[1:], arange(N),
    right=True)`` (a zero-length sequence owns no token), so non-decreasing; ``num_sequences`` is
    S = ``cu_seqlens.shape[0] - 1``, a size (a SymInt under dynamic shapes), never read from tensor
    data; ``cu_seqlens`` [S + 1] the sequences' offsets (None: found from ``ids`` by searchsorted,
    which needs ids non-decreasing, each sequence's tokens contiguous; build Segments with
    :func:`segments_from_cu_seqlens`).

    Per-sequence sums are ``torch.segment_reduce`` over the offsets and broadcasts are
    ``index_select``, each the other's gradient (``_SegmentSum`` / ``_SegmentBroadcast``): no host
    sync, no data-dependent shape, and bitwise deterministic on CUDA too. An ``index_add`` into
    [S] (and index_select's own backward, also one) adds with atomics on CUDA, eager and in
    Inductor's code: a GSPO loss and its gradients then differed between identical steps.
    """

    ids: Tensor         # [N] int64, non-decreasing
    num_sequences: int  # S
    cu_seqlens: Optional[Tensor] = None   # [S + 1] int32/int64: 0, ..., N

    def offsets(self) -> Tensor:
        """[S + 1] each sequence's first token, and N last (from ids each call when built
        without them: segments_from_ids finds them once)."""
        return offsets_of(self.ids, self.num_sequences) if self.cu_seqlens is None else self.cu_seqlens

    def sum(self, x: Tensor) -> Tensor:
        """[N] -> [S]: sum over each sequence's tokens (0 for an empty sequence)."""
        return _SegmentSum.apply(x, self.ids, self.offsets())  # [S]

    def broadcast(self, x: Tensor) -> Tensor:
        """[S] -> [N]: each token takes its sequence's value."""
        return _SegmentBroadcast.apply(x, self.ids, self.offsets())  # [N]


def _save_segments(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])   # ids [N], offsets [S + 1]


class _SegmentSum(torch.autograd.Function):
    """[N] -> [S] sums in a fixed order (CUDA: CUB's segmented reduce); gradient: a broadcast.
    Functions with setup_context: torch.func.grad (the fused mode's block gradient) and
    torch.compile (segment_reduce runs as its ATen kernel there) both take them."""

    @staticmethod
    def forward(x: Tensor, ids: Tensor, offsets: Tensor) -> Tensor:
        return torch.segment_reduce(x, "sum", offsets=offsets, unsafe=True)   # [S]

    setup_context = staticmethod(_save_segments)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _SegmentBroadcast.apply(grad, *ctx.saved_tensors), None, None


class _SegmentBroadcast(torch.autograd.Function):
    """[S] -> [N] by index_select; gradient: the fixed-order sums of _SegmentSum."""

    @staticmethod
    def forward(x: Tensor, ids: Tensor, offsets: Tensor) -> Tensor:
        return x.index_select(0, ids)   # [N]

    setup_context = staticmethod(_save_segments)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _SegmentSum.apply(grad, *ctx.saved_tensors), None, None


def offsets_of(ids: Tensor, num_sequences) -> Tensor:
    """[S + 1] offsets of non-decreasing sequence ids [N] in [0, S)."""
    s = torch.arange(num_sequences + 1, device=ids.device, dtype=ids.dtype)
    return torch.searchsorted(ids, s)


def segments_from_ids(ids: Tensor, num_sequences) -> Segments:
    """:class:`Segments` of non-decreasing ids [N] in [0, S), their offsets found once."""
    return Segments(ids, num_sequences, offsets_of(ids, num_sequences))


def segments_from_cu_seqlens(cu_seqlens: Tensor, num_tokens) -> Segments:
    """:class:`Segments` of ``cu_seqlens`` [S + 1] (int32/int64, 0 first, N last, non-decreasing)."""
    pos = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)  # [N]
    # = searchsorted(cu_seqlens[1:], pos, right=True) since cu_seqlens[0] = 0 <= pos. Not the slice:
    # with the sliced boundaries, Inductor's CUDA code (torch 2.11) produced ids >= S (a device-side
    # "index out of bounds" assert in the gather); the whole tensor compiles right on CPU and CUDA.
    ids = torch.searchsorted(cu_seqlens, pos, right=True) - 1  # [N] int64
    return Segments(ids, cu_seqlens.shape[0] - 1, cu_seqlens)
