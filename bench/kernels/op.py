"""GPU micro-benchmark of compiled_grpo::linear_logprobs (eager launch of the op).

    python -m bench.kernels.op [N] [H] [V] [--sweep] [--compile] [--tma=0,1] [--profile]
        [--sweep=bwd]

Prints, in one run on one GPU: the floor (three bf16 cuBLAS GEMMs of N*H*V: logits, dX, dW),
the op's forward and forward+backward (with and without entropy), their ratio to the floor,
and peak memory beyond inputs and gradients. --sweep also times other tile shapes and backward
chunk sizes and dX row-group budgets (module globals TILES / CHUNK_V / DX_GROUP_BYTES, read
at call time); --sweep=bwd only the last two. --tma=0,1 repeats the eager and
compiled measurements for each listed value of the module global TMA (0: pointer loads, 1: TMA
operand loads on sm_90+), against the one floor. --profile prints the CUDA kernels of one
eager (and, with --compile, one compiled) fwd+bwd with entropy, by total time.
"""
import sys

import torch
import triton.testing

import lowerings.linear_logprobs.tuning as tuning
import lowerings.linear_logprobs.recompute.dense as tk
from lowerings.linear_logprobs import linear_logprobs


def bench(fn, reps=10):
    return triton.testing.do_bench(fn, warmup=2, rep=reps * 200, return_mode="median")


