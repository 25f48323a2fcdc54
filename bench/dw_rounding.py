"""Where the dW gradient's error comes from: its bf16 roundings, modelled in float64 on CPU.

    python -m bench.dw_rounding [--vocab 8192] [--hidden 256] [--rows 512] [--blocks 4]
        [--logit-std 3.0] [--seed 0]

dW = sum over row blocks b of dlogits_b^T X_b, dlogits = g (onehot(y) - p) a row (no entropy
term). Every product and sum below is exact (float64, where the kernels accumulate in fp32: a
far smaller error); only the points where the kernels round to bf16 are rounded:

  recompute  the recompute path and the fused path's in-place dlogits pass: dlogits rounded once
             (bf16), X exact (it is the bf16 input)
  exp-scaled the fused path's default (fused_scaled_backward, docs/gradient-modes.md): the
             forward stores e = exp(z - R) (R = the target logit + 16, the target's entry
             (p_y - 1) exp(lse - R)) in bf16, and the dW GEMM reads X scaled by
             c = -g exp(R - lse), rounded to bf16 as well: two roundings a product, not one
  cX exact   the exp-scaled operands with c X unrounded: what the scaled rows' rounding costs

and, a block's fp32 sum into the bf16 dW (kernels.dw._dw_tile): "one rounding a product sum"
(final only), the pointer epilogue's load-add-store (one rounding a block) and the TMA
reduce-add (the tile rounded, then the sum: two a block; tuning.DW_TMA_OUT, the default). Prints
each one's relative error (Frobenius norm) against exact float64 dW.

This is the error budget behind docs/gradient-modes.md's "1.15x the recompute mode's dW error": the scaled rows'
rounding is as large as the dlogits' own, and a power-of-two c (exact scaled rows) would need the
per-token gradient before the forward stores e. Measured on H100 (bench/results/
dw_epilogue_long_h100_bb78666.txt): dW error 3.4e-3 exp-scaled against 3.1e-3 recompute with the
TMA epilogue, 3.2e-3 against 2.8e-3 with the pointer one; this model gives the same order.
"""
import argparse

import torch


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _accumulate(parts: list[torch.Tensor], rule: str) -> torch.Tensor:
    """The bf16 dW after each block's exact sum is folded in by `rule` (module docstring)."""
    if rule == "final":
        return _bf16(sum(parts))
    out = _bf16(parts[0])                  # the first block with valid rows stores
    for part in parts[1:]:
        out = _bf16(out + part) if rule == "once" else _bf16(out + _bf16(part))
    return out


def error_budget(vocab=8192, hidden=256, rows=512, blocks=4, logit_std=3.0, seed=0) -> dict:
    """{(operands, accumulation): relative error of dW} for the module docstring's models."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * blocks
    x = _bf16(torch.randn(n, hidden, generator=gen, dtype=torch.float64))                  # [N, H]
    z = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * logit_std              # [N, V]
    p = torch.softmax(z, -1)
    y = torch.multinomial(p, 1, generator=gen).squeeze(1)                                  # sampled
    rows_ = torch.arange(n)
    lse = torch.logsumexp(z, -1)
    g = torch.randn(n, generator=gen, dtype=torch.float64) / n                             # dL/dlogp
    dlogits = -g[:, None] * p
    dlogits[rows_, y] += g
    exact = dlogits.T @ x                                                                  # [V, H]

    ref = z[rows_, y] + 16.0                                                               # R
    e = torch.exp(z - ref[:, None])
    e[rows_, y] = (p[rows_, y] - 1) * torch.exp(lse - ref)
    c = -g * torch.exp(ref - lse)
    operands = {"recompute": (_bf16(dlogits), x),
                "exp-scaled": (_bf16(e), _bf16(c[:, None] * x)),
                "cX exact": (_bf16(e), c[:, None] * x)}
    out = {}
    for name, (a, b) in operands.items():
        parts = [a[k * rows:(k + 1) * rows].T @ b[k * rows:(k + 1) * rows] for k in range(blocks)]
        for rule in ("final", "once", "twice"):
            dw = _accumulate(parts, rule)
            out[name, rule] = ((dw - exact).norm() / exact.norm()).item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=512, help="rows a block")
    ap.add_argument("--blocks", type=int, default=4, help="row blocks with valid rows")
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    errs = error_budget(a.vocab, a.hidden, a.rows, a.blocks, a.logit_std, a.seed)
    print(f"dW relative error, V={a.vocab} H={a.hidden}, {a.blocks} blocks of {a.rows} rows")
    print(f"{'operands':<12} {'final only':>11} {'once a block':>13} {'TMA: twice':>11}")
    for name in ("recompute", "exp-scaled", "cX exact"):
        print(f"{name:<12} " + " ".join(f"{errs[name, r]:>{w}.2e}"
                                        for r, w in (("final", 11), ("once", 13), ("twice", 11))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
