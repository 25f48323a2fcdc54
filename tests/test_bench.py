"""bench/ on CPU: the harness runs end to end on a tiny shape and writes the CSV rows it promises.

Only eager providers (no torch.compile) so the test stays within seconds; the compiled providers
share run_one and differ only in their build function.
"""
import csv
import time
import types

import pytest
import torch

from bench import measure, report, shapes, table
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
    assert [r["provider"] for r in rows] == ["floor", "floor_valid", "naive_eager", "cce", "compiled_grpo"]
    by = {r["provider"]: r for r in rows}
    assert all(r["device"] == "cpu" and r["shape"] == "cpu-tiny" and r["N"] == "32" for r in rows)
    assert all(r["targets"] == "sampled" for r in rows)  # the default
    n_valid = int(rows[0]["N_valid"])
    assert 0 < n_valid <= 32 and all(int(r["N_valid"]) == n_valid for r in rows)
    assert float(rows[0]["valid_frac"]) == pytest.approx(n_valid / 32)

    floor = by["floor"]
    assert floor["status"] == "ok" and float(floor["ms"]) > 0 and float(floor["ratio_to_floor"]) == 1.0
    assert floor["loss_rel_err"] == "n/a"  # the floor computes no loss
    fv = by["floor_valid"]  # the headline's denominator, measured in the same run
    assert fv["status"] == "ok" and float(fv["ratio_to_valid_floor"]) == 1.0
    assert float(floor["ratio_to_valid_floor"]) == pytest.approx(float(floor["ms"]) / float(fv["ms"]), rel=1e-4)
    # TFLOP/s counts 6 * N_valid * H * V
    assert float(fv["tflops"]) == pytest.approx(6 * n_valid * 32 * 128 / (float(fv["ms"]) * 1e-3) / 1e12, rel=1e-4)

    naive = by["naive_eager"]
    assert naive["status"] == "ok" and int(naive["reps"]) == 2
    assert float(naive["ratio_to_floor"]) > 0 and float(naive["tflops"]) > 0
    assert float(naive["ratio_to_valid_floor"]) == pytest.approx(float(naive["ms"]) / float(fv["ms"]), rel=1e-4)
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
    assert "| provider | ms | x valid floor | x floor |" in md and f"N_valid={n_valid} = " in md
    assert table.main(["--csv", str(tmp_path / "results.csv")]) == 1  # no GPU run in this CSV
    assert table.main(["--csv", str(tmp_path / "results.csv"), "--any-device"]) == 0
    assert "| floor | " in capsys.readouterr().out


def test_valid_token_peers_and_packed_twin(tmp_path):
    """Sampled targets; the peers on compacted valid tokens; the packed twin of cpu-tiny: same
    sequences, so the same loss and dW, and dX = the padded dX at the valid positions."""
    args = ["--device", "cpu", "--shapes", "cpu-tiny", "cpu-tiny-packed", "--targets", "sampled", "--providers",
            "naive_eager", "liger", "trl_chunked", "liger_cute", "compiled_grpo_valid", "compiled_grpo",
            "--out", str(tmp_path), "--reps", "1", "--warmup", "1"]
    assert main(args) == 0
    rows = _rows(tmp_path)
    by = {(r["shape"], r["provider"]): r for r in rows}
    assert all(r["targets"] == "sampled" for r in rows)
    pad, pk = by[("cpu-tiny", "floor")], by[("cpu-tiny-packed", "floor")]
    n_valid = int(pad["N_valid"])
    assert pad["N"] == "32" and pk["N"] == pk["N_valid"] == str(n_valid)  # packed: N = its valid tokens
    assert pk["valid_frac"] == pad["valid_frac"]  # of the padded twin's B*T
    assert by[("cpu-tiny-packed", "liger")]["status"].startswith("skip: packed input")
    for shape in ("cpu-tiny", "cpu-tiny-packed"):
        for prov in ("naive_eager", "trl_chunked", "liger_cute", "compiled_grpo_valid", "compiled_grpo"):
            r = by[(shape, prov)]
            if r["status"].startswith("skip:"):  # optional peer absent; cu_seqlens not in grpo_loss yet
                continue
            assert r["status"] == "ok", (shape, prov, r["status"])
            assert float(r["ratio_to_valid_floor"]) > 0 and float(r["tflops"]) > 0
            for c in ("loss_rel_err", "dx_rel_err", "dw_rel_err"):
                assert 0 <= float(r[c]) < 5e-2, (shape, prov, c, r[c])
    # the same loss on both layouts (the naive math on [1, N_valid] with per-token advantages)
    assert float(by[("cpu-tiny-packed", "naive_eager")]["loss"]) == pytest.approx(
        float(by[("cpu-tiny", "naive_eager")]["loss"]), rel=1e-2)
    cg_packed = by[("cpu-tiny-packed", "compiled_grpo")]["status"]
    assert cg_packed == "ok" or cg_packed == "skip: grpo_loss has no cu_seqlens"
    assert by[("cpu-tiny", "compiled_grpo_valid")]["status"] in ("ok",) or by[
        ("cpu-tiny", "compiled_grpo_valid")]["status"].startswith("skip:")


