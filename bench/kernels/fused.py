"""GPU profile of grpo_loss's fused-gradient path (fused.py, fused_cuda.py) on the bench's inputs.

    python -m bench.kernels.fused [--shape qwen3-8b] [--all-valid]
        [--sweep [{all,fwd,dlogits,dw,dx,rows}]] [--compile [MODE]] [--recompute] [--cublas]
        [--workspace-mib MIB ...] [--trace DIR] [--host-profile]
        [--targets {random,sampled,least}] [--logit-std S] [--cuda-graph] [--clocks] [--gspo]
        [--counters [R ...]] [--precisions {dlogits,round} ...]

Prints the fwd+bwd median (eager), the valid-token floor (three cuBLAS GEMMs of N_valid*H*V) in
the same run (each timed after 5 s of it untimed: the GPU's sustained clock,
bench.measure.WARMUP_S), peak memory beyond inputs and grads, the CUDA time of each kernel
family of one step (torch.profiler) with their total, the timed step's time beyond it, the
GPU's idle time between a step's kernels (right after a synchronize, and queued), and the
host's time to launch one step (a step is host-bound where that exceeds the step). The profiled kernels run
right after a synchronize, at a higher clock than the power-capped timed loop, so their total
can exceed the timed step. --trace DIR: the profiled steps' chrome trace (DIR/<tag>.json.gz):
where the GPU waits. --all-valid: every position valid (the all-positions target). --compile [MODE]:
the loss under torch.compile(fullgraph=True, mode=MODE) (what the loss's own kernels add
there; "reduce-overhead": Inductor's CUDA graphs). --sweep:
the same for variants of one step or all (fwd: a 4-stage tile; dlogits tiles; dw: the
load-add-store epilogue, tiles, the Gluon step's two tile shapes; dx: DX_SPLITS=1, tiles; rows
(named only): the recompute path without fast_launch, without the dX step's bulk reduce-add,
at other plan budgets), then
the default again (the drift of the GPU's clock over the sweep). The tiles and switches are module
attributes of the plan (cuda.py, fused_cuda.py), which the sweep patches.
--recompute: the same profile of gradient_mode="recompute" (its _fwd_kernel stores no logits:
the forward's cost of keeping them). --cublas: what cuBLAS takes for one full block's three
GEMMs (logits, dX, dW with beta = 1 as the fused dW step accumulates), scaled to the valid rows:
the mark the Triton steps are held to. --workspace-mib: the default step again with each
GRPOConfig.fused_workspace_mib (larger row blocks: fewer dW read-modify-writes and longer GEMMs,
for more memory; the speed / memory trade-off of the 768 MiB bound). --host-profile: cProfile of
the host's side of a few steps (what the launch time is spent on, where a step is host-bound:
small H, many blocks), then the time in Triton's launcher per kernel. --targets /
--logit-std: bench.shapes.make_inputs' (default random, 3.0);
`--targets least --logit-std 8` puts every target below logp -48, the exp-scaled backward's
worst case (each row re-referenced by the combine kernel, fused_cuda.E_HEADROOM); the logprobs'
largest error against an fp32 reference is printed with it. --cuda-graph: the step captured as
a CUDA graph and replayed (torch.cuda.graph; the host's launch cost gone), its time and whether
its gradients equal an eager step's. --clocks: the median SM clock and board power (nvidia-smi,
every 50 ms) while the floor's GEMMs and the step are timed: a step that runs at a lower clock
than the floor under the same power cap loses to it on energy, not on its kernels' schedule.
--counters [R ...]: for Nsight Compute (`ncu --profile-from-start off --clock-control none
... bench.kernels.fused --counters 2048 271`): the step twice to compile and warm it, then, between
cudaProfilerStart and Stop, one step, the valid floor's three cuBLAS GEMMs and cuBLAS's three
GEMMs of one block of each R valid rows (block_gemms, as --cublas), and nothing timed: ncu
replays each kernel alone at its own clock, so its counters (cycles, DRAM and L2 bytes, tensor
pipe) compare our kernels with cuBLAS's on the same rows (bench/results/ncu_h100_7a873e1.txt).
--gspo: GSPO (loss_type "grpo", sequence-level importance sampling) instead of DAPO: whole
sequences next-fit into the row blocks by their valid tokens (fused_order.pack_sequences; a
packed shape, e.g. qwen3-8b-packed, passes cu_seqlens and max_seqlen = the shape's T).
Packed shapes pass cu_seqlens with either loss. --precisions: the default step again with
GRPOConfig.fused_scaled_backward=False ("dlogits": the logits gradient formed in place, as
round_logits needs) and round_logits=True ("round": the drop-in's precision under bf16), each
profiled as the default: what round_logits costs and where.
"""
import argparse
import collections
import contextlib
import dataclasses
import time

