"""Argument checks that run before any compute and name the offending argument.

Shape/dtype/device checks are Python comparisons on (possibly symbolic) sizes: under
torch.compile they become guards, never graph breaks. The token-id range is a data check: eager
CPU raises ValueError; CUDA and compiled code use ``torch._assert_async`` (no host sync).
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INT_DTYPES = (torch.int64, torch.int32)


def check_tensor(name: str, x, *, ndims=None, dtypes=None, device=None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndims is not None and x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {device}; put all inputs on one device")


def check_shape(name: str, x: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def check_lm_head(hidden, weight, bias) -> None:
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndims=(2,), dtypes=FLOAT_DTYPES, device=hidden.device)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, device=hidden.device)
        check_shape("bias", bias, (weight.shape[0],), "[V]")


def check_token_ids(token_ids: torch.Tensor, vocab_size: int, valid: torch.Tensor) -> None:
    """token_ids at valid positions must lie in [0, V); masked positions may hold anything (-100)."""
    ok = ((token_ids >= 0) & (token_ids < vocab_size)) | ~valid
    if torch.compiler.is_compiling() or token_ids.device.type != "cpu":
        torch._assert_async(ok.all(), f"token_ids must lie in [0, V={vocab_size}) at unmasked positions")
    elif not bool(ok.all()):
        bad = token_ids[~ok]
        raise ValueError(f"token_ids must lie in [0, V={vocab_size}) at unmasked positions; found "
                         f"{bad[:5].tolist()} (and {max(bad.numel() - 5, 0)} more)")


def check_cu_seqlens(cu_seqlens, num_tokens, device) -> None:
    """cu_seqlens [S + 1] int32/int64 on hidden's device, S >= 1; values 0 first, N last, non-decreasing.

    Shapes and dtype are checked always; the values like token ids: ValueError in eager CPU code,
    ``torch._assert_async`` on other devices and under compile (no host sync).
    """
    check_tensor("cu_seqlens", cu_seqlens, ndims=(1,), dtypes=INT_DTYPES, device=device)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [S + 1] with S >= 1 sequences, got {tuple(cu_seqlens.shape)}")
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == num_tokens) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    what = "cu_seqlens must start at 0, end at N (the packed token count) and never decrease"
    if torch.compiler.is_compiling() or cu_seqlens.device.type != "cpu":
        torch._assert_async(ok, what)  # a static message: formatting the SymInt N would specialize it
    elif not bool(ok):
        values = cu_seqlens.tolist()
        raise ValueError(f"{what}; N={num_tokens}, got {values[:8]}{' ...' if len(values) > 8 else ''} "
                         f"(S+1={len(values)})")