def test_sampled_targets_are_on_policy():
    """sampled: ids drawn from the policy's softmax (chunked), so their log-probs sit far above
    uniform random ids'; packing keeps the valid tokens in sequence order."""
    sh = shapes.SHAPES["cpu-tiny"]
    rnd = shapes.make_inputs(sh, torch.device("cpu"), torch.float32, targets="random")
    smp = shapes.make_inputs(sh, torch.device("cpu"), torch.float32, targets="sampled")
    assert torch.equal(rnd.hidden, smp.hidden) and torch.equal(rnd.mask, smp.mask)
    assert smp.old_logprobs.mean() > rnd.old_logprobs.mean() + 1.0
    h, w = smp.hidden.detach().view(-1, sh.H), smp.weight.detach()
    assert torch.equal(shapes._chunked_sample(h, w, 5, torch.Generator().manual_seed(1)),
                       shapes._chunked_sample(h, w, 64, torch.Generator().manual_seed(1)))
    pk = shapes.make_inputs(shapes.SHAPES["cpu-tiny-packed"], torch.device("cpu"), torch.float32, targets="sampled")
    keep = smp.mask.view(-1) > 0
    assert torch.equal(pk.hidden.detach(), smp.hidden.detach().view(-1, sh.H)[keep])
    assert torch.equal(pk.token_ids, smp.token_ids.view(-1)[keep])
    assert pk.cu_seqlens.tolist() == [0, *smp.mask.sum(1).cumsum(0).int().tolist()]
    assert torch.equal(pk.token_advantages, smp.advantages[:, None].expand(-1, sh.T).reshape(-1)[keep])
    with pytest.raises(ValueError):
        shapes.make_inputs(sh, torch.device("cpu"), targets="greedy")


def test_least_targets_are_each_rows_argmin():
    """least (bench.kernels.fused's stress input): each id is its row's least likely token, chunking
    changes nothing, and at logit std 8 the log-probs fall past -48 (the exp-scaled backward's
    re-referenced rows)."""
    sh = shapes.SHAPES["cpu-tiny"]
    x = shapes.make_inputs(sh, torch.device("cpu"), torch.float32, targets="least", logit_std=8.0)
    h, w = x.hidden.detach().view(-1, sh.H), x.weight.detach()
    assert torch.equal(x.token_ids.view(-1), (h @ w.T).argmin(1))
    assert torch.equal(shapes._chunked_argmin(h, w, 5), shapes._chunked_argmin(h, w, 64))
    assert (x.old_logprobs - x.ref_logprobs).abs().max() < 1.0 and x.old_logprobs.min() < -48


