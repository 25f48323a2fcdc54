"""python -m bench [--shapes NAME ...] [--providers NAME ...] [--out DIR]

Times GRPO (DAPO, beta=0.04; --gspo: with GSPO's sequence-level ratio) loss forward+backward for
every provider at every shape, in one process, with the compute floor measured in the same run; appends to DIR/results.csv, draws
DIR/results.png and prints the run as Markdown. See bench/README.md for the method.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import torch

from bench import measure, providers, report, shapes, table


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None,
                    help=f"default: qwen3-8b on CUDA, cpu-small otherwise; known: "
                         f"{', '.join([*shapes.SHAPES, *shapes.GROUPS])}")
    ap.add_argument("--providers", nargs="+", default=None,
                    help=f"default: all ({', '.join(providers.PROVIDERS)}); floor always runs")
    ap.add_argument("--out", default="bench_out", help="directory for results.csv / results.png")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls (the first compiles)")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="then untimed calls until this many seconds have passed (default: "
                         "measure.WARMUP_S on CUDA, the GPU's sustained clock; 0 on CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default: sized to --target-s)")
    ap.add_argument("--target-s", type=float, default=None,
                    help="seconds of timed calls per provider (default 1.0 on CUDA, 0.2 on CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 reference and error columns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="sampled", choices=shapes.TARGETS,
                    help="target token ids: uniform over V, sampled from the policy's own softmax "
                         "(default: on-policy rollouts, peaked, what the published numbers use), or each "
                         "row's least likely token (a stress input)")
    ap.add_argument("--gspo", action="store_true",
                    help="GSPO's sequence-level importance ratio (TRL importance_sampling_level="
                         "'sequence') in place of DAPO's token-level one, same clip, KL and "
                         "normalizer; providers without per-sequence sums are skipped")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads on CPU (default 1: on shared cores each OpenMP barrier can wait "
                         "a scheduler slice, ~15 ms, which swamps tiny shapes)")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="then time every provider that ran at a shape again, all taking turns for "
                         "ROUNDS rounds (ABBA, after --warmup-s of the same): paired_ratio_valid, the "
                         "median over rounds of a provider's time over floor_valid's in the same "
                         "round: no drift between separate timed loops, and one shared clock "
                         "(bench/README.md); the shape's rows are written after it")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="start no provider after this many seconds (rows say so): the CSV, plot and "
                         "table still get written inside a remote runner's wall-clock limit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(a.cpu_threads)
    # The reference is float32 and must stay so: no TF32 in its GEMMs (bf16 providers unaffected).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape_list = shapes.resolve(a.shapes or (["qwen3-8b"] if device.type == "cuda" else ["cpu-small"]))
    prov_list = providers.resolve(a.providers)
    warmup_s = a.warmup_s if a.warmup_s is not None else (
        measure.WARMUP_S if device.type == "cuda" else 0.0)
    timing = measure.Timing(warmup=max(1, a.warmup), reps=a.reps, warmup_s=warmup_s,
                            target_s=a.target_s or (1.0 if device.type == "cuda" else 0.2))
    dtype = getattr(torch, a.dtype)
    params = providers.Params(importance_sampling_level="sequence" if a.gspo else "token")
    header = dict(report.run_header(device), dtype=a.dtype)
    writer = report.CsvWriter(f"{a.out}/results.csv")
    _log(f"bench: {header['device']}, torch {header['torch']}, commit {header['commit']}, "
         f"{len(shape_list)} shape(s) x {len(prov_list)} provider(s) -> {writer.path}")

    rows: list[dict] = []
    total, k, t_run = len(shape_list) * len(prov_list), 0, time.perf_counter()

    def over_limit() -> bool:
        return a.time_limit_s is not None and time.perf_counter() - t_run > a.time_limit_s
    for shape in shape_list:
        info = dict(header, shape=shape.name, B=shape.B, T=shape.T, H=shape.H, V=shape.V, N=shape.N,
                    targets=a.targets, is_level=params.importance_sampling_level)
        _log(f"== {shape.name}: B={shape.B} T={shape.T} H={shape.H} V={shape.V} N={shape.N}"
             f"{' (padded twin; packed: its valid tokens)' if shape.packed else ''}, targets {a.targets}, "
             f"{'GSPO (sequence-level ratio), ' if a.gspo else ''}"
             f"6NHV = {shape.useful_flops / 1e12:.2f} TFLOP")
        x = ref = None
        if over_limit():
            for pr in prov_list:
                k += 1
                row = dict(info, provider=pr.name, status=f"skip: --time-limit-s {a.time_limit_s:g} reached")
                writer.write(row)
                rows.append(row)
            continue
        try:
            # A packed shape: the padded twin's inputs (and reference), then its valid tokens packed.
            x = shapes.make_inputs(dataclasses.replace(shape, packed=False), device, dtype, seed=a.seed,
                                   targets=a.targets)
            if not a.no_check:
                t0 = time.perf_counter()
                ref = measure.reference(x, params, device, _log)
                _log(f"  reference: {ref.name if ref else 'n/a'} ({time.perf_counter() - t0:.1f} s)")
            if shape.packed:
                ref = measure.pack_reference(ref, x.mask)
                x = shapes.pack(x)
        except Exception as e:  # inputs alone do not fit: every provider is OOM at this shape
            if not measure.is_oom(e):
                raise
            x = ref = None
        if x is None:
            measure.free_memory(device)
            for pr in prov_list:
                k += 1
                row = dict(info, provider=pr.name, status="OOM", note="inputs do not fit")
                writer.write(row)
                rows.append(row)
            _log(f"  inputs OOM: {len(prov_list)} rows recorded as OOM")
            continue
        n_valid = shapes.n_valid(x)
        info.update(N=x.token_ids.numel(), N_valid=n_valid, valid_frac=n_valid / shape.N)
        valid_flops = 6 * n_valid * shape.H * shape.V  # the work the valid tokens need: the headline
        _log(f"  N_valid = {n_valid} ({n_valid / shape.N:.1%} of B*T), 6*N_valid*H*V = {valid_flops / 1e12:.2f} TFLOP")
        floor_ms = floor_valid_ms = None
        pending: list[dict] = []  # rows held until both floors are measured (--paired: to the end)

        def add_ratios(row: dict) -> None:
            ms = row.get("ms")
            if ms is None:
                return
            row["ratio_to_floor"] = ms / floor_ms if floor_ms else None
            # floor_valid from this run; if it failed, the all-token floor scaled by N_valid/N
            valid_floor = floor_valid_ms or (floor_ms * n_valid / info["N"] if floor_ms else None)
            row["ratio_to_valid_floor"] = ms / valid_floor if valid_floor else None
            row["tflops"] = valid_flops / (ms * 1e-3) / 1e12

        def finish() -> None:
            for r in pending:
                add_ratios(r)
                writer.write(r)
                rows.append(r)
                took = r.pop("_took_s", None)
                _log(f"    {r['provider']}: {_summary(r)}" + (f"  [{took:.1f} s]" if took else ""))
            pending.clear()

        floors_seen = 0
        for pr in prov_list:
            k += 1
            t0 = time.perf_counter()
            _log(f"[{k}/{total} {time.perf_counter() - t_run:6.0f}s] {shape.name} / {pr.name} ...")
            if over_limit():
                row = dict(info, provider=pr.name, status=f"skip: --time-limit-s {a.time_limit_s:g} reached")
            else:
                row = dict(info, **measure.run_one(pr, shape, x, params, device, timing, ref, _log))
            if pr.name == "floor":
                floor_ms = row.get("ms")
            if pr.name == "floor_valid":
                floor_valid_ms = row.get("ms")
            if pr.name in providers.FLOORS:
                floors_seen += 1
            else:
                row["_took_s"] = time.perf_counter() - t0
            pending.append(row)
            if not a.paired and floors_seen == len(providers.FLOORS):
                finish()
        if a.paired:
            _paired(pending, [pr for pr in prov_list if any(
                r["provider"] == pr.name and r.get("status") == "ok" for r in pending)],
                x, params, device, a.paired, warmup_s)
        finish()
        del x, ref
        measure.free_memory(device)

    png = report.plot(rows, f"{a.out}/results.png")
    _log(f"bench: {k} rows in {time.perf_counter() - t_run:.0f} s -> {writer.path}"
         + (f", {png}" if png else ""))
    print(table.markdown([{c: report._fmt(r.get(c)) for c in report.COLUMNS} for r in rows]))
    return 0


def _paired(pending: list[dict], ran: list, x, params, device: torch.device, rounds: int,
            warmup_s: float) -> None:
    """--paired: the providers that ran, built together and timed taking turns
    (measure.time_paired); each row gets paired_ms and paired_ratio_valid."""
    if not any(pr.name == "floor_valid" for pr in ran):
        _log("  paired: floor_valid did not run; skipped")
        return
    try:
        with contextlib.ExitStack() as stack:
            steps = {pr.name: stack.enter_context(pr.build(x, params)) for pr in ran}
            times = measure.time_paired(steps, x, device, rounds, warmup_s)
    except Exception as e:
        _log(f"  paired: failed ({'OOM' if measure.is_oom(e) else type(e).__name__}: {e})")
        return
    finally:
        measure.clear_grads(x)
        measure.free_memory(device)
    ratios = measure.paired_ratios(times, "floor_valid")
    for r in pending:
        if r["provider"] in times:
            r["paired_ms"] = statistics.median(times[r["provider"]])
            r["paired_ratio_valid"] = ratios[r["provider"]]
    _log(f"  paired ({rounds} rounds): " + ", ".join(
        f"{n} {statistics.median(t):.2f} ms = {ratios[n]:.3f}x" for n, t in times.items()))


def _summary(row: dict) -> str:
    if row.get("status") != "ok":
        return row.get("status", "?")
    parts = [f"{row['ms']:.2f} ms"]
    if row.get("ratio_to_valid_floor") is not None:
        parts.append(f"{row['ratio_to_valid_floor']:.2f}x valid floor")
    if row.get("ratio_to_floor") is not None:
        parts.append(f"{row['ratio_to_floor']:.2f}x floor")
    if row.get("paired_ratio_valid") is not None:
        parts.append(f"paired {row['paired_ratio_valid']:.3f}x valid floor")
    if row.get("peak_mem_beyond_grads_mib") is not None:
        parts.append(f"{row['peak_mem_beyond_grads_mib']:.0f} MiB beyond grads")
    for c in ("loss_rel_err", "dx_rel_err", "dw_rel_err"):
        if row.get(c) is not None:
            parts.append(f"{c.split('_')[0]} {row[c]:.1e}")
    if row.get("note"):
        parts.append(row["note"])
    if row["ms"] > 1.02 * row["ms_min"]:   # a spread worth seeing: every repetition, in order
        parts.append("reps " + " ".join(f"{t:.1f}" for t in row["times_ms"]))
    moved = [f"{k} +{row[k]}" for k in ("num_device_alloc", "num_alloc_retries") if row.get(k)]
    if moved:
        parts.append("while timed: " + " ".join(moved))
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
