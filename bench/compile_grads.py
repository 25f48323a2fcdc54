"""Compiled against eager gradients of every CUDA path, at a shape with several row groups.

    python -m bench.compile_grads [--shape qwen3-8b] [--cases op-padded loss-recompute-padded ...]

For each case, the same inputs go through the eager call and through
``torch.compile(fullgraph=True)`` of the same function (caches off, so the compiled kernels are
the ones of this process's settings); two fwd+bwd calls each. Printed per case: the relative
error ||compiled - eager|| / ||eager|| of the loss, dX, dW and db, and the number of Triton /
custom-op launches Inductor's code makes of each kernel. A case fails (exit 1) past
``--tol`` (5e-3: compiled and eager run the same kernels in the same order, so only the
fused torch ops between them may round differently; a dropped launch is an error near 1).

Cases: ``op-*`` are ``token_logprobs(h, W, ids, mask=mask)`` then a masked mean of the log-probs
(+ 0.01 * entropy), the composable op a user writes their own loss with; ``loss-<mode>-*`` are
``grpo_loss`` in that gradient mode. Suffixes: ``padded`` (the shape's mask), ``packed``
(cu_seqlens), ``bias`` (an lm_head bias), ``cap`` (final_logit_softcapping 30), ``round``
(round_logits: the fused forward stores the rounded logits, its dlogits pass recomputes from them),
``fp32`` (fp32_lm_head over the bf16 head: the one- and two-product TF32 GEMMs,
tuning.logits_precision / gradient_precision).
"""
import argparse
import re
import sys

import torch

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs

CASES = ("op-padded", "op-packed", "op-padded-bias", "op-padded-cap",
         "loss-recompute-padded", "loss-recompute-packed", "loss-recompute-padded-bias-cap",
         "loss-fused-padded", "loss-fused-packed", "loss-fused-padded-bias-cap", "loss-auto-padded",
         "op-padded-round", "loss-fused-padded-round", "loss-fused-padded-bias-cap-round",
         "op-padded-fp32", "loss-recompute-padded-fp32", "loss-fused-padded-fp32")


def _step(case: str, x, bias):
    """fn(h, W, b) -> scalar, the case's loss."""
    cap = 30.0 if "cap" in case else None
    rnd = "round" in case
    fp32 = "fp32" in case
    packed = x.cu_seqlens is not None
    if case.startswith("op"):
        def fn(h, w, b):
            out = cg.token_logprobs(h, w, x.token_ids, b, mask=x.mask, with_entropy=True,
                                    cu_seqlens=x.cu_seqlens, final_logit_softcapping=cap, round_logits=rnd,
                                    fp32_lm_head=fp32)
            m = x.mask.float()
            return ((out.logprobs + 0.01 * out.entropy) * m).sum() / m.sum()
        return fn
    mode = case.split("-")[1]
    cfg = cg.GRPOConfig(gradient_mode=mode, beta=0.04, final_logit_softcapping=cap, round_logits=rnd,
                        fp32_lm_head=fp32)
    kw = dict(cu_seqlens=x.cu_seqlens) if packed else {}

    def fn(h, w, b):
        return cg.grpo_loss(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs,
                            bias=b, config=cfg, **kw).loss
    return fn


def _grads(fn, x, bias):
    h = x.hidden.detach().clone().requires_grad_()
    w = x.weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    loss = fn(h, w, b)
    loss.backward()
    return [loss.detach().float(), h.grad.float(), w.grad.float()] + ([] if b is None else [b.grad.float()])


def _rel(a, e):
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def _launches(code: str) -> dict:
    """Kernel name -> launches in Inductor's code (user Triton kernels and custom-op calls)."""
    names = re.findall(r"\b(_\w+_kernel)(?:_\d+)?\.run\(", code)
    names += re.findall(r"torch\.ops\.compiled_grpo\.(\w+)\.default\(", code)
    out: dict = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def run_case(case: str, shape_name: str = "qwen3-8b", tol: float = 5e-3) -> bool:
    shape = SHAPES[shape_name + ("-packed" if "packed" in case else "")]
    x = make_inputs(shape, torch.device("cuda"), targets="sampled")
    bias = (torch.randn(shape.V, device="cuda") * 0.5).to(x.weight.dtype) if "bias" in case else None
    fn = _step(case, x, bias)
    eager = [_grads(fn, x, bias) for _ in range(2)]
    compiled_fn = torch.compile(fn, fullgraph=True)
    from torch._inductor.utils import run_and_get_code
    with torch._inductor.config.patch(force_disable_caches=True):   # this process's kernels
        first, codes = run_and_get_code(lambda: _grads(compiled_fn, x, bias))
        compiled = [first, _grads(compiled_fn, x, bias)]
    launches = _launches("\n".join(codes))
    names = ["loss", "dX", "dW", "db"]
    errs = {names[i]: max(_rel(c[i], e[i]) for c, e in zip(compiled, eager)) for i in range(len(first))}
    ok = all(v <= tol for v in errs.values())
    print(f"{case:34s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + f"  {'ok' if ok else 'FAIL'}  launches {launches}", flush=True)
    torch._dynamo.reset()
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--tol", type=float, default=5e-3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.compile_grads needs CUDA (the CPU body has its own tests)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, shape {args.shape}")
    bad = [c for c in args.cases if not run_case(c, args.shape, args.tol)]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