def profile(tag, fn):
    """Kernel table of one call of fn (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- profile {tag}")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14,
                                    max_name_column_width=70), flush=True)


def kernel_stats():
    """Registers and spills of every compiled variant of the op's kernels (eager launches)."""
    for k in (tk._fwd_kernel, tk._dlogits_kernel):
        for cache in k.device_caches.values():
            for key, ck in cache[0].items():
                try:
                    ck._init_handles()
                    print(f"  {k.__name__}: {ck.n_regs} regs, {ck.n_spills} spills, "
                          f"{ck.metadata.num_warps} warps, {ck.metadata.shared} B smem")
                except Exception as e:  # attribute names differ across triton versions
                    print(f"  {k.__name__}: {type(e).__name__}: {e}")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n, h, v = (int(a) for a in args) if args else (16384, 4096, 151936)
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(n, h, device=dev, dtype=dt)
    w = (torch.randn(v, h, device=dev) * (2 / h ** 0.5)).to(dt)
    ids = torch.randint(0, v, (n,), device=dev)
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} N={n} H={h} V={v} bf16")

    dz = torch.randn(n, v, device=dev, dtype=dt)           # [N, V] stand-in dlogits, 5 GB
    tflop = 2 * n * h * v / 1e12
    t_fwd_gemm = bench(lambda: x @ w.T)
    t_dx = bench(lambda: dz @ w)
    t_dw = bench(lambda: dz.T @ x)
    floor = t_fwd_gemm + t_dx + t_dw
    print(f"floor: 3 GEMMs {floor:.2f} ms (logits {t_fwd_gemm:.2f}, dX {t_dx:.2f}, dW "
          f"{t_dw:.2f}); {3 * tflop / floor * 1e3:.0f} TFLOP/s")
    del dz

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd(ent):
        with torch.no_grad():
            linear_logprobs(x, w, ids, with_entropy=ent)

    def fwd_bwd(ent):
        xg.grad = wg.grad = None
        out = linear_logprobs(xg, wg, ids, with_entropy=ent)
        loss = (out.logprobs * g_lp).sum()
        if ent:
            loss = loss + (out.entropy * g_ent).sum()
        loss.backward()

    def report(tag):
        for ent in (False, True):
            tf = bench(lambda: fwd(ent))
            tfb = bench(lambda: fwd_bwd(ent))
            print(f"{tag} entropy={ent}: fwd {tf:.2f} ms ({tf / t_fwd_gemm:.3f}x logits GEMM), "
                  f"fwd+bwd {tfb:.2f} ms ({tfb / floor:.3f}x floor, "
                  f"{4 * tflop / tfb * 1e3:.0f} TFLOP/s counting 8NHV)", flush=True)

    modes = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--tma=")),
                 [tuning.TMA])
    if len(modes) > 1:   # the compile caches do not key on tuning.TMA (see there)
        torch._inductor.config.force_disable_caches = True
    for mode in modes:
        tuning.TMA = mode
        torch._dynamo.reset()
        report(f"tma={tuning.TMA} tiles={tuning.TILES} chunk={tuning.CHUNK_V}")
        # peak memory beyond inputs and gradients, fwd+bwd with entropy
        fwd_bwd(True)
        grads = xg.grad.numel() * 2 + wg.grad.numel() * 2
        xg.grad = wg.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(True)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - grads
        if "--profile" in sys.argv:
            profile(f"eager tma={tuning.TMA}", lambda: fwd_bwd(True))
            kernel_stats()
        print(f"tma={tuning.TMA} eager peak beyond inputs+grads: {extra / 2**20:.1f} MiB (N*V bf16 "
              f"would be {n * v * 2 / 2**20:.0f} MiB; "
              f"row groups "
              f"{tk._row_groups(n, h)}, dX group acc {tuning.DX_GROUP_BYTES / 2**20:.0f} MiB)", flush=True)

        if "--compile" in sys.argv:   # fullgraph compile of the same loss: Inductor sees kernels
            def loss_fn(x, w, ids, g_lp, g_ent):
                out = linear_logprobs(x, w, ids, with_entropy=True)
                return (out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()
            cfn = torch.compile(loss_fn, fullgraph=True)

            def c_fwd_bwd():
                xg.grad = wg.grad = None
                cfn(xg, wg, ids, g_lp, g_ent).backward()
            try:
                c_fwd_bwd()                                   # compile
            except Exception as e:  # report and go on to the next mode
                print(f"tma={tuning.TMA} compiled: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tc = bench(c_fwd_bwd)
            # peak of one call (do_bench's own 256 MB cache-flush buffer stays out of it)
            xg.grad = wg.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            c_fwd_bwd()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base - grads
            if "--profile" in sys.argv:
                profile(f"compiled tma={tuning.TMA}", c_fwd_bwd)
            print(f"tma={tuning.TMA} compiled entropy=True fwd+bwd {tc:.2f} ms ({tc / floor:.3f}x "
                  f"floor), peak beyond inputs+grads {extra / 2**20:.1f} MiB", flush=True)

    if "--sweep" in sys.argv or "--sweep=bwd" in sys.argv:
        base_tiles, base_chunk = tuning.TILES, tuning.CHUNK_V
        tile_sweep = [(128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (128, 256, 32, 8, 4)]
        for tiles in [] if "--sweep=bwd" in sys.argv else tile_sweep:
            tuning.TILES = tiles
            try:
                report(f"tiles={tiles} chunk={tuning.CHUNK_V}")
            except Exception as e:  # out of shared memory etc.
                print(f"tiles={tiles}: {type(e).__name__}: {str(e)[:120]}")
        tuning.TILES = base_tiles
        for group in () if "--sweep=bwd" in sys.argv else (8, 32):
            tuning.GROUP_N = group
            report(f"tiles={tuning.TILES} chunk={tuning.CHUNK_V} group={group}")
        tuning.GROUP_N = 16
        for chunk in (2048, 8192):
            tuning.CHUNK_V = chunk
            report(f"tiles={tuning.TILES} chunk={chunk}")
        tuning.CHUNK_V = base_chunk
        base_group = tuning.DX_GROUP_BYTES
        for mib in (16, 64):
            tuning.DX_GROUP_BYTES = mib << 20
            report(f"tiles={tuning.TILES} chunk={tuning.CHUNK_V} dx group {mib} MiB")
        tuning.DX_GROUP_BYTES = base_group


if __name__ == "__main__":
    main()
