"""Helpers of the fused-mode tests (test_fused.py, test_fused_packed.py): runs of grpo_loss with
leaf copies of hidden and weight, the float64 fused-vs-recompute comparison, the inputs of the TRL
options and their packed twins. Legend: B sequences, T positions, H hidden, V vocab."""
import torch

import compiled_grpo as cg
from lowerings.linear_logprobs.fused import steps
from helpers import make_inputs

H, V = 16, 37


def _mib(rows: int) -> float:
    """fused_workspace_mib holding `rows` float64 rows of V logits and of the CPU body's tiles
    (fused/schedule.ws_row_bytes)."""
    return rows * (V + steps.cpu_tile_cols(V)) * 8 / 2**20


def _run(inp, cfg, bias=None, **kw):
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in ("hidden", "weight")}
    b = None if bias is None else bias.detach().clone().requires_grad_()
    args = dict(inp, **leaves)
    out = cg.grpo_loss(**args, bias=b, config=cfg, **kw)
    out.loss.backward()
    grads = (leaves["hidden"].grad, leaves["weight"].grad) + ((b.grad,) if b is not None else ())
    return out, grads


def _pair(inp, bias=None, **cfg_kw):
    cfg_kw.setdefault("fused_workspace_mib", _mib(16))
    rec = _run(inp, cg.GRPOConfig(gradient_mode="recompute", **cfg_kw), bias)
    fus = _run(inp, cg.GRPOConfig(gradient_mode="fused", **cfg_kw), bias)
    return rec, fus


def _assert_same(rec, fus):
    (ro, rg), (fo, fg) = rec, fus
    # the same loss code on log-probs that differ in summation order only (online vs whole-row lse)
    torch.testing.assert_close(fo.loss, ro.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fo.logprobs, ro.logprobs, rtol=0, atol=1e-12)
    for a, b in zip(rg, fg):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def _option_inputs(with_samp, with_old, B=5, T=9, seed=12):
    inp = make_inputs(B=B, T=T, H=H, V=V, seed=seed)
    g = torch.Generator().manual_seed(seed)
    if with_samp:
        inp["sampling_per_token_logps"] = inp["old_logprobs"] + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    if not with_old:
        inp["old_logprobs"] = None
    return inp


def _packed(inp, lengths):
    """The padded inputs' first `lengths` tokens of each row, packed (cu_seqlens), and the padded twin."""
    T = inp["mask"].shape[1]
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]      # [B, T]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    pad = dict(inp, mask=inp["mask"] & keep)
    packed = {k: (v[keep] if torch.is_tensor(v) and v.dim() >= 2 and k != "weight" else v) for k, v in pad.items()}
    packed["hidden"] = inp["hidden"].detach()[keep]
    return pad, packed, cu, keep