def test_time_limit_and_append(tmp_path):
    base = ["--device", "cpu", "--shapes", "cpu-tiny", "--providers", "naive_eager", "--out",
            str(tmp_path), "--no-check"]
    assert main(base + ["--reps", "1", "--warmup", "1"]) == 0
    assert main(base + ["--time-limit-s", "0"]) == 0
    rows = _rows(tmp_path)
    assert len(rows) == 6  # appended, not overwritten (floor, floor_valid, naive_eager per run)
    assert all(r["status"].startswith("skip: --time-limit-s") for r in rows[3:])
    assert rows[2]["loss_rel_err"] == "n/a"  # --no-check


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


def test_time_step_warms_up_by_time_too():
    """Timing.warmup_s: after the counted warm-up, untimed steps until that many seconds have
    passed (the GPU's sustained clock, measure.WARMUP_S); 0 adds none."""
    calls = []
    x = types.SimpleNamespace(hidden=torch.zeros(1), weight=torch.zeros(1))

    def step():
        calls.append(time.perf_counter())
        time.sleep(0.01)

    measure.time_step(step, x, torch.device("cpu"), measure.Timing(warmup=2, reps=3))
    assert len(calls) == 2 + 3
    calls.clear()
    measure.time_step(step, x, torch.device("cpu"), measure.Timing(warmup=2, reps=3, warmup_s=0.1))
    assert len(calls) >= 2 + 3 + 5 and calls[-4] - calls[0] >= 0.1


def test_gspo_providers_agree_with_the_reference(tmp_path):
    """--gspo end to end: the bench's own math (padded naive, TRL and Liger's fused linear
    cross-entropy on compacted tokens with per-sequence sums), Liger's GRPO loss with its own
    importance_sampling_level="sequence" (padded) and compiled_grpo (padded, and packed with
    max_seqlen) run and agree with cg.reference_grpo_loss as closely as their DAPO rows do; the
    providers that never sum per sequence are skipped, saying so."""
    args = ["--device", "cpu", "--shapes", "cpu-tiny", "cpu-tiny-packed", "--targets", "sampled", "--gspo",
            "--providers", "naive_eager", "liger", "trl_chunked", "liger_cute", "compiled_grpo_valid",
            "compiled_grpo", "--out", str(tmp_path), "--reps", "1", "--warmup", "1"]
    assert main(args) == 0
    by = {(r["shape"], r["provider"]): r for r in _rows(tmp_path)}
    assert all(r["is_level"] == "sequence" for r in by.values())
    for key in [("cpu-tiny", "naive_eager"), ("cpu-tiny", "liger"), ("cpu-tiny", "trl_chunked"),
                ("cpu-tiny", "liger_cute"), ("cpu-tiny", "compiled_grpo"),
                ("cpu-tiny-packed", "trl_chunked"), ("cpu-tiny-packed", "liger_cute"),
                ("cpu-tiny-packed", "compiled_grpo")]:
        assert by[key]["status"] == "ok", (key, by[key]["status"])
        assert float(by[key]["loss_rel_err"]) < 1e-2, (key, by[key]["loss_rel_err"])
        assert float(by[key]["dw_rel_err"]) < 5e-2, (key, by[key]["dw_rel_err"])
    assert by[("cpu-tiny", "compiled_grpo_valid")]["status"].startswith("skip: no per-sequence")
    assert by[("cpu-tiny-packed", "naive_eager")]["status"].startswith("skip: packed input as one")


