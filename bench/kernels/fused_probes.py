"""The timing, clock and one-off probes of bench.kernels.fused: the timed loop (do_bench after
a warm-up at the sustained clock), nvidia-smi's clock and power while it runs, cuBLAS's GEMMs of
one block (--cublas, --counters), the host's time in Triton's launcher (--host-profile), and the
step replayed as a CUDA graph (--cuda-graph).
"""
import collections
import contextlib
import shutil
import statistics
import subprocess
import time

import torch
import triton.testing

from bench.measure import WARMUP_S, keep_busy

PROFILE_STEPS = 3   # the per-kernel times are a mean over this many steps


def bench(fn):
    return triton.testing.do_bench(fn, warmup=2, rep=1500, return_mode="median")


def heat(fn, seconds: float = WARMUP_S):
    """fn, untimed, until `seconds` have passed: the GPU at its sustained clock before the floor
    and the step are timed (an H100 is ~4% faster in its first seconds from idle:
    bench/results/thermal_drift_h100.txt; bench.measure.keep_busy: queued back to back)."""
    keep_busy(fn, seconds, torch.device("cuda"))


@contextlib.contextmanager
def clocks(out: dict):
    """nvidia-smi samples the GPU's SM clock and board power every 50 ms while the block runs;
    out gets their medians (MHz, W), nothing where nvidia-smi is missing. Whether a timed loop
    is slower than another because the power cap clocks the GPU lower while it runs."""
    if shutil.which("nvidia-smi") is None:
        yield
        return
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    proc = subprocess.Popen(["nvidia-smi", "-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
                             "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                             "-lms", "50"], stdout=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        proc.terminate()
        rows = [line.split(",") for line in proc.communicate()[0].splitlines()]
        rows = [r for r in rows if len(r) == 2 and all(v.strip().replace(".", "").isdigit() for v in r)]
        if rows:
            out["mhz"] = statistics.median(float(r[0]) for r in rows)
            out["watts"] = statistics.median(float(r[1]) for r in rows)


def clock_note(c: dict) -> str:
    return f", SM clock {c['mhz']:.0f} MHz at {c['watts']:.0f} W (medians)" if c else ""


def block_gemms(xv: torch.Tensor, w: torch.Tensor, rows: int) -> tuple:
    """cuBLAS's three GEMMs of one block of `rows` valid rows (xv's first), as callables: logits,
    dX, and dW with beta = 1 (as the fused dW step adds a block into dW). The rate the block
    schedule allows cuBLAS (--cublas, --counters)."""
    xb = xv[:rows].contiguous()                                                 # [R, H]
    zb = torch.randn(rows, w.shape[0], device=xv.device, dtype=w.dtype)         # [R, V]
    dwb = torch.zeros_like(w)                                                   # [V, H]
    return (lambda: xb @ w.T, lambda: zb @ w, lambda: dwb.addmm_(zb.T, xb))


def launch_cost(step):
    """The host's time in Triton's launcher (JITFunction.run: argument binding, specialization,
    the cache key, the launch) per kernel, over PROFILE_STEPS steps each started after a
    synchronize, against the step's whole host time."""
    from triton.runtime.jit import JITFunction
    spent, calls = collections.Counter(), collections.Counter()
    real = JITFunction.run

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            spent[self.fn.__name__] += time.perf_counter() - t0
            calls[self.fn.__name__] += 1

    host = 0.0
    JITFunction.run = timed
    try:
        for _ in range(PROFILE_STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            host += time.perf_counter() - t0
    finally:
        JITFunction.run = real
    torch.cuda.synchronize()
    print(f"    Triton's launcher: {sum(spent.values()) / PROFILE_STEPS * 1e3:.2f} ms of "
          f"{host / PROFILE_STEPS * 1e3:.2f} ms host time a step")
    for name, t in spent.most_common():
        print(f"      {name:32s} {calls[name] / PROFILE_STEPS:5.1f} a step, "
              f"{t / calls[name] * 1e6:6.1f} us each")


def graph_step(step, hidden, weight, floor):
    """The step (forward and backward) captured once as a CUDA graph and replayed: no host
    launch cost (what a host-bound small policy gains), the gradients written in place. The
    replay's gradients are compared with an eager step's (bitwise: the path is deterministic)."""
    step()
    torch.cuda.synchronize()
    eager = (hidden.grad.clone(), weight.grad.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    hidden.grad = weight.grad = None
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(hidden.grad, eager[0]) and torch.equal(weight.grad, eager[1])
    ms = bench(graph.replay)
    print(f"cuda graph replay: {ms:.2f} ms = {ms / floor:.3f}x valid floor; gradients "
          f"{'bitwise equal to' if same else 'DIFFERENT from'} an eager step's")
