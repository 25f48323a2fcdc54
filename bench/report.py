"""CSV rows (appended one at a time, so a run killed at its time limit keeps what it measured)
and the plot of a run: time vs memory per provider, and memory vs N for the sweep."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from typing import Iterable, Optional

import torch

COLUMNS = [
    "run_id", "timestamp", "device", "torch", "triton", "liger_kernel", "cut_cross_entropy", "trl",
    "cutlass_dsl", "commit", "shape", "B", "T", "H", "V", "N", "N_valid", "valid_frac", "targets", "is_level", "dtype", "provider",
    "status", "ms", "ms_min", "reps", "ratio_to_valid_floor", "ratio_to_floor", "paired_ms", "paired_ratio_valid", "tflops", "peak_mem_beyond_inputs_mib", "peak_mem_beyond_grads_mib",
    "loss", "loss_rel_err", "dx_rel_err", "dw_rel_err", "reference", "first_call_s", "note",
]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def git_commit() -> str:
    """HEAD (+"-dirty"), or BENCH_GIT_COMMIT where the tree was copied without .git."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def run_header(device: torch.device) -> dict:
    try:
        import triton
        triton_v = triton.__version__
    except Exception:
        triton_v = "absent"
    return dict(
        run_id=time.strftime("%Y%m%dT%H%M%S"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, triton=triton_v, liger_kernel=_version("liger-kernel"),
        cut_cross_entropy=_version("cut-cross-entropy"), trl=_version("trl"),
        cutlass_dsl=_version("nvidia-cutlass-dsl"), commit=git_commit(),
    )


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


class CsvWriter:
    """Appends to DIR/results.csv; an existing file with other columns is moved aside, not mixed."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
            if header != COLUMNS:
                aside = f"{path}.{time.strftime('%Y%m%dT%H%M%S')}.old"
                shutil.move(path, aside)
                print(f"bench: {path} had other columns; moved to {aside}", file=sys.stderr)
        if not os.path.exists(path):
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(row.get(c)) for c in COLUMNS])


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(v) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def plot(rows: Iterable[dict], path: str) -> Optional[str]:
    """Left: median ms vs peak memory beyond grads, one marker per provider (and shape).
    Right: peak memory beyond grads vs N for the sweep shapes, OOM points omitted.
    Returns the path written, or None (with a message) if matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("bench: matplotlib not installed; skipping the plot (pip install matplotlib)", file=sys.stderr)
        return None
    rows = [r for r in rows if r.get("status") == "ok"]
    sweep = [r for r in rows if str(r["shape"]).startswith("sweep-")]
    fixed = [r for r in rows if not str(r["shape"]).startswith("sweep-")]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7, 5), squeeze=False)
    ax = axes[0][0]
    providers = sorted({r["provider"] for r in rows})
    colors = {p: plt.cm.tab10(i % 10) for i, p in enumerate(providers)}
    markers = "osD^v<>pP*X"
    shapes = sorted({r["shape"] for r in fixed})
    for r in fixed:
        mem = num(r.get("peak_mem_beyond_grads_mib"))
        ms = num(r.get("ms"))
        if ms is None:
            continue
        ax.scatter(mem / 1024 if mem is not None else 0.0, ms, color=colors[r["provider"]],
                   marker=markers[shapes.index(r["shape"]) % len(markers)], s=60,
                   label=f"{r['provider']} ({r['shape']})" if len(shapes) > 1 else r["provider"])
    times = [num(r.get("ms")) for r in fixed if num(r.get("ms"))]
    if times and max(times) / min(times) > 20:  # liger ~10x the floor: a linear axis hides the rest
        ax.set_yscale("log")
    if len(shapes) == 1:  # one shape (the usual GPU run): name each point, the legend is far away
        for r in fixed:
            if num(r.get("ms")) is not None:
                mem = num(r.get("peak_mem_beyond_grads_mib"))
                ax.annotate(r["provider"], ((mem or 0.0) / 1024, num(r["ms"])), fontsize=7,
                            xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak memory beyond inputs and grads [GiB] (0 where not measured: CPU)")
    ax.set_ylabel("median fwd+bwd [ms]")
    ax.set_title("time vs memory (lower left is better)")
    ax.grid(alpha=0.3)
    if fixed:
        ax.legend(fontsize=7)
    if sweep:
        ax2 = axes[0][1]
        for p in providers:
            pts = sorted((int(r["N"]), num(r.get("peak_mem_beyond_grads_mib")))
                         for r in sweep if r["provider"] == p)
            pts = [(n, m / 1024) for n, m in pts if m is not None]
            if pts:
                ax2.plot(*zip(*pts), marker="o", color=colors[p], label=p)
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("N = B*T tokens (H=4096, V=151936)")
        ax2.set_ylabel("peak memory beyond grads [GiB]")
        ax2.set_title("memory vs N (missing points: OOM or skipped)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
