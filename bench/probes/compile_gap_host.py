"""The host side of the compiled grpo_loss step (issue 65): wall time against GPU time, the host
time of one step (no synchronize), and the CPU ops with the most self time.

    python -m bench.probes.compile_gap_host [--shape qwen3-8b]
"""
import argparse
import time

import torch

from bench.probes.compile_gap import bench_step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b")
    a = p.parse_args(argv)
    loss, step = bench_step(a.shape)
    for name, f in (("eager", loss), ("compiled", torch.compile(loss, fullgraph=True, dynamic=False))):
        run = step(f)
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
