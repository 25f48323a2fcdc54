"""Eager vs compiled time of the recompute op's fwd+bwd (grpo_loss gradient_mode="recompute") at
the qwen3-8b shape, and the compiled step's top CUDA kernels. python -m bench.probes.compiled_recompute_time"""
import torch

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs


def timed(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(reps):
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]))
    return sorted(ts)[len(ts) // 2]


def main():
    x = make_inputs(SHAPES["qwen3-8b"], "cuda", torch.bfloat16, seed=0)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode="recompute")
    w = x.weight.detach().requires_grad_()
    h = x.hidden.detach().requires_grad_()

    def step(f):
        def run():
            out = f(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs, config=cfg)
            out.loss.backward()
            h.grad = w.grad = None
        return run
    comp = torch.compile(cg.grpo_loss, fullgraph=True)
    print(f"recompute eager {timed(step(cg.grpo_loss)):.1f} ms, compiled {timed(step(comp)):.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(comp)()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
