"""Argument checks that run before any compute and name the offending argument.

Shape/dtype/device checks are Python comparisons on (possibly symbolic) sizes: under
torch.compile they become guards, never graph breaks. The token-id range is a data check: eager
CPU raises ValueError; CUDA and compiled code use ``torch._assert_async`` (no host sync).
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LM_HEAD_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32)  # lm_head_dtype's values
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


def _host_checks(x: torch.Tensor) -> bool:
    """Data checks that read values on the host: eager code on CPU tensors only (no sync elsewhere)."""
    return not torch.compiler.is_compiling() and x.device.type == "cpu"


def check_lm_head(hidden, weight, bias) -> None:
    """Shapes and dtypes always. Mixed dtypes are allowed (the GEMM runs in their promoted type,
    grads come back in each input's dtype). Values in eager CPU code: no NaN in weight or bias and
    no +inf in bias (a -inf bias entry bans a token and is fine); compiled / CUDA code does not
    check (a NaN there gives NaN log-probs, loss and grads)."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndims=(2,), dtypes=FLOAT_DTYPES, device=hidden.device)
    if hidden.dim() == 0 or hidden.shape[-1] == 0 or weight.shape[0] == 0:
        raise ValueError(f"hidden [..., H] and weight [V, H] need H >= 1 and V >= 1, got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, device=hidden.device)
        check_shape("bias", bias, (weight.shape[0],), "[V]")
    if _host_checks(weight):
        with torch.no_grad():
            if bool(torch.isnan(weight).any()):
                rows = torch.isnan(weight).any(-1).nonzero()[:, 0]
                raise ValueError(f"weight holds NaN (rows {rows[:5].tolist()}{' ...' if rows.numel() > 5 else ''})")
            if bias is not None and bool((torch.isnan(bias) | (bias == torch.inf)).any()):
                bad = (torch.isnan(bias) | (bias == torch.inf)).nonzero()[:, 0]
                raise ValueError(f"bias holds NaN or +inf at {bad[:5].tolist()}{' ...' if bad.numel() > 5 else ''} "
                                 "(-inf is allowed: it bans a token)")


def mask_to_bool(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask, or a 0/1 mask of any dtype as bool. Other values (a float mask of per-token
    weights, as TRL could multiply by) are rejected rather than read as True: ValueError in eager
    CPU code, ``torch._assert_async`` under compile and on other devices (no host sync)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"mask must be bool or hold 0/1 values, got dtype {mask.dtype}")
    ok = ((mask == 0) | (mask == 1)).all()
    what = "mask must be bool or hold only 0 and 1 (a float mask of per-token weights is not supported)"
    if not _host_checks(mask):
        torch._assert_async(ok, what)
    elif not bool(ok):
        bad = mask[(mask != 0) & (mask != 1)]
        raise ValueError(f"{what}; found {bad[:5].tolist()}")
    return mask != 0


def check_token_ids(token_ids: torch.Tensor, vocab_size: int, valid: torch.Tensor) -> None:
    """token_ids at valid positions must lie in [0, V); masked positions may hold anything (-100)."""
    ok = ((token_ids >= 0) & (token_ids < vocab_size)) | ~valid
    if not _host_checks(token_ids):
        torch._assert_async(ok.all(), f"token_ids must lie in [0, V={vocab_size}) at unmasked positions")
    elif not bool(ok.all()):
        bad = token_ids[~ok]
        raise ValueError(f"token_ids must lie in [0, V={vocab_size}) at unmasked positions; found "
                         f"{bad[:5].tolist()} (and {max(bad.numel() - 5, 0)} more)")


def check_cu_seqlens(cu_seqlens, num_tokens, device, max_seqlen=None) -> None:
    """cu_seqlens [S + 1] int32/int64 on hidden's device, S >= 1; values 0 first, N last, non-decreasing;
    with ``max_seqlen`` (a Python int >= 1) no sequence longer than it.

    Shapes and dtype are checked always; the values like token ids: ValueError in eager CPU code,
    ``torch._assert_async`` on other devices and under compile (no host sync).
    """
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt))):
        raise TypeError(f"max_seqlen must be an int (a bound on the lengths of cu_seqlens' sequences) or None, "
                        f"got {type(max_seqlen).__name__}")
    if max_seqlen is not None and isinstance(max_seqlen, int) and max_seqlen < 1:
        raise ValueError(f"max_seqlen must be >= 1, got {max_seqlen}")
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
    if max_seqlen is None:
        return
    fits = ((cu_seqlens[1:] - cu_seqlens[:-1]) <= max_seqlen).all()
    what = "max_seqlen must bound the length of every sequence of cu_seqlens"
    if torch.compiler.is_compiling() or cu_seqlens.device.type != "cpu":
        torch._assert_async(fits, what)
    elif not bool(fits):
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        raise ValueError(f"{what}: max_seqlen={max_seqlen}, the longest has {longest} tokens")
