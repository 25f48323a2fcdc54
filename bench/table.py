"""Print the latest GPU run of results.csv as Markdown (for README.md and docs/performance.md).

    python -m bench.table [--csv bench_out/results.csv] [--run RUN_ID] [--any-device]

Without --any-device, only GPU rows count: the CPU smoke run says nothing about speed.
"""
from __future__ import annotations

import argparse
import sys

from bench.report import num, read_rows


def _mem(mib) -> str:
    v = num(mib)
    if v is None:
        return "n/a"
    return f"{v / 1024:.2f} GiB" if abs(v) >= 1024 else f"{v:.0f} MiB"


def _err(v) -> str:
    x = num(v)
    return "n/a" if x is None else f"{x:.1e}"


def _f(v, fmt: str) -> str:
    x = num(v)
    return "" if x is None else format(x, fmt)


def _frac(v) -> str:
    x = num(v)
    return "n/a" if x is None else f"{x:.1%}"


def _paired(r: dict) -> str:
    x = num(r.get("paired_ratio_valid"))
    return "" if x is None else f" (paired {x:.3f})"


def markdown(rows: list[dict]) -> str:
    """One table per shape. Headline: x valid floor (over three bf16 GEMMs of N_valid*H*V, the work
    the batch's valid tokens need); x floor (all N positions) beside it. Old CSVs (no valid-floor
    columns) print n/a there."""
    if not rows:
        return "(no rows)"
    h = rows[0]
    lines = [
        f"{h['device']}, torch {h['torch']}, triton {h['triton']}, liger-kernel {h['liger_kernel']}, "
        f"cut-cross-entropy {h['cut_cross_entropy']}, trl {h.get('trl') or 'n/a'}, "
        f"nvidia-cutlass-dsl {h.get('cutlass_dsl') or 'n/a'}, commit {h['commit']}, run {h['run_id']}, "
        f"{h['dtype']}, targets {h.get('targets') or 'random'}.",
        "",
        "ms: median forward+backward; x valid floor: over three bf16 GEMMs of N_valid*H*V (the valid "
        "tokens only, `floor_valid`) in the same run; x floor: over the same GEMMs of all N positions; "
        "TFLOP/s counts 6*N_valid*H*V for every provider; memory: peak beyond inputs and the dX+dW "
        "gradients; errors: relative to the float32 reference (loss, dX, dW).",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        s = rs[0]
        lines += ["", f"**{shape}** (B={s['B']}, T={s['T']}, H={s['H']}, V={s['V']}, N={s['N']}, "
                      f"N_valid={s.get('N_valid') or 'n/a'} = {_frac(s.get('valid_frac'))} valid; "
                      f"reference: {s.get('reference') or 'n/a'})", "",
                  "| provider | ms | x valid floor | x floor | TFLOP/s | peak mem beyond grads | loss err | dX err "
                  "| dW err | status |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rs:
            ok = r["status"] == "ok"
            status = r["status"] + (f" ({r['note']})" if r.get("note") not in (None, "", "n/a") else "")
            lines.append(
                f"| {r['provider']} | {_f(r.get('ms'), '.1f')} | {_f(r.get('ratio_to_valid_floor'), '.2f')}"
                f"{_paired(r)} | "
                f"{_f(r.get('ratio_to_floor'), '.2f')} | {_f(r.get('tflops'), '.3g')} | "
                f"{_mem(r.get('peak_mem_beyond_grads_mib')) if ok else ''} | "
                f"{_err(r.get('loss_rel_err')) if ok else ''} | {_err(r.get('dx_rel_err')) if ok else ''} | "
                f"{_err(r.get('dw_rel_err')) if ok else ''} | {status.replace('|', '/')} |")
    return "\n".join(lines)


def latest_run(rows: list[dict], any_device: bool = False, run_id: str | None = None) -> list[dict]:
    if run_id is None:
        pool = rows if any_device else [r for r in rows if r["device"] != "cpu"]
        if not pool:
            return []
        run_id = max(r["run_id"] for r in pool)
    return [r for r in rows if r["run_id"] == run_id]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="bench_out/results.csv")
    ap.add_argument("--run", default=None, help="run_id to print (default: the latest)")
    ap.add_argument("--any-device", action="store_true", help="also consider CPU runs")
    a = ap.parse_args(argv)
    rows = latest_run(read_rows(a.csv), a.any_device, a.run)
    if not rows:
        print(f"no {'matching' if a.run or a.any_device else 'GPU'} run in {a.csv}"
              f"{'' if a.any_device else ' (--any-device to show CPU runs)'}", file=sys.stderr)
        return 1
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