import torch

import compiled_grpo as cg
from bench.kernels.fused_probes import (PROFILE_STEPS, bench, block_gemms, clock_note, clocks,
                                        graph_step, heat, launch_cost)
from bench.shapes import SHAPES, TARGETS, _chunked_logprobs, make_inputs
from compiled_grpo import fused as cg_fused
import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs.recompute import dense
from lowerings.linear_logprobs.recompute import rows as cuda_rows
from lowerings.linear_logprobs.launching import fast as fast_launch
from lowerings.linear_logprobs.recompute import dw_steps
from lowerings.linear_logprobs.fused import blocks as fused_cuda


TOP = 16            # kernel families listed one by one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--all-valid", action="store_true")
    ap.add_argument("--sweep", nargs="?", const="all",
                    choices=["all", "fwd", "dlogits", "dw", "dx", "rows"])
    ap.add_argument("--compile", nargs="?", const="default", metavar="MODE")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--cublas", action="store_true")
    ap.add_argument("--workspace-mib", type=float, nargs="+", default=[])
    ap.add_argument("--trace", metavar="DIR", help="write the profiled steps' chrome trace there")
    ap.add_argument("--host-profile", action="store_true")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--targets", default="random", choices=TARGETS)
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--clocks", action="store_true",
                    help="the SM clock and power (nvidia-smi) while the floor and the step are timed")
    ap.add_argument("--counters", type=int, nargs="*", metavar="R",
                    help="one step and cuBLAS's GEMMs between cudaProfilerStart / Stop, for ncu")
    ap.add_argument("--gspo", action="store_true",
                    help="GSPO (sequence-level importance sampling): whole-sequence row blocks")
    ap.add_argument("--precisions", nargs="+", default=[], choices=["dlogits", "round"],
                    help="the step again with the logits gradient formed (dlogits) / rounded logits")
    args = ap.parse_args()
    x = make_inputs(SHAPES[args.shape], torch.device("cuda"), targets=args.targets,
                    logit_std=args.logit_std)
    mask = torch.ones_like(x.mask) if args.all_valid else x.mask
    n_valid = int(mask.sum())
    h2 = x.hidden.detach().reshape(-1, x.hidden.shape[-1])
    w = x.weight.detach()
    rows = torch.nonzero(mask.reshape(-1))[:, 0]
    xv = h2[rows]
    dz = torch.randn(n_valid, w.shape[0], device="cuda", dtype=w.dtype)
    floor_gemms = (lambda: xv @ w.T, lambda: dz @ w, lambda: dz.T @ xv)
    if args.counters is None:
        floor_clock = {}
        heat(lambda: [f() for f in floor_gemms])
        with clocks(floor_clock) if args.clocks else contextlib.nullcontext():
            floor = sum(bench(f) for f in floor_gemms)
        if args.clocks:
            print(f"valid floor {floor:.2f} ms{clock_note(floor_clock)}")
        del dz, floor_gemms
    if args.cublas:
        rows = cg_fused._budget_rows(h2, w, cg.GRPOConfig())
        per = [bench(f) for f in block_gemms(xv, w, rows)]
        scale = n_valid / rows
        print(f"cuBLAS, one {rows}-row block x {scale:.2f} blocks: logits {per[0] * scale:.2f}, "
              f"dX {per[1] * scale:.2f}, dW (beta=1) {per[2] * scale:.2f} ms; "
              f"sum {sum(per) * scale:.2f} = {sum(per) * scale / floor:.3f}x valid floor")
    cfg = cg.GRPOConfig(loss_type="grpo" if args.gspo else "dapo", beta=0.04,
                        importance_sampling_level="sequence" if args.gspo else "token",
                        gradient_mode="recompute" if args.recompute else "auto")
    # packed shapes: cu_seqlens, and the padded twin's T as the bound whole-sequence blocks need
    packed = dict(cu_seqlens=x.cu_seqlens, max_seqlen=SHAPES[args.shape].T) if x.packed else {}
    hidden = x.hidden.detach().requires_grad_()
    weight = x.weight.detach().requires_grad_()

    def loss_fn(hidden, weight):
        return cg.grpo_loss(hidden, weight, x.token_ids, x.advantages, mask, x.old_logprobs,
                            x.ref_logprobs, config=cfg, **packed).loss

    fn = torch.compile(loss_fn, fullgraph=True, mode=args.compile) if args.compile else loss_fn

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight).backward()

    if args.counters is not None:
        gemms = floor_gemms + tuple(f for r in args.counters for f in block_gemms(xv, w, r))
        for _ in range(2):   # compiled and warm: ncu sees one steady step
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        for f in gemms:
            f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{args.shape}: N_valid = {n_valid}, profiled one step, the floor's 3 GEMMs and "
              f"cuBLAS's for blocks of {args.counters} rows")
        return

    def measure(tag):
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        step_clock = {}
        heat(step)
        with clocks(step_clock) if args.clocks else contextlib.nullcontext():
            ms = bench(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                step()
            torch.cuda.synchronize()
        fam, calls = collections.Counter(), collections.Counter()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.key.split("(")[0][:48]
                fam[name] += e.device_time_total / 1e3 / PROFILE_STEPS
                calls[name] += e.count / PROFILE_STEPS
        busy = sum(fam.values())
        # idle GPU time between one step's kernels: the first step starts after a synchronize
        # (the host's prologue shows), the later ones are queued behind it (the steady state)
        kernels = sorted((e.time_range for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda k: k.start)
        per = len(kernels) // PROFILE_STEPS
        idle = [sum(max(0, b.start - a.end) for a, b in zip(kernels[i * per:(i + 1) * per],
                                                           kernels[i * per + 1:(i + 1) * per]))
                / 1e3 for i in range(PROFILE_STEPS)]
        print(f"{tag}: {ms:.2f} ms = {ms / floor:.3f}x valid floor ({floor:.2f} ms, "
              f"N_valid={n_valid}), peak beyond grads {peak:.0f} MiB{clock_note(step_clock)}")
        print(f"    kernels {busy:.2f} ms in {sum(calls.values()):.0f} launches a step (profiled); "
              f"the timed step minus that: {ms - busy:+.2f} ms")
        print(f"    GPU idle between a step's kernels: {idle[0]:.2f} ms in the first profiled step "
              f"(after a synchronize), {sum(idle[1:]) / (PROFILE_STEPS - 1):.2f} ms in the later "
              f"ones (queued back to back)")
        for name, t in fam.most_common(TOP):
            print(f"    {t:8.2f} ms  {calls[name]:4.0f}x  {name}")
        rest = fam.most_common()[TOP:]
        if rest:
            print(f"    {sum(t for _, t in rest):8.2f} ms  {sum(calls[k] for k, _ in rest):4.0f}x  "
                  f"{len(rest)} other kernel families")
        if args.trace:   # the profiled steps' timeline (chrome trace): where the GPU waits
            prof.export_chrome_trace(f"{args.trace}/{tag.replace(' ', '_')[:40]}.json.gz")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()                      # the host's time to launch one step (no sync inside)
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        print(f"    host: {host:.2f} ms to launch one step (CPU-bound where that exceeds the step)")

    measure(cfg.gradient_mode + (" gspo" if args.gspo else "")
            + (f" compiled ({args.compile})" if args.compile else ""))
    with torch.no_grad():   # the step's logprobs against fp32 ones (chunked, 1 GiB tiles)
        rows = torch.nonzero(mask.reshape(-1))[:, 0]
        lp = cg.grpo_loss(hidden, weight, x.token_ids, x.advantages, mask, x.old_logprobs,
                          x.ref_logprobs, config=cfg, **packed).logprobs.reshape(-1)[rows]
        ref = _chunked_logprobs(h2.float(), w.float(), x.token_ids.reshape(-1),   # fp32 logits
                                (1 << 28) // (4 * w.shape[0]))[rows]
        print(f"    logprobs ({args.targets} targets, logit std {args.logit_std:g}): "
              f"min {ref.min().item():.1f}, {int((ref < -48).sum())} of {n_valid} below -48; "
              f"max |error| {(lp - ref).abs().max().item():.2e}")
    if args.host_profile:
        import pstats

        from bench.measure import host_cprofile, host_op_table
        torch.cuda.synchronize()
        prof = host_cprofile(step, PROFILE_STEPS)
        print(f"    host profile of {PROFILE_STEPS} steps (cProfile), this project's functions:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats("compiled_grpo|linear_logprobs", 30)
        print(host_op_table(step, PROFILE_STEPS))
        launch_cost(step)
    if args.cuda_graph:
        graph_step(step, hidden, weight, floor)
    default_cfg = cfg
    for mib in args.workspace_mib:
        cfg = dataclasses.replace(default_cfg, fused_workspace_mib=mib)   # loss_fn reads cfg
        rows = cg_fused._budget_rows(h2, w, cfg)
        measure(f"fused_workspace_mib={mib:g} (budget {rows} rows)")
    for name, change in (("dlogits", dict(fused_scaled_backward=False)),
                         ("round", dict(round_logits=True))):
        if name in args.precisions:
            cfg = dataclasses.replace(default_cfg, **change)
            measure(f"{name}: " + ", ".join(f"{k}={v}" for k, v in change.items()))
    cfg = default_cfg
    if args.sweep:
        def variant(mod, name, value, tag):
            old = getattr(mod, name)
            setattr(mod, name, value)
            try:
                measure(tag)
            except Exception as e:   # a tile the GPU cannot take: say so, go on
                print(f"{tag}: {type(e).__name__}: {str(e)[:200]}")
            finally:
                setattr(mod, name, old)

        want = lambda part: args.sweep in ("all", part)  # noqa: E731
        if want("fwd"):
            # Two-programs-a-SM tiles, (128, 128, 64, 4 or 8, 3 or 4), measured 16.4-18.7 ms
            # for the forward against 12.7-13.4 (H100, bench_fused_h100_log.txt): not swept.
            variant(tuning, "TILES", (128, 256, 64, 8, 4), "TILES=(128, 256, 64, 8, 4)")
            # At small H (K loops of 14-16 steps) 256-row tiles (256, 128, 64, 8, 3) ran the
            # forward 5.29 / 6.16 ms against 4.42-5.23 / 6.03-6.10 (qwen2.5-0.5b / qwen3-0.6b),
            # (128, 256, 32, 8, 4) 5.13 / 6.63 (H200, fwd_tiles_small_h200.txt): not swept.
            # BLOCK_K = 128 in two 96 KiB stages ran the forward 7.6 against 6.1-6.4 ms at
            # qwen3-0.6b, 16.9 against 11.9-12.6 at qwen3-8b (H100, epilogue_instructions_
            # 0997970.txt section 5): not swept. Two programs a SM at small H, (128, 128, 64, 4,
            # 3) (104 KiB, 255 registers: both fit), ran the forward 6.82 against 5.91-6.11 ms at
            # qwen3-0.6b and 4.91 against 4.30-4.76 at qwen2.5-0.5b (H100, the same file): not swept.
        if want("dw") or args.sweep == "rows":
            # the Triton dW step where the Gluon one runs (both paths since 54fe03a: A/B of it)
            variant(dw_steps, "DW_WS", False, "dw_steps.DW_WS=False")
        if want("dw"):
            variant(tuning, "DW_TMA_OUT", not tuning.DW_TMA_OUT, f"DW_TMA_OUT={not tuning.DW_TMA_OUT}")
        for tile in [(64, 256, 8), (16, 256, 4), (32, 256, 4)] * want("dlogits"):
            variant(fused_cuda, "DLOGITS_TILE", tile, f"DLOGITS_TILE={tile}")
        for tiles in [(128, 256, 64, 8, 4), (128, 256, 128, 8, 2), (256, 128, 64, 8, 3),
                      (128, 128, 64, 4, 3)] * want("dw"):
            variant(tuning, "DW_TILES", {**tuning.DW_TILES, 2: tiles},
                    f"DW_TILES[bf16]={tiles}")
        for tiles in [dw_steps.DW_WS_TILES, dw_steps.DW_WS_TILES_NARROW] * want("dw"):
            # the Gluon dW step's two tile shapes, whatever H picks (dw_steps.dw_ws_tiles)
            variant(dw_steps, "dw_ws_tiles", lambda h, t=tiles: t, f"dw_ws_tiles -> {tiles}")
        if want("dx"):
            variant(fused_cuda, "DX_SPLITS", 1, "DX_SPLITS=1")
        if args.sweep == "rows":   # the recompute path: its launches, its plan's budget
            variant(fast_launch, "ENABLED", False, "fast_launch.ENABLED=False")
            variant(cuda_rows, "DX_ACC_TMA", False, "cuda_rows.DX_ACC_TMA=False")
            for mib in (48, 72):
                variant(cuda_rows, "ROWS_BYTES", mib << 20, f"cuda_rows.ROWS_BYTES={mib} MiB")
        for tiles in [(128, 256, 64, 8, 4), (128, 128, 64, 4, 3)] * want("dx"):
            variant(tuning, "GEMM_TILES", {**tuning.GEMM_TILES, 2: tiles},
                    f"GEMM_TILES[bf16]={tiles}")
        measure("default again (drift over the sweep)")


if __name__ == "__main__":
    main()