def _gspo_off_policy():
    """(x, p, loss, dL/dhidden): cpu-tiny inputs in float64 with old log-probs 0.3 away (near
    on-policy the two ratio levels have the same first-order gradient, which would hide a
    token-level mistake), the bench's GSPO Params, and cg.grpo_loss's GSPO on them."""
    import compiled_grpo as cg
    from bench import dapo
    x = shapes.make_inputs(shapes.SHAPES["cpu-tiny"], torch.device("cpu"), torch.float64,
                           old_noise=0.3, targets="sampled")
    x = x._replace(old_logprobs=x.old_logprobs.double(), ref_logprobs=x.ref_logprobs.double(),
                   advantages=x.advantages.double(), mask=x.mask.double())
    p = dapo.Params(importance_sampling_level="sequence")
    cfg = cg.GRPOConfig(loss_type="dapo", beta=p.beta, importance_sampling_level="sequence",
                        log_ratio_clamp=None, gradient_mode="recompute")
    h = x.hidden.detach().requires_grad_()
    want = cg.grpo_loss(h, x.weight, x.token_ids, x.advantages, x.mask > 0, x.old_logprobs,
                        x.ref_logprobs, config=cfg).loss
    (gw,) = torch.autograd.grad(want, h)
    return x, p, want.detach(), gw


@pytest.mark.parametrize("compacted", [False, True])
def test_gspo_math_equals_compiled_grpo_in_float64(compacted):
    """The bench's GSPO math (dapo.py: padded rows, or compacted tokens with sequence ids as
    the TRL provider runs it) = cg.grpo_loss with importance_sampling_level="sequence" in
    float64, loss and gradients, off policy (old log-probs 0.3 away: near on-policy the two
    ratio levels have the same first-order gradient, which would hide a token-level mistake)."""
    from bench import dapo
    x, p, want, gw = _gspo_off_policy()
    h2 = x.hidden.detach().requires_grad_()
    if compacted:
        v = dapo.compact(x)
        logp = dapo.naive_logprobs(v.hidden(x._replace(hidden=h2)), x.weight, v.token_ids, p.temperature)
        got = dapo._valid_dapo(logp, v, p)
    else:
        got = dapo.naive_loss(h2, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs,
                              x.ref_logprobs, p)
    (gg,) = torch.autograd.grad(got, h2)
    # naive_logprobs takes log_softmax in fp32 (as RL code does): agreement to fp32, not fp64
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(gg, gw, rtol=1e-5, atol=1e-8)
    h3 = x.hidden.detach().requires_grad_()
    token = dapo.naive_loss(h3, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs,
                            x.ref_logprobs, dapo.Params())
    (gt,) = torch.autograd.grad(token, h3)
    assert (gt - gw).norm() > 1e-2 * gw.norm()   # the token-level ratio would fail the checks above


def test_liger_gspo_is_sequence_level_off_policy():
    """The `liger` provider with --gspo: Liger 0.8.5's LigerFusedLinearGRPOLoss with
    importance_sampling_level="sequence", as bench/peers.py builds it, = cg.grpo_loss's GSPO in
    float64 off policy (where a token-level ratio would differ: the guard of the test above),
    so its GSPO row times the same loss as ours."""
    from bench import dapo, peers
    pytest.importorskip("liger_kernel.chunked_loss")
    x, p, want, gw = _gspo_off_policy()
    x = x._replace(hidden=x.hidden.detach().requires_grad_())
    with peers._liger(x, p) as step:
        got = step()
    # Liger accumulates its loss and gradients in fp32: agreement to fp32, not fp64
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-9)
    assert (x.hidden.grad - gw).norm() < 1e-5 * gw.norm()
    x = x._replace(hidden=x.hidden.detach().requires_grad_())
    with peers._liger(x, dapo.Params()) as step:   # the token-level ratio
        step()
    assert (x.hidden.grad - gw).norm() > 1e-2 * gw.norm()


