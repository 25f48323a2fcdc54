"""Timing, peak memory and agreement with the float32 reference, for one provider at one shape.

Legend: B sequences, T tokens, H hidden, V vocab, N = B*T.

Timing: CUDA events around each step (device time, host clock only on CPU), warm-up first (the
first call compiles; on CUDA then untimed steps until warmup_s have passed: the GPU's sustained
state, below), then a median over repetitions sized to take ~target_s. Memory: peak
allocated during one extra step minus what was allocated before it (the inputs, with grads
cleared), and that minus the bytes of dX and dW themselves. Agreement: relative error of loss,
dX, dW against a float32 reference computed once per shape.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
import traceback
from typing import Callable, Optional

import torch

from bench.dapo import Params, dapo_loss, naive_logprobs
from bench.providers import Provider
from bench.shapes import Shape, StepInputs

MiB = float(1 << 20)

# An H100 under GEMM load slows by ~4% in its first seconds as it heats (qwen3-8b valid floor:
# 32.6 ms in the first 2.5 s from idle, 33.8-33.9 ms from 5 s on; the fused step 36.1 cold,
# 36.8-37.6 hot; bench/results/thermal_drift_h100.txt). A provider timed from cold against a floor
# timed hot, or the other way round, gains or loses that much in its ratio; every provider, the
# floors too, therefore runs untimed for WARMUP_S seconds first and is timed at the sustained clock.
WARMUP_S = 5.0


@dataclasses.dataclass
class Timing:
    warmup: int = 2  # the first compiles, the second is steady state but is not timed either
    warmup_s: float = 0.0  # then untimed steps until this many seconds have passed (CUDA: WARMUP_S)
    reps: Optional[int] = None  # fixed count, or None: sized to target_s within [min, max]
    target_s: float = 1.0
    min_reps: int = 3
    max_reps: int = 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_busy(fn: Callable, seconds: float, device: torch.device) -> None:
    """fn, untimed, until `seconds` have passed: the GPU at its sustained clock (WARMUP_S). The
    calls are queued back to back as the timed ones are, the host at most two calls ahead (an
    event a call): a synchronize after each would idle the GPU for every call's host lead-in
    (~15 ms of a ~38 ms eager qwen3-8b step, a cooler GPU than in the timed loop), none at all
    would let a few-launch call such as the floor's queue seconds of work past `seconds`."""
    t0 = time.perf_counter()
    queued = []
    while time.perf_counter() - t0 < seconds:
        fn()
        if device.type == "cuda":
            queued.append(torch.cuda.Event())
            queued[-1].record()
            if len(queued) > 2:
                queued.pop(0).synchronize()
    sync(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    """OOM can come wrapped (Inductor's autotuning or compile errors chain the original)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def clear_grads(x: StepInputs) -> None:
    x.hidden.grad = None
    x.weight.grad = None


def time_step(step: Callable, x: StepInputs, device: torch.device, t: Timing) -> dict:
    t0 = time.perf_counter()
    clear_grads(x)
    step()
    sync(device)
    first_call_s = time.perf_counter() - t0  # includes torch.compile on the compiled providers
    for _ in range(t.warmup - 1):
        clear_grads(x)
        step()
    sync(device)
    keep_busy(lambda: (clear_grads(x), step()), t.warmup_s, device)   # the sustained clock
    reps = t.reps
    if reps is None:
        t0 = time.perf_counter()
        clear_grads(x)
        step()
        sync(device)
        est = time.perf_counter() - t0
        reps = max(t.min_reps, min(t.max_reps, math.ceil(t.target_s / max(est, 1e-6))))
    times = []
    extra = {}
    if device.type == "cuda":
        before = torch.cuda.memory_stats(device)
        events = []
        # one untimed step queued first: the timed ones then start behind GPU work, so the first
        # is not also timing the host's lead-in after the synchronize above (the eager prologue
        # and the first block's launches: a 44 ms first repetition against 36-39 ms, H200)
        clear_grads(x)
        step()
        for _ in range(reps):
            clear_grads(x)  # host-side; frees last step's grads so every step allocates its own
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            events.append((s, e))
        sync(device)
        times = [s.elapsed_time(e) for s, e in events]
        # cudaMalloc calls and allocator retries (both can stall the host on the GPU) while timed
        after = torch.cuda.memory_stats(device)
        extra = {k: after.get(k, 0) - before.get(k, 0)
                 for k in ("num_device_alloc", "num_alloc_retries")}
    else:
        for _ in range(reps):
            clear_grads(x)
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return dict(ms=statistics.median(times), ms_min=min(times), reps=reps, first_call_s=first_call_s,
                times_ms=times, **extra)


def time_paired(steps: dict[str, Callable], x: StepInputs, device: torch.device, rounds: int,
                warmup_s: float) -> dict[str, list[float]]:
    """ms of each step in each of `rounds` rounds: the steps take turns in one queue, the order
    reversed every other round (ABBA: no step always runs after the same one), after warmup_s
    seconds of the same rotation untimed. Two steps of one round run tens of ms apart, so their
    ratio is free of the slow drift that separate timed loops see (on an H100 every provider's
    repetitions climb ~5% within its own timed second), and the steps share one clock: under a
    power cap that clock is set by all of them, where alone a step that draws less power than
    cuBLAS's GEMMs clocks higher (bench/results/HISTORY.md, "paired"). Identical steps still
    differed by 1-4% this way on an H100 (paired_h100_ddc4c8c.txt): the neighbours' power draw
    reaches into a step. CUDA events (device time), the host clock on CPU."""
    names = list(steps)

    def one(name: str) -> None:
        clear_grads(x)
        steps[name]()

    keep_busy(lambda: [one(n) for n in names], warmup_s, device)
    marks: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            if device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                one(n)
                e.record()
                marks[n].append((s, e))
            else:
                t0 = time.perf_counter()
                one(n)
                marks[n].append((time.perf_counter() - t0) * 1e3)
    sync(device)
    clear_grads(x)
    if device.type != "cuda":
        return marks
    return {n: [s.elapsed_time(e) for s, e in m] for n, m in marks.items()}


def paired_ratios(times: dict[str, list[float]], base: str) -> dict[str, float]:
    """Each step's median over rounds of its time / base's time in the same round."""
    return {n: statistics.median(a / b for a, b in zip(t, times[base])) for n, t in times.items()}


def host_times(step: Callable, steps: int) -> tuple[float, float]:
    """(host ms a step, wall ms a step) of `steps` CUDA steps queued back to back after a
    synchronize: a step is host-bound where the first reaches the second (the probes'
    measure, bench.probes.launch_overhead / host_hotspots)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / steps * 1e3


def host_cprofile(step: Callable, steps: int):
    """cProfile of `steps` CUDA steps queued back to back: which Python functions a step's host
    time goes to (bench.kernels.fused --host-profile, the probes)."""
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    return prof


def host_op_table(step: Callable, steps: int) -> str:
    """torch.profiler's CPU ops of `steps` CUDA steps by self time, as a table."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)


def memory_step(step: Callable, x: StepInputs, device: torch.device) -> tuple[dict, Optional[torch.Tensor]]:
    """One more step, with the allocator's peak reset; its grads are the ones checked for accuracy."""
    clear_grads(x)
    free_memory(device)
    if device.type != "cuda":
        # No allocator statistics on CPU (RSS high-water marks cannot be reset): report n/a.
        return dict(peak_mem_beyond_inputs_mib=None, peak_mem_beyond_grads_mib=None), step()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    loss = step()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    # dX and dW in the parameters' dtype: the output every provider must produce anyway.
    grads = x.hidden.numel() * x.hidden.element_size() + x.weight.numel() * x.weight.element_size()
    return dict(peak_mem_beyond_inputs_mib=peak / MiB, peak_mem_beyond_grads_mib=(peak - grads) / MiB), loss


# ---- the float32 reference ---------------------------------------------------------------------

@dataclasses.dataclass
class Reference:
    name: str
    loss: float
    dx: torch.Tensor  # [B, T, H] fp32, on CPU so it does not take GPU memory from providers
    dw: torch.Tensor  # [V, H] fp32, on CPU


def _ref_compiled_grpo(x: StepInputs, p: Params) -> Reference:
    import compiled_grpo as cg
    from bench.providers import _cg_config
    h = x.hidden.detach().float().requires_grad_()
    w = x.weight.detach().float().requires_grad_()
    out = cg.reference_grpo_loss(h, w, x.token_ids, x.advantages, x.mask, x.old_logprobs,
                                 x.ref_logprobs, config=_cg_config(cg, p, softcap=x.softcap))
    out.loss.backward()
    return Reference("cg.reference_grpo_loss", out.loss.item(), h.grad.cpu(), w.grad.cpu())


def _ref_chunked_naive(x: StepInputs, p: Params, budget_bytes: int) -> Reference:
    """naive_loss in fp32, over chunks of sequences: the DAPO sum is separable per token, so
    loss = sum_chunks sum(loss_t * mask) / mask.sum(), and dX, dW accumulate exactly."""
    B, T, H = x.hidden.shape
    V = x.weight.shape[0]
    seqs = max(1, budget_bytes // (4 * 4 * T * V))  # ~4 live fp32 [T, V] tensors per sequence
    w = x.weight.detach().float().requires_grad_()
    dx = torch.empty(B, T, H, dtype=torch.float32)
    total = x.mask.sum().clamp(min=1.0)
    loss = 0.0
    for b in range(0, B, seqs):
        sl = slice(b, b + seqs)
        h = x.hidden[sl].detach().float().requires_grad_()
        logp = naive_logprobs(h, w, x.token_ids[sl], p.temperature, x.softcap)  # [seqs, T]
        part = dapo_loss(logp, x.old_logprobs[sl], x.ref_logprobs[sl], x.advantages[sl],
                         x.mask[sl], p) * x.mask[sl].sum().clamp(min=1.0) / total
        part.backward()
        loss += part.item()
        dx[sl] = h.grad.cpu()
        del h, logp, part
    return Reference("naive_fp32_chunked", loss, dx, w.grad.cpu())


def reference(x: StepInputs, p: Params, device: torch.device, log: Callable[[str], None]) -> Optional[Reference]:
    """cg.reference_grpo_loss where it fits (it holds several fp32 [N, V] tensors), else the
    chunked fp32 naive computation; None ("n/a") if neither fits."""
    N, V, H = x.token_ids.numel(), x.weight.shape[0], x.weight.shape[1]
    if device.type == "cuda":
        free_memory(device)
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = 8 << 30  # CPU shapes are tiny; keep big ones on the chunked path
    need = 5 * 4 * N * V + 4 * 4 * (N + V) * H  # fp32 logits, softmax, grads + fp32 copies and grads
    tries = []
    try:
        import compiled_grpo as cg
        if hasattr(cg, "reference_grpo_loss") and need < 0.8 * free:
            tries.append(lambda: _ref_compiled_grpo(x, p))
    except Exception:
        pass
    tries.append(lambda: _ref_chunked_naive(x, p, budget_bytes=int(min(0.25 * free, 16 << 30))))
    for fn in tries:
        try:
            return fn()
        except Exception as e:
            log(f"  reference failed ({'OOM' if is_oom(e) else type(e).__name__ + ': ' + str(e)[:200]})")
            if not is_oom(e):
                traceback.print_exc()
        finally:
            clear_grads(x)
            free_memory(device)
    return None


def pack_reference(ref: Optional[Reference], mask: torch.Tensor) -> Optional[Reference]:
    """The padded reference of the same sequences, for their packed twin: the DAPO loss and dW are
    the same, dX is the padded dX at the valid positions, in order."""
    if ref is None:
        return None
    keep = mask.reshape(-1).cpu() > 0
    return Reference(ref.name + " (padded twin)", ref.loss, ref.dx.reshape(-1, ref.dx.shape[-1])[keep], ref.dw)


def rel_err(x: Optional[torch.Tensor], ref: torch.Tensor) -> Optional[float]:
    """||x - ref|| / ||ref||, streamed in chunks of 2^24 so no fp32 copy of dW sits on the GPU."""
    if x is None:
        return None
    a, r = x.detach().reshape(-1), ref.reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=a.device)
    den = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, r.numel(), 1 << 24):
        rc = r[i:i + (1 << 24)].to(a.device).double()  # fp32 over PCIe, widened on the device
        num += (a[i:i + (1 << 24)].double() - rc).square().sum()
        den += rc.square().sum()
    return math.sqrt(num.item()) / max(math.sqrt(den.item()), 1e-300)


