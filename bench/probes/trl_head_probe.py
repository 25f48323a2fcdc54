"""The drop-in's lm_head under bf16 autocast against TRL 1.16's fused head, op level, one GPU.

    python -m bench.probes.trl_head_probe [--more]

TRL's ChunkedLogProbFunction under torch.autocast(bf16) (logits tiles rounded to bf16 by cuBLAS,
their gradient rounded to bf16, fp32 dX / dW) against compiled_grpo with round_logits=True and
lm_head_dtype=bf16 (the drop-in's settings under TRL's default bf16=True), on fp32 leaves as a
trainer's master weights are: token_logprobs (the recompute op) and grpo_loss (dapo, beta 0,
on-policy: each row's upstream gradient is -adv / n_valid, so TRL's is built the same way) in
its recompute and fused modes. Printed per shape: the log-probs' max difference and how many rows
differ at all, and dX / dW relative to TRL's; then each one's error against a float64 model of
the same roundings (logits rounded to bf16, the logits gradient rounded to bf16, exact sums), so
a difference can be told apart from an error: the shapes of the TRL test model (H=32, V=48) and
of a small LM.
"""
import sys

import torch

import compiled_grpo as cg
from trl.kernels import ChunkedLogProbFunction


def _rounded_model(h, w, ids, g):
    """(lp, dX, dW) in float64 with TRL's bf16 roundings: compiled_grpo.reference_token_logprobs
    with the drop-in's settings on float64 leaves (operands rounded to bf16, the logits and their
    gradient rounded to bf16, exact sums)."""
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    lp = cg.reference_token_logprobs(hh, ww, ids, round_logits=True, lm_head_dtype=torch.bfloat16).logprobs
    (lp * g.double()).sum().backward()
    return lp.detach(), hh.grad, ww.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: a smoke run of the script
    shapes = {"TRL test model": (160, 32, 48), "small LM": (4096, 1024, 32000) if dev == "cuda" else (64, 64, 512)}
    if "--more" in sys.argv and dev == "cuda":   # the fused dX step's split count follows the rows
        shapes.update({"small LM, 1024 rows": (1024, 1024, 32000), "small LM, 512 rows": (512, 1024, 32000),
                       "qwen3-0.6b head, 4096 rows": (4096, 1024, 151936)})
    for name, (N, H, V) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(N, H, generator=gen).to(dev)
        w = (torch.randn(V, H, generator=gen) / H ** 0.5).to(dev)
        ids = torch.randint(0, V, (N,), generator=gen).to(dev)
        adv = torch.randn(N, generator=gen).to(dev)
        g = -adv / N          # dapo, on-policy, beta 0: dL/dlp of row i, every row valid

        def trl():
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast(dev, torch.bfloat16):
                lp = ChunkedLogProbFunction.apply(hh, ww, None, ids, 1.0, 4096, None, 1.0, ("entropy",))[0]
            (lp * g).sum().backward()
            return lp.detach(), hh.grad, ww.grad

        def ours(mode):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            kw = dict(round_logits=True, lm_head_dtype=torch.bfloat16)
            if mode == "token_logprobs":
                lp = cg.token_logprobs(hh[None], ww, ids[None], **kw).logprobs[0]
                (lp * g).sum().backward()
            else:
                every = torch.ones(1, N, dtype=torch.bool, device=dev)
                cfg = cg.GRPOConfig(loss_type="dapo", beta=0.0, gradient_mode=mode, **kw)
                out = cg.grpo_loss(hh[None], ww, ids[None], adv[None], every, config=cfg)
                out.loss.backward()
                lp = out.logprobs[0]
            return lp.detach(), hh.grad, ww.grad

        ref = _rounded_model(h, w, ids, g)
        runs = {"trl": trl(), **{m: ours(m) for m in ("token_logprobs", "recompute", "fused")}}
        t = runs["trl"]
        where = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
        print(f"\n{name}: N={N} H={H} V={V}, {where}, torch {torch.__version__}")
        print("| run | lp max diff vs TRL | rows differing | dX rel vs TRL | dW rel vs TRL "
              "| lp err vs model | dX err vs model | dW err vs model |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for k, (lp, dx, dw) in runs.items():
            lp_diff, lp_err = (lp - t[0]).abs().max().item(), (lp.double() - ref[0]).abs().max().item()
            print(f"| {k} | {lp_diff:.1e} | {int((lp != t[0]).sum())} | {_rel(dx, t[1]):.1e} | {_rel(dw, t[2]):.1e} "
                  f"| {lp_err:.1e} | {_rel(dx, ref[1]):.1e} | {_rel(dw, ref[2]):.1e} |")


if __name__ == "__main__":
    main()
