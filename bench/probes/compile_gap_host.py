"""The host side of the compiled grpo_loss step (issue 65): wall time against GPU time, the host
time of one step (no synchronize), and the CPU ops with the most self time.

    python -m bench.probes.compile_gap_host [--shape qwen3-8b]
"""
import argparse
import time

import torch

import compiled_grpo as cg
from bench.shapes import SHAPES, make_inputs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b")
    a = p.parse_args(argv)
    x = make_inputs(SHAPES[a.shape], "cuda", torch.bfloat16, seed=0)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04)
    w = x.weight.detach().requires_grad_()
    h = x.hidden.detach().requires_grad_()

    def loss(*args):
        return cg.grpo_loss(*args, config=cfg).loss
    for name, f in (("eager", loss), ("compiled", torch.compile(loss, fullgraph=True, dynamic=False))):
        def run():
            f(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs).backward()
            h.grad = w.grad = None
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"\n## {a.shape} {name}: host {host * 1e3:.2f} ms (returns before the GPU ends if < wall), "
              f"wall {wall * 1e3:.2f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
