"""The fused path's Triton kernels compiled in worker processes while torch.compile traces.

Why. The fused block steps are opaque custom ops that launch their Triton kernels themselves
(fused/schedule.py), so Inductor never sees those kernels: each was compiled at its first launch, one
after another, inside the compiled step's first call, with its launcher (a C module a
signature, built with gcc). On one H100 that was 9.4 s of the end-to-end step's first call
(47.3 s against TRL's 38.7 s; bench/results/e2e_first_call_h100_410cb80.txt), while Dynamo and
Inductor took the same time for both.

How. The steps' fake implementations (fused/schedule.py; and launching/traced.py's triton_launch for the recompute
path), which the trace calls anyway, run each step's CUDA host code inside `capture()`, where a
launch of a `capturable` kernel is not run: Triton's binder specializes its arguments as the
real launch will (dtypes, 16-byte alignment read from the tensors' storage offsets, ints equal
to 1 or divisible by 16, the constexprs), and Triton's `jit_cache_hook` hands over that
specialization, serialized, instead of compiling it. New specializations go to at most WORKERS
worker processes (precompile_worker.py: triton alone, no GPU), which compile them and build
their launchers into CACHE_DIR while Dynamo and Inductor compile the rest. Before the first
real launch of a step, `wait` adopts each: Triton's own compile of the specialization
(`JITFunction.preload`) finds it in CACHE_DIR, and the kernel goes into the kernel's in-process
cache with its launcher, where the launch finds it (H100: 38.5 s to the first result).

The workers never change what runs: the parent compiles every kernel it launches from the same
source and only finds the result cached; a specialization the capture missed (a tensor whose
storage is not 16-byte aligned, say) compiles at its launch, as without workers. An eager call
(nothing traced) captures one block's launches before its first block (fused/blocks.py
precompile_eager) and waits for the workers at once: they compile in parallel, not one after
another.
"""
import contextlib
import contextvars
import functools
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import triton
from torch import Tensor
from triton.runtime.jit import MockTensor

from lowerings.linear_logprobs.launching import fast as _fast
from lowerings.linear_logprobs.device import size_hint
from lowerings.linear_logprobs.launching.triton_compat import INTERNALS_OK

log = logging.getLogger(__name__)

# worker processes a batch of new specializations, at most (and no more than this process's CPUs
# shared among torchrun's LOCAL_WORLD_SIZE ranks); 0: none (every kernel compiles at its first
# launch, in this process), as on a Triton whose cache hook and preload were not checked
# (triton_compat.INTERNALS_OK)
WORKERS = 8 if INTERNALS_OK else 0
WAIT_S = 120.0       # the most the first real launch waits for the workers
# Where the workers put what they compile: Triton's cache directory as this module found it at
# import. Not the one current when a trace starts them: Inductor points TRITON_CACHE_DIR at a
# temporary directory while it compiles (torch._inductor.utils.fresh_cache), and the parent's
# launches look in the usual one, so the workers' kernels were found only now and then.
CACHE_DIR = triton.knobs.cache.dir
# The checkout (or site-packages) root holding lowerings/: the workers import kernels/ from it.
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "precompile_worker.py")

# the launches captured in this context: a list of (module, qualname, specialization JSON)
_captured: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar(
    "compiled_grpo_precompile_captured", default=None)
_sent: set[tuple[str, str, str]] = set()     # specializations handed to workers already
_pending: list = []      # (worker, its stderr file, its specializations), not yet adopted


class capturable:
    """`capturable(kernel)[grid](*args, **kwargs)` launches `kernel` as `kernel[grid]` would
    (through fast_launch: its compiled launcher after a key's first launch); inside `capture()`
    it records the launch's specialization instead (nothing runs)."""

    __slots__ = ("kernel", "launcher")

    def __init__(self, kernel):
        self.kernel = kernel
        self.launcher = _fast.launcher(kernel)

    def __getitem__(self, grid):
        if _captured.get() is None:
            return self.launcher[grid]
        return functools.partial(_capture_launch, self.kernel)


class _StandIn(MockTensor):
    """A tensor at a captured launch: what Triton's binder reads of it, its dtype and its
    address modulo 16 (the storage's base is the CUDA allocator's, 512-byte aligned)."""

    def __init__(self, t: Tensor):
        super().__init__(t.dtype)
        self.offset = size_hint(t.storage_offset()) * t.element_size() % 16

    def data_ptr(self):
        return self.offset


def _stand_in(a):
    if isinstance(a, Tensor):
        return _StandIn(a)
    if isinstance(a, (torch.SymInt, torch.SymBool)):
        return size_hint(a)
    if isinstance(a, torch.SymFloat):
        return a.node.hint
    return a


def _capture_launch(kernel, *args, **kwargs) -> None:
    # warmup: specialize and look the kernel up, compile on a miss (our hook: record instead),
    # never launch
    kernel.warmup(*map(_stand_in, args), grid=(1,),
                  **{k: _stand_in(v) for k, v in _fast.pinned(kwargs).items()})


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, _prev=None):
    found = _captured.get()
    if found is None:   # a compile outside capture(): Triton's, or the hook installed before ours
        return None if _prev is None else _prev(key=key, repr=repr, fn=fn, compile=compile,
                                                is_manual_warmup=is_manual_warmup,
                                                already_compiled=already_compiled)
    found.append((fn.module, fn.name, compile["specialization_data"]))
    return True   # do not compile (and, as a warmup, do not launch)


