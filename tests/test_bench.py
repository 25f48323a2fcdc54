"""bench/ on CPU: the harness runs end to end on a tiny shape and writes the CSV rows it promises.

Only eager providers (no torch.compile) so the test stays within seconds; the compiled providers
share run_one and differ only in their build function.
"""
import csv

import pytest
import torch

from bench import measure, report, table
from bench.__main__ import main


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_cpu_run_writes_rows(tmp_path, capsys):
    args = ["--device", "cpu", "--shapes", "cpu-tiny", "--providers", "naive_eager", "compiled_grpo",
            "cce", "--out", str(tmp_path), "--reps", "2", "--warmup", "1"]
    assert main(args) == 0
    rows = _rows(tmp_path)
    assert list(rows[0]) == report.COLUMNS
    assert [r["provider"] for r in rows] == ["floor", "naive_eager", "cce", "compiled_grpo"]  # run order
    by = {r["provider"]: r for r in rows}
    assert all(r["device"] == "cpu" and r["shape"] == "cpu-tiny" and r["N"] == "32" for r in rows)

    floor = by["floor"]
    assert floor["status"] == "ok" and float(floor["ms"]) > 0 and float(floor["ratio_to_floor"]) == 1.0
    assert floor["loss_rel_err"] == "n/a"  # the floor computes no loss

    naive = by["naive_eager"]
    assert naive["status"] == "ok" and int(naive["reps"]) == 2
    assert float(naive["ratio_to_floor"]) > 0 and float(naive["tflops"]) > 0
    assert naive["peak_mem_beyond_grads_mib"] == "n/a"  # no allocator statistics on CPU
    # bf16 logits: errors are bf16-sized, not garbage (and not NaN)
    for c in ("loss_rel_err", "dx_rel_err", "dw_rel_err"):
        assert 0 <= float(naive[c]) < 5e-2, (c, naive[c])

    cg = by["compiled_grpo"]
    assert cg["status"] == "ok" or cg["status"].startswith("skip:")
    if cg["status"] == "ok":
        assert float(cg["dx_rel_err"]) < 5e-2 and float(cg["dw_rel_err"]) < 5e-2

    assert by["cce"]["status"].startswith("skip:") and "CUDA" in by["cce"]["status"]

    # The Markdown printed at the end, and the table CLI over the same CSV, name every provider.
    md = capsys.readouterr().out
    assert "| naive_eager |" in md and "| cce |" in md
    assert table.main(["--csv", str(tmp_path / "results.csv")]) == 1  # no GPU run in this CSV
    assert table.main(["--csv", str(tmp_path / "results.csv"), "--any-device"]) == 0
    assert "| floor | " in capsys.readouterr().out


def test_time_limit_and_append(tmp_path):
    base = ["--device", "cpu", "--shapes", "cpu-tiny", "--providers", "naive_eager", "--out",
            str(tmp_path), "--no-check"]
    assert main(base + ["--reps", "1", "--warmup", "1"]) == 0
    assert main(base + ["--time-limit-s", "0"]) == 0
    rows = _rows(tmp_path)
    assert len(rows) == 4  # appended, not overwritten
    assert all(r["status"].startswith("skip: --time-limit-s") for r in rows[2:])
    assert rows[1]["loss_rel_err"] == "n/a"  # --no-check


def test_is_oom_sees_wrapped_errors():
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        except Exception as e:
            raise RuntimeError("compile failed") from e
    except Exception as wrapped:
        assert measure.is_oom(wrapped)
    assert not measure.is_oom(ValueError("shape mismatch"))


def test_plot_or_message(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(shape="s", provider=p, status="ok", ms=str(ms), peak_mem_beyond_grads_mib=str(m), N="8")
            for p, ms, m in (("floor", 1.0, 10.0), ("naive_eager", 2.0, 100.0))]
    rows += [dict(shape=f"sweep-n{n}k", provider="floor", status="ok", ms="1", N=str(n * 1024),
                  peak_mem_beyond_grads_mib="5") for n in (4, 8)]
    assert report.plot(rows, str(tmp_path / "r.png")) == str(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0
