"""Which launch differences break a row's bits (the batch-invariance test's failures): dense N with
and without divisibility by 16 and 128, N = 1, TMA on and off, fused exp-scaled on and off.
python -m bench.probes.invariance_probe  (CUDA)."""
import os
import torch

import compiled_grpo as cg
import lowerings.linear_logprobs.tuning as tuning
import lowerings.linear_logprobs.recompute.dense as tk
from tests.batch_invariance import make_batch


def diff(a, b):
    return int((a != b).sum())


def no_fp_fusion():
    """Every forward / combine launch with enable_fp_fusion=False (no mul-add contraction)."""
    from lowerings.linear_logprobs.kernels import combine, logits
    for k in (logits._fwd_kernel, combine._combine_kernel):
        run = k.run
        k.run = lambda *a, _run=run, **kw: _run(*a, **{**kw, "enable_fp_fusion": False})


def main():
    if os.environ.get("NO_FP_FUSION") == "1":
        no_fp_fusion()
    hidden, weight, ids, mask, adv = make_batch(16, 1024, 4096, 151936, torch.bfloat16, "cuda")
    x, y = hidden.reshape(-1, 4096), ids.reshape(-1)
    with torch.no_grad():
        for tma in ("1", "0"):
            tuning.TMA = tma
            ref = cg.token_logprobs(x, weight, y, with_entropy=True)       # N = 16384
            for n in (16383, 16368, 16000, 8001, 129, 127, 17, 16, 2, 1):
                o = cg.token_logprobs(x[:n], weight, y[:n], with_entropy=True)
                c = cg.token_logprobs(x[:n].clone(), weight, y[:n], with_entropy=True)
                print(f"TMA={tma} dense N={n}: lp {diff(o.logprobs, ref.logprobs[:n])} "
                      f"ent {diff(o.entropy, ref.entropy[:n])}  clone lp {diff(c.logprobs, ref.logprobs[:n])}")
            for i, j in ((3, 5), (7, 1001), (15, 1023)):
                o = cg.token_logprobs(hidden[i, j:j + 1], weight, ids[i, j:j + 1], with_entropy=True)
                print(f"TMA={tma} row view ({i}, {j}): lp {diff(o.logprobs, ref.logprobs[i * 1024 + j])} "
                      f"ent {diff(o.entropy, ref.entropy[i * 1024 + j])}")
            m = torch.ones(16384, dtype=torch.bool, device="cuda")
            o = cg.token_logprobs(x, weight, y, mask=m, with_entropy=True)
            print(f"TMA={tma} rows all-valid: lp {diff(o.logprobs, ref.logprobs)} ent {diff(o.entropy, ref.entropy)}")
        tuning.TMA = "1"
        ref = cg.token_logprobs(hidden, weight, ids, mask=mask, with_entropy=True)
        for scaled in (True, False):
            cfg = cg.GRPOConfig(loss_type="dapo", gradient_mode="fused", metrics="with_entropy",
                                fused_scaled_backward=scaled)
            w = weight.detach().requires_grad_()
            with torch.enable_grad():
                r = cg.grpo_loss(hidden, w, ids, adv, mask, ref.logprobs, config=cfg)
            print(f"fused scaled={scaled}: lp {diff(r.logprobs[mask], ref.logprobs[mask])} "
                  f"ent {diff(r.entropy[mask], ref.entropy[mask])}")


if __name__ == "__main__":
    main()