def test_dw_rounding_budget():
    """bench.dw_rounding's model: the exp-scaled operands' extra rounding (the scaled rows) is
    what makes their dW error larger than the recompute path's; with c X exact they match; each
    block's rounding adds error, the TMA reduce-add's two more than one."""
    from bench import dw_rounding
    errs = dw_rounding.error_budget(vocab=2048, hidden=128, rows=256, blocks=4)
    for rule in ("final", "once", "twice"):
        assert errs["exp-scaled", rule] > 1.05 * errs["recompute", rule]
        assert abs(errs["cX exact", rule] / errs["recompute", rule] - 1) < 0.05
    for ops in ("recompute", "exp-scaled", "cX exact"):
        assert errs[ops, "final"] < errs[ops, "once"] < errs[ops, "twice"] < 2e-2
    assert dw_rounding.main(["--vocab", "256", "--hidden", "32", "--rows", "16", "--blocks", "2"]) == 0


def test_paired_rounds_take_turns_abba():
    """measure.time_paired: every step once a round, the order reversed every other round, and
    the ratios taken round by round against the base step."""
    calls = []
    x = types.SimpleNamespace(hidden=types.SimpleNamespace(grad=None), weight=types.SimpleNamespace(grad=None))
    steps = {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c")}
    times = measure.time_paired(steps, x, torch.device("cpu"), rounds=4, warmup_s=0.0)
    assert calls == list("abc" "cba" "abc" "cba")
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    ratios = measure.paired_ratios({"base": [1.0, 2.0, 4.0], "x": [1.5, 2.0, 2.0]}, "base")
    assert ratios == {"base": 1.0, "x": 1.0}   # median of 1.5, 1.0, 0.5


def test_paired_run_adds_paired_columns(tmp_path):
    args = ["--device", "cpu", "--shapes", "cpu-tiny", "--providers", "naive_eager", "compiled_grpo",
            "--out", str(tmp_path), "--reps", "2", "--warmup", "1", "--paired", "3"]
    assert main(args) == 0
    rows = _rows(tmp_path)
    assert [r["provider"] for r in rows] == ["floor", "floor_valid", "naive_eager", "compiled_grpo"]
    by = {r["provider"]: r for r in rows}
    assert float(by["floor_valid"]["paired_ratio_valid"]) == 1.0
    assert all(float(r["paired_ms"]) > 0 and float(r["paired_ratio_valid"]) > 0 for r in rows)
    assert by["compiled_grpo"]["ratio_to_valid_floor"] not in ("", "n/a")


def test_row_group_probe_splits_a_step_at_each_gather(tmp_path, capsys, monkeypatch):
    """bench.probes.row_groups on a synthetic two-step trace: the last step's kernels summed per
    row group (a gather opens each), other kernels and the first step ignored."""
    import gzip
    import json
    from bench.probes import row_groups

    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    step = [("_gather_rows_kernel", 1), ("_fwd_kernel", 500), ("_gather_rows_kernel", 1),
            ("_fwd_kernel", 200), ("void at::native::elementwise", 5), ("_gather_rows_kernel", 1),
            ("_dlogits_kernel", 300), ("_dw_step_ws_kernel", 400), ("_dx_step_kernel", 100),
            ("_dlogits_kernel", 300), ("_dw_step_ws_kernel", 400), ("_dx_step_kernel", 150),
            ("_dx_split_reduce_kernel", 2)]
    events = [k(n, s * 100000 + i * 1000, d * (2 if s == 0 else 1))
              for s in range(2) for i, (n, d) in enumerate(step)]
    groups = row_groups.group_times(events + [{"ph": "X", "cat": "cpu_op", "name": "x"}], 2)
    want = [{"_fwd": 0.5}, {"_fwd": 0.2},
            {"_dlogits": 0.6, "_dw_step": 0.8, "_dx_step": 0.25, "_dx_split": 0.002}]
    assert [dict(g) for g in groups] == [{k: pytest.approx(v) for k, v in w.items()} for w in want]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    monkeypatch.setattr("sys.argv", ["row_groups", str(path), "--steps", "2"])
    row_groups.main()
    assert "group   2  dlogits   0.600  dw_step   0.800  dx_step   0.250  dx_split   0.002  ms" in capsys.readouterr().out