def _install_hook() -> None:
    rt = triton.knobs.runtime
    current = rt.jit_cache_hook
    if getattr(current, "func", None) is not _hook:
        rt.jit_cache_hook = functools.partial(_hook, _prev=current)


@contextlib.contextmanager
def capture():
    """Within: launches of `capturable` kernels are recorded, not run; yields the record list."""
    _install_hook()
    found: list = []
    token = _captured.set(found)
    try:
        yield found
    finally:
        _captured.reset(token)


def precompile(host_code, *args, **kwargs) -> int:
    """Run `host_code(*args, **kwargs)` (a step's launches, on fake or real tensors) capturing
    its launches, and hand the specializations not yet handed over to worker processes. Returns
    how many it handed over. Never raises: a capture that fails leaves the kernels to compile
    at their first launch."""
    if WORKERS <= 0:
        return 0
    try:
        with capture() as found:
            host_code(*args, **kwargs)
        new = [f for f in dict.fromkeys(found) if f not in _sent]
        if new:
            _start(new)
            _sent.update(new)
        return len(new)
    except Exception:   # an optimization only: the launch compiles what the capture missed
        log.debug("capturing %s's launches failed", host_code, exc_info=True)
        return 0


def _ptxas_version(target) -> Optional[str]:
    """The ptxas version in this process's Triton cache keys (CUDA targets), fixed now.

    Triton keys a compile by the ptxas version it reads once a process (get_ptxas_version is
    lru-cached) from TRITON_PTXAS_PATH, else its bundled ptxas. Inductor sets that variable to
    torch's own ptxas (torch/bin/ptxas; CUDA 13.0 against Triton 3.6's 12.8 on the GPU machines)
    just before its first in-process Triton compile, which happens in some runs (its compile
    pool not ready yet) and not in others. A worker started before that read the bundled
    ptxas, the parent read torch's: every adoption missed and the parent compiled all nine
    kernels again, ~6 s of the end-to-end first call in 3 of 4 runs (one H100, bench/results/
    compile_blocks_h100.txt). So the parent takes Inductor's choice now, before its workers
    start, fixes its own version by reading it, and hands that version to the workers, which
    key their compiles by it (and compile with the same ptxas, TRITON_PTXAS_PATH inherited)."""
    if target.backend != "cuda":
        return None
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
        _set_triton_ptxas_path()   # as Inductor would before its first in-process compile
    except (ImportError, AttributeError):   # another torch: its own choice, read below
        pass
    from triton.backends.nvidia.compiler import get_ptxas_version
    return get_ptxas_version(target.arch)


def _start(specs: list) -> None:
    target = triton.runtime.driver.active.get_current_target()
    job = {"target": [target.backend, target.arch, target.warp_size], "cache_dir": CACHE_DIR,
           "root": _ROOT,
           "ptxas_version": _ptxas_version(target)}
    n = min(WORKERS, len(specs), _cpus_per_rank())
    for i in range(n):
        part = specs[i::n]
        err = tempfile.TemporaryFile()   # a file, not a pipe: a worker never blocks writing
        p = subprocess.Popen([sys.executable, _WORKER], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=err)
        p.stdin.write(json.dumps(dict(job, specs=part)).encode())
        p.stdin.close()
        _pending.append((p, err, part))


def _cpus_per_rank() -> int:
    """This process's CPUs over the ranks torchrun started on this host (each rank's trace
    starts its own workers, for the same kernels)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, (cpus or 1) // (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1))


def wait(timeout: Optional[float] = None) -> None:
    """Wait for the workers started so far (at most WAIT_S in all) and adopt what they compiled:
    each specialization's kernel, loaded from CACHE_DIR (Triton's own compile of it, a cache
    hit) with its launcher, goes into the kernel's in-process cache, where the launch that
    follows finds it. A worker still running at the deadline is left to finish; its kernels
    compile at their launch, here."""
    if not _pending:
        return
    deadline = time.monotonic() + (WAIT_S if timeout is None else timeout)
    while _pending:
        p, err, part = _pending.pop(0)
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.debug("a precompile worker is still running after %.0f s", WAIT_S)
            continue
        err.seek(0)
        log.debug("precompile worker (exit %s): %s", p.returncode,
                  err.read()[-4000:].decode(errors="replace"))
        err.close()
        with triton.knobs.cache.scope():   # the workers' cache, wherever the parent's is now
            triton.knobs.cache.dir = CACHE_DIR
            for module, name, spec in part:
                try:
                    kernel = getattr(importlib.import_module(module), name).preload(spec)
                    kernel._init_handles()   # the launcher, built by the worker, and the cubin
                except Exception:
                    log.debug("adopting %s.%s failed", module, name, exc_info=True)


if __name__ == "__main__":
    raise SystemExit("run precompile_worker.py")
