"""Where a step leaves the GPU idle (issue 65, item 3): one step of grpo_loss, eager and
compiled, under torch.profiler (CPU and CUDA); the device's work in start order, every idle
interval longer than --min-us between the end of one piece of work and the start of the next,
with what the host was doing while the next launch waited, and the CUDA runtime calls that took
longer than --min-us (synchronizations, cudaMalloc / cudaFree).

    python -m bench.probes.gpu_gaps [--shapes long] [--modes auto] [--min-us 50] [--top 12] [--tp1]

A step timed by CUDA events (bench.probes.compile_gap) is device busy time plus these gaps.
"""
import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch

from bench.probes.compile_gap import bench_step

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def trace(run) -> list[dict]:
    """The chrome-trace events of one call of run (after two warm calls)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def report(events: list[dict], min_us: float, top: int) -> None:
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    # launches: cudaLaunchKernel (ATen) and cuLaunchKernel(Ex) (Triton's launcher, the driver API)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    launch = {e["args"].get("correlation"): e for e in runtime if "correlation" in e.get("args", {})}
    if not dev:
        print("no device work recorded")
        return
    t0, t1 = dev[0]["ts"], max(e["ts"] + e["dur"] for e in dev)
    busy = sum(e["dur"] for e in dev)
    gaps, end = [], dev[0]["ts"] + dev[0]["dur"]
    prev = dev[0]
    for e in dev[1:]:
        if e["ts"] - end > min_us:
            gaps.append((e["ts"] - end, end, prev, e))
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    host0 = min(e["ts"] for e in ops) if ops else t0
    print(f"device work: {len(dev)} items, {busy / 1e3:.2f} ms busy over {(t1 - t0) / 1e3:.2f} ms "
          f"(first item {(t0 - host0) / 1e3:.2f} ms after the host's first op); "
          f"{len(gaps)} gaps > {min_us:.0f} us, {sum(g[0] for g in gaps) / 1e3:.2f} ms")
    late = [ln["ts"] - start for _, start, _, b in gaps
            if (ln := launch.get(b.get("args", {}).get("correlation"))) is not None]
    print(f"  of them {sum(t > 0 for t in late)} with the next launch after the gap opened (the "
          f"host behind), {sum(t <= 0 for t in late)} queued before it, "
          f"{len(gaps) - len(late)} without a recorded launch")
    for dur, start, a, b in sorted(gaps, key=lambda g: -g[0])[:top]:
        ln = launch.get(b.get("args", {}).get("correlation"))
        where = ""
        if ln is not None:
            late = ln["ts"] - start
            # what the launching thread ran while the device waited: its ops over 20 us there
            busy_ops = defaultdict(float)
            for o in ops:
                if o["tid"] == ln["tid"] and o["ts"] < ln["ts"] and o["ts"] + o["dur"] > start:
                    busy_ops[o["name"]] += min(o["ts"] + o["dur"], ln["ts"]) - max(o["ts"], start)
            busiest = sorted(busy_ops.items(), key=lambda kv: -kv[1])[:4]
            where = (f"; launched {late / 1e3:+.2f} ms after the gap opened, host in: "
                     + ", ".join(f"{n[:40]} {u / 1e3:.2f}" for n, u in busiest if u > 20))
        print(f"  {dur / 1e3:7.2f} ms at +{(start - t0) / 1e3:7.2f} ms  {a['name'][:38]} -> "
              f"{b['name'][:38]}{where}")
    slow = sorted((e for e in runtime if e["dur"] > min_us), key=lambda e: -e["dur"])[:top]
    if slow:
        tally = defaultdict(lambda: [0, 0.0])
        for e in (e for e in runtime if e["dur"] > min_us):
            tally[e["name"]][0] += 1
            tally[e["name"]][1] += e["dur"]
        print("  runtime calls > min: " + ", ".join(f"{n} {c}x {u / 1e3:.2f} ms"
                                                 for n, (c, u) in sorted(tally.items(), key=lambda kv: -kv[1][1])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["long"])
    p.add_argument("--modes", nargs="+", default=["auto"])
    p.add_argument("--min-us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--tp1", action="store_true", help="grpo_loss with a tp_group of one rank")
    a = p.parse_args(argv)
    for name in a.shapes:
        for mode in a.modes:
            loss, step = bench_step(name, mode, a.tp1)
            torch._dynamo.reset()
            comp = torch.compile(loss, fullgraph=True, dynamic=False)
            for side, f in (("eager", loss), ("compiled", comp)):
                print(f"\n## {name} ({mode}) {side}", flush=True)
                report(trace(step(f)), a.min_us, a.top)


if __name__ == "__main__":
    main()
