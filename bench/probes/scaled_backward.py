"""The fused path's two backwards on one bench shape: GRPOConfig.fused_scaled_backward True (the
exp-scaled backward where fused.exp_scaled allows it) against False (the in-place dlogits pass),
timed alternating with the valid floor in the same run, each step's kernels profiled, and
(unless --no-check) both gradients against the float32 recompute path.

    python -m bench.probes.scaled_backward [--shape gemma2-2b] [--rounds 3] [--no-check]

The shape's softcap is applied (gemma2-2b: 30), so at a softcapped head both configs take the
pass unless exp_scaled admits a softcap: bench/results/small_heads_h100_5380939.txt timed the
reverted variant that did (45a64b6) this way. DAPO with a k3 KL (beta 0.04), sampled targets.
CUDA only.
"""
import argparse
import collections

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import compiled_grpo as cg
from bench.measure import keep_busy
from bench.shapes import SHAPES, make_inputs


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=2, rep=1500, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma2-2b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    x = make_inputs(shape, torch.device("cuda"), targets="sampled")
    h2, w = x.hidden.detach().reshape(-1, shape.H), x.weight.detach()
    xv = h2[torch.nonzero(x.mask.reshape(-1))[:, 0]]
    dz = torch.randn(xv.shape[0], shape.V, device="cuda", dtype=w.dtype)
    floor_fns = (lambda: xv @ w.T, lambda: dz @ w, lambda: dz.T @ xv)
    cfgs = {s: cg.GRPOConfig(loss_type="dapo", beta=0.04, final_logit_softcapping=shape.softcap,
                             fused_scaled_backward=s) for s in (True, False)}
    hid, wt = x.hidden.detach().requires_grad_(), x.weight.detach().requires_grad_()

    def step(cfg, h=hid, w_=wt):
        h.grad = w_.grad = None
        cg.grpo_loss(h, w_, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs,
                     config=cfg).loss.backward()

    if not args.no_check:
        grads = {}
        for s, cfg in cfgs.items():
            step(cfg)
            grads[s] = (hid.grad.float().clone(), wt.grad.float().clone())
        hr, wr = (t.detach().float().requires_grad_() for t in (x.hidden, x.weight))
        step(cg.GRPOConfig(loss_type="dapo", beta=0.04, final_logit_softcapping=shape.softcap,
                           gradient_mode="recompute"), hr, wr)
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        for s in (True, False):
            print(f"fused_scaled_backward={s}: dX err {rel(grads[s][0], hr.grad):.3e}, "
                  f"dW err {rel(grads[s][1], wr.grad):.3e} (against the fp32 recompute path)")
        del grads, hr, wr
    keep_busy(lambda: [f() for f in floor_fns], 5.0, torch.device("cuda"))
    for r in range(args.rounds):
        floor = sum(bench(f) for f in floor_fns)
        t = {s: bench(lambda c=c: step(c)) for s, c in cfgs.items()}
        print(f"round {r}: floor_valid {floor:.2f} ms; scaled {t[True]:.2f} = {t[True] / floor:.3f}x; "
              f"dlogits pass {t[False]:.2f} = {t[False] / floor:.3f}x")
    for s, cfg in cfgs.items():
        step(cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(cfg)
            torch.cuda.synchronize()
        fam = collections.Counter()
        for e in prof.events():
            if e.device_time_total > 0:
                fam[e.name[:40]] += e.device_time_total / 1e3
        print(f"fused_scaled_backward={s}, kernels (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in fam.most_common(6)))


if __name__ == "__main__":
    main()
