"""bench.e2e (the end-to-end step) and bench.probes.first_call on CPU: the compiled_grpo step is
one graph, the eager providers agree, and the first-call comparison runs each provider in a fresh
process with cold caches."""
import os
import runpy
import types

import pytest
import torch


@pytest.mark.parametrize("run_name", ["bench.e2e", "bench_e2e_under_runpy"])
def test_e2e_compiled_grpo_step_is_one_graph(run_name):
    """bench.e2e's compiled_grpo step traces in one frame with fullgraph=True (the backbone and
    the loss): no graph break of the bench's own making (its GRPOConfig is made outside the
    step), so the compile time it reports is the step's, not a Dynamo restart's. Also with the
    file run under another module's name (bench.probes.first_call runs it with runpy): a
    functools.partial step failed there ("module '__main__' has no attribute ...")."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from bench import e2e as module
    e2e = (module if run_name == "bench.e2e"
           else types.SimpleNamespace(**runpy.run_module("bench.e2e", run_name=run_name)))
    model = e2e.build_model(1, 64, 200, 24, torch.device("cpu"), torch.float32)
    ids, mask, adv, old, ref = e2e.make_batch(model, 2, 8, 16, torch.device("cpu"))
    keep = torch.nonzero(mask.reshape(-1) > 0)[:, 0]
    p = e2e.Params()
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    fn = torch.compile(e2e.step_loss("compiled_grpo", p), backend=cnt, fullgraph=True)
    loss = fn(model, ids, mask, adv, old, ref, 8, p, keep)
    assert torch.isfinite(loss) and cnt.frame_count == 1, cnt.frame_count


def test_e2e_step_smoke(tmp_path):
    """bench.e2e on the tiny CPU model: the three eager providers run and agree on the loss."""
    from bench import e2e
    rows = e2e.main(["--providers", "naive", "trl_chunked", "compiled_grpo", "--reps", "1", "--out", str(tmp_path)])
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-5, losses
    assert (tmp_path / "e2e.csv").exists()


_E2E_OUT = """first_call: 4 kernels to the workers at 19.6 s
TorchDynamo compilation metrics:
_compile.compile_inner                                                   21.9569
compile_attempt_0                                                         7.4309
compile_attempt_1                                                        14.1192
| provider | step ms | first call s | peak GiB | loss | status |
|---|---:|---:|---:|---:|---|
| {p} | 75.5 | 32.8 | 3.19 | 0.4364 | ok |
first-call parts (count, seconds):
  triton.compile <50ms                                8     0.05
  triton.compile >50ms                                1     0.06
"""


def test_first_call_alternates_fresh_processes_and_reads_their_rows(tmp_path):
    """bench.probes.first_call --alternate: each provider in turn, each run a fresh process with
    Inductor's caches off and an empty TRITON_CACHE_DIR of its own; one row a run read from the
    run's output (bench.e2e's row, Dynamo's attempts, slow Triton compiles)."""
    from bench.probes import first_call
    calls = []

    def run(cmd, env, **kw):
        calls.append((cmd, env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"], env["TRITON_CACHE_DIR"]))
        assert os.listdir(env["TRITON_CACHE_DIR"]) == []
        p = cmd[cmd.index("--providers") + 1]
        return types.SimpleNamespace(stdout=_E2E_OUT.format(p=p), stderr="")

    rows = first_call.alternate(2, ["compiled_grpo+compile", "trl_chunked+compile"], 8, ["--reps", "5"],
                                str(tmp_path), run=run)
    assert [r["provider"] for r in rows] == ["compiled_grpo+compile", "trl_chunked+compile"] * 2
    assert [r["round"] for r in rows] == [1, 1, 2, 2]
    assert rows[0] == dict(provider="compiled_grpo+compile", first_s=32.8, ms=75.5, peak_gib=3.19,
                           status="ok", attempts=2, slow_compiles=1, round=1)
    assert len({c[2] for c in calls}) == 4 and {c[1] for c in calls} == {"1"}
    assert calls[0][0][-4:] == ["compiled_grpo+compile", "--compile-times", "--reps", "5"]
    assert len(list(tmp_path.iterdir())) == 4
    bad = first_call.summary("compiled_grpo+compile", "| compiled_grpo+compile |  |  |  |  | error: X |")
    assert bad["status"] == "error: X" and bad["first_s"] is None and bad["attempts"] == 0


def test_e2e_pass_providers_fuse_on_cpu(tmp_path):
    """bench.e2e's +compile+pass providers (issue 65): the whole step compiled with the pass on;
    bench's naive spelling and TRL 1.16's selective_log_softmax head (its per-row loops on CPU)
    each fused once, the loss equal to the eager naive step's."""
    from bench import e2e
    from lowerings.naive_fusion import UNFUSED_REASONS
    rows = e2e.main(["--providers", "naive", "naive+compile+pass", "trl_selective+compile+pass",
                     "--reps", "1", "--out", str(tmp_path)])
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    for r in rows[1:]:
        assert "naive_logprob_fusion=1" in r["note"], r
        assert not any(f"{reason}=" in r["note"] for reason in UNFUSED_REASONS), r
        assert abs(r["loss"] - rows[0]["loss"]) < 1e-4, (r, rows[0])
    assert "naive_row_loop_fold=1" in rows[2]["note"], rows[2]
