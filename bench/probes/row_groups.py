"""Per row group kernel times of a recompute step, from a chrome trace.

    python -m bench.kernels.fused --shape qwen3-8b --targets sampled --recompute --trace DIR
    python -m bench.probes.row_groups DIR/recompute.json.gz [--steps 3]

The recompute path (lowerings/linear_logprobs/recompute/rows.py) launches, per row group, a row
gather, then the forward (in the forward op) or the dlogits / dW / dX steps of each vocab chunk
(in the backward op). This splits the last profiled step's kernels at each gather and sums each
kernel family's GPU time per group: the partial group at the end of the valid rows and the empty
groups past it show up as their own rows. It found the partial group's dX step taking a full
group's time (bench/results/recompute_dx_split_h100.txt). Runs anywhere (reads a file).
"""
import argparse
import collections
import gzip
import json

FAMILIES = ("_fwd", "_dlogits", "_dw_step", "_dx_step", "_dx_split")


def group_times(events: list, steps: int) -> list[dict]:
    """[{family: ms}] per row group of the last of `steps` profiled steps, in launch order:
    the forward op's groups first, then the backward op's."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    per = len(kernels) // steps
    groups = []
    for e in kernels[(steps - 1) * per:]:
        if e["name"].startswith("_gather_rows"):
            groups.append(collections.Counter())
        elif groups:
            family = next((f for f in FAMILIES if e["name"].startswith(f)), None)
            if family is not None:
                groups[-1][family] += e["dur"] / 1e3          # us -> ms
    return groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="a chrome trace of bench.kernels.fused --trace (.json or .json.gz)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in the trace")
    a = ap.parse_args()
    with (gzip.open if a.trace.endswith(".gz") else open)(a.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    for i, g in enumerate(group_times(events, a.steps)):
        print(f"group {i:3d}  " + "  ".join(f"{k.lstrip('_')} {g[k]:7.3f}" for k in FAMILIES if k in g)
              + "  ms")


if __name__ == "__main__":
    main()
