"""GPU micro-benchmark of the row-masked path (cuda_rows.py) on a padded batch.

    python -m bench.kernels.rows [N] [H] [V] [--T=2048] [--compile] [--profile]
        [--sweep]    (GEMM-step tiles of the masked path only: per-kernel times, then exit)

A right-padded [B, T] batch (B = N / T, completion lengths ~ U[1, T]: ~50% valid, as the bench's
inputs), bf16. Prints, in one run on one GPU: the floor of the valid tokens (three cuBLAS GEMMs
of N_valid*H*V) and of all tokens; the op's fwd+bwd (with entropy) on all rows, with
`row_mask`, and on the valid rows compacted outside the op (host-known N_valid: the target
the masked path should match), eager and with --compile; peak memory beyond inputs and grads;
the masked result against the compacted one (logprobs, dX, dW: relative error); and a masked
fwd+bwd under torch.cuda.set_sync_debug_mode("error") (no host sync).
"""
import sys

import torch
import triton.testing

import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs import linear_logprobs


def bench(fn):
    return triton.testing.do_bench(fn, warmup=2, rep=2000, return_mode="median")


def floor_ms(n, h, v, x, w):
    dz = torch.randn(n, v, device="cuda", dtype=x.dtype)
    t = bench(lambda: x[:n] @ w.T) + bench(lambda: dz @ w) + bench(lambda: dz.T @ x[:n])
    del dz
    return t


SWEEP = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
         (128, 128, 64, 4, 4), (128, 256, 32, 8, 4)]


def sweep(fn):
    """Per-kernel CUDA times of one masked fwd+bwd for each GEMM-step tile config (both steps),
    then for dlogits workspaces of 16, 24 and 32 MiB (wall time and peak memory too)."""
    from lowerings.linear_logprobs.recompute import dense as cuda
    from lowerings.linear_logprobs.recompute import rows as cuda_rows
    base = tuning.GEMM_TILES[2]
    configs = [(t, cuda_rows.WS_BYTES) for t in SWEEP] + [(base, mib << 20) for mib in (24, 32)]
    for tiles, ws in configs:
        tuning.GEMM_TILES = {**tuning.GEMM_TILES, 2: tiles}
        tuning.DW_TILES = {**tuning.DW_TILES, 2: tiles}
        cuda_rows.WS_BYTES = ws
        try:
            fn()
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
        except Exception as e:  # out of shared memory etc.
            print(f"tiles {tiles}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        ms = {e.key: e.device_time_total / 1e3 for e in prof.key_averages()}
        wall = bench(fn)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        print(f"ws {ws >> 20} MiB, wall {wall:.2f} ms, peak beyond inputs {peak:.0f} MiB (grads "
              f"included), tiles {tiles}: dW step {ms.get('_dw_step_kernel', 0):.2f} ms, dX step "
              f"{ms.get('_dx_step_kernel', 0):.2f} ms, total {sum(ms.values()):.2f} ms", flush=True)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n, h, v = (int(a) for a in args) if args else (16384, 4096, 151936)
    t_len = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--T=")), 2048)
    torch.manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, h, device="cuda") * (2 / h ** 0.5)).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda")
    b = n // t_len
    lengths = torch.randint(1, t_len + 1, (b,), device="cuda")
    mask = (torch.arange(t_len, device="cuda")[None, :] < lengths[:, None]).reshape(-1)  # [N]
    n_valid = int(mask.sum())
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    xc, idc, glc, gec = x[mask].contiguous(), ids[mask], g_lp[mask], g_ent[mask]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} N={n} H={h} V={v} bf16, "
          f"N_valid={n_valid} ({n_valid / n:.1%})", flush=True)
    f_valid, f_all = floor_ms(n_valid, h, v, x, w), floor_ms(n, h, v, x, w)
    print(f"floor: valid tokens {f_valid:.2f} ms, all tokens {f_all:.2f} ms", flush=True)

    wg = w.clone().requires_grad_()

    def step(fn, xs, i, gl, ge, rm):
        xs = xs.detach().requires_grad_()
        wg.grad = None
        out = fn(xs, wg, i, rm)
        (out[0] * gl).sum().add((out[1] * ge).sum()).backward()
        return out[0].detach(), xs.grad, wg.grad

    def op(xs, ws, i, rm):
        o = linear_logprobs(xs, ws, i, with_entropy=True, row_mask=rm)
        return o.logprobs, o.entropy

    cases = {"all rows": (x, ids, g_lp, g_ent, None), "row_mask": (x, ids, g_lp, g_ent, mask),
             "compacted outside": (xc, idc, glc, gec, None)}
    if "--sweep" in sys.argv:
        sweep(lambda: step(op, x, ids, g_lp, g_ent, mask))
        return
    fns = {"eager": op}
    if "--compile" in sys.argv:
        fns["compiled"] = torch.compile(op, fullgraph=True)
    for mode, fn in fns.items():
        for name, (xs, i, gl, ge, rm) in cases.items():
            res = step(fn, xs, i, gl, ge, rm)
            t = bench(lambda: step(fn, xs, i, gl, ge, rm))
            wg.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(fn, xs, i, gl, ge, rm)
            torch.cuda.synchronize()
            grads = xs.numel() * 2 + w.numel() * 2   # dX, dW bf16
            extra = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
            print(f"{mode:8s} {name:18s} fwd+bwd {t:7.2f} ms  x valid floor {t / f_valid:.3f}  "
                  f"x all floor {t / f_all:.3f}  peak beyond grads {extra:.0f} MiB", flush=True)
            if name == "compacted outside":
                ref = res
            elif name == "row_mask":
                masked = res
        lp, dx, dw = masked
        rel = lambda a, r: float((a.float() - r.float()).norm() / r.float().norm())  # noqa: E731
        print(f"{mode}: row_mask vs compacted: logprobs {rel(lp[mask], ref[0]):.2e}, dX "
              f"{rel(dx[mask], ref[1]):.2e}, dW {rel(dw, ref[2]):.2e}, padded dX rows all 0: "
              f"{bool((dx[~mask] == 0).all())}, padded logprobs 0: {bool((lp[~mask] == 0).all())}",
              flush=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        step(fn, x, ids, g_lp, g_ent, mask)
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        print(f"{mode}: masked fwd+bwd ran under set_sync_debug_mode('error')", flush=True)
        if "--profile" in sys.argv:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(fn, x, ids, g_lp, g_ent, mask)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12,
                                            max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
