"""The precompile worker (launching/precompile.py): compiles kernel specializations for a target into a
Triton cache directory, with triton alone. Run as a script, not a module:

    python .../precompile_worker.py < job.json    # {"target", "cache_dir", "root", "specs"}

Why a script with triton alone: on a host busy with Inductor's compile, a worker that imported
torch and this package took 7-10 s to start (one H100 host, bench/results/
e2e_first_call_h100_410cb80.txt); triton alone takes ~0.1 s. So the package's `__init__`s, which import
torch, are skipped: the kernel modules (kernels/, torch-free) load under their own names, which
their specializations' cache keys hold.
"""
import importlib
import json
import os
import sys
import time
import types

import triton
from triton.backends.compiler import GPUTarget


class _TargetDriver:
    """Triton's driver, as far as compiling needs one: the parent's target (no GPU is touched)."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0


def _packages(root: str) -> None:
    """lowerings and lowerings.linear_logprobs as bare packages (their __init__s import torch)."""
    path = root
    for name in ("lowerings", "lowerings.linear_logprobs"):
        path = os.path.join(path, name.rsplit(".", 1)[-1])
        pkg = types.ModuleType(name)
        pkg.__path__ = [path]
        sys.modules.setdefault(name, pkg)


def main(job: dict) -> int:
    t0 = time.perf_counter()
    _packages(job["root"])
    triton.knobs.cache.dir = job["cache_dir"]
    if job.get("ptxas_version"):   # the parent's cache keys' ptxas version (precompile._ptxas_version)
        triton.knobs.nvidia.mock_ptx_version = job["ptxas_version"]
    triton.runtime.driver.set_active(_TargetDriver(GPUTarget(*job["target"])))
    failed = 0
    for module, name, spec in job["specs"]:
        t = time.perf_counter()
        try:
            compiled = getattr(importlib.import_module(module), name).preload(spec)
            if job["target"][0] == "cuda":   # the launcher: a C module a signature (gcc)
                from triton.backends.nvidia.driver import CudaLauncher
                CudaLauncher(compiled.src, compiled.metadata)
        except Exception as e:   # the parent compiles this one at its launch (and raises there)
            print(f"{module}.{name}: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
        print(f"{name} {time.perf_counter() - t:.2f} s", file=sys.stderr)
    print(f"worker: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(json.load(sys.stdin)))