# ---- one provider at one shape -------------------------------------------------------------

def run_one(pr: Provider, shape: Shape, x: StepInputs, p: Params, device: torch.device,
            timing: Timing, ref: Optional[Reference], log: Callable[[str], None]) -> dict:
    row: dict = dict(provider=pr.name)
    why = pr.check(device) or pr.accepts(x) or (
        pr.sequence_level(x) if p.importance_sampling_level == "sequence" else None)
    if why is not None:
        row["status"] = f"skip: {why}"
        return row
    counters_before = _cg_counters()
    err = None
    note = ""
    try:
        with pr.build(x, p) as step:
            note = getattr(step, "note", "")
            row.update(time_step(step, x, device, timing))
            mem, loss = memory_step(step, x, device)
            row.update(mem)
            row["status"] = "ok"
            if loss is not None:
                row["loss"] = loss.float().item()
            if ref is not None:
                row["reference"] = ref.name
                if loss is not None:
                    row["loss_rel_err"] = abs(row["loss"] - ref.loss) / max(abs(ref.loss), 1e-30)
                row["dx_rel_err"] = rel_err(x.hidden.grad, ref.dx)
                row["dw_rel_err"] = rel_err(x.weight.grad, ref.dw)
    except Exception as e:
        if is_oom(e):
            row["status"] = "OOM"
        else:
            row["status"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            err = traceback.format_exc()
    # Outside the except block: the traceback (and the tensors its frames hold) is gone by now.
    clear_grads(x)
    free_memory(device)
    if err:
        log(err)
    moved = {k: v for k, v in _cg_counters().items() if v != counters_before.get(k, 0)}
    if moved:
        note = "; ".join(filter(None, [note, "counters: " + " ".join(
            f"{k}+{v - counters_before.get(k, 0)}" for k, v in moved.items())]))
    elif pr.pass_provider and row.get("status") == "ok":
        note = "; ".join(filter(None, [note, "pass did not fire (no compiled_grpo counter moved): naive graph ran"]))
    if note:
        row["note"] = note
    return row


def _cg_counters() -> dict[str, int]:
    """Flattened torch._dynamo counters whose category or key names compiled_grpo (STYLE item 9:
    passes count their replacements there), to show whether the pass fired."""
    from torch._dynamo.utils import counters
    out = {}
    for cat, d in counters.items():
        for k, v in d.items():
            if "compiled_grpo" in f"{cat}.{k}":
                out[f"{cat}.{k}"] = v
    return out
