"""Does an eager step run slower once the process has compiled something (issue 65, item 3)?
bench.tp times its "tp=1 eager" row before any torch.compile and its other rows after: at a
host-bound shape the same eager work read 19.9 ms first and 30.6 ms later. One eager step of
grpo_loss timed before compiling, after compiling it, and after gc.freeze() (Python's collector
then skips the objects compiling left behind), and the compiled step, in one process.

    python -m bench.probes.eager_after_compile [--shape qwen2.5-0.5b] [--mode recompute] [--tp1]
"""
import argparse
import gc

import torch

from bench.probes.compile_gap import bench_step
from bench.probes.compiled_recompute_time import timed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--mode", default="recompute")
    p.add_argument("--tp1", action="store_true")
    a = p.parse_args(argv)
    loss, step = bench_step(a.shape, a.mode, a.tp1)
    rows = [("eager, nothing compiled yet", timed(step(loss), reps=15))]
    comp = torch.compile(loss, fullgraph=True, dynamic=False)
    timed(step(comp), reps=1)
    rows += [("eager, after compiling", timed(step(loss), reps=15)),
             ("compiled", timed(step(comp), reps=15))]
    gc.collect()
    gc.freeze()
    rows += [("eager, after gc.freeze()", timed(step(loss), reps=15)),
             ("compiled, after gc.freeze()", timed(step(comp), reps=15))]
    counts = gc.get_count()
    print(f"{a.shape} ({a.mode}{', tp_group of one rank' if a.tp1 else ''}); "
          f"gc objects frozen {gc.get_freeze_count()}, counts {counts}")
    for name, ms in rows:
        print(f"  {name:<32}{ms:8.2f} ms")


if __name__ == "__main__":
    main()
