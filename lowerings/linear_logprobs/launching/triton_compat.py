"""The Triton releases this package was checked on, and every Triton name it uses beyond
`triton.jit` / `triton.language` / Gluon's language, in one place. Torch-free: the precompile
worker (precompile_worker.py, triton alone) imports it.

CHECKED: the Triton of each torch in the support matrix (README, "Support matrix"); torch's CUDA
wheels pin it: torch 2.11 -> 3.6 (the GPU machines), 2.13 -> 3.7, 2.14 -> 3.8, 2.15 -> 3.9.

Internals used, each read in the source of every CHECKED release (the same names, arguments and
order in 3.6.0, 3.7.1, 3.8.0 and 3.9.0):

  launching/fast.py  triton.knobs.HookChain (an installed launch hook: .calls);
                  triton.runtime.jit.JITFunction (.params[i].is_constexpr / .name, .signature);
                  the CompiledKernel that `kernel[grid](...)` returns: .run(grid_x, grid_y,
                  grid_z, stream, .function, .packed_metadata, launch_metadata, enter_hook,
                  exit_hook, *args), as JITFunction.run calls it
  launching/precompile.py   triton.knobs.runtime.jit_cache_hook(key=, repr=, fn=, compile=,
                  is_manual_warmup=, already_compiled=) with fn.module / fn.name and
                  compile["specialization_data"]; JITFunction.warmup / .preload;
                  triton.runtime.jit.MockTensor; triton.knobs.cache.dir / .scope();
                  triton.backends.nvidia.compiler.get_ptxas_version;
                  CompiledKernel._init_handles
  precompile_worker.py
                  triton.knobs.nvidia.mock_ptx_version; triton.runtime.driver.set_active;
                  triton.backends.nvidia.driver.CudaLauncher(src, metadata)
  bench/kernels/aot_check.py (a check, not the package)
                  triton.compile of ASTSource / GluonASTSource for a GPUTarget;
                  triton.knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile

On a Triton outside CHECKED, `INTERNALS_OK` is False: fast_launch launches through
`kernel[grid](...)` (Triton's own binder and launcher) and precompile hands nothing to workers
(each kernel compiles at its first launch), so a changed internal can cost launch overhead,
never a wrong launch. tests/test_triton_compat.py runs both under a pretended newer version.

Gluon's TMA copies were renamed in 3.8 (`async_load` / `async_store`; 3.8 keeps the old names
as aliases, 3.9 makes them raise): kernels/dw_gluon.py calls `tma_load` / `tma_store`, the
current names where they exist, the old ones on 3.6 / 3.7, which lack the new.
"""
import re

import triton

CHECKED = ("3.6", "3.7", "3.8", "3.9")


def release(version: str = triton.__version__) -> str:
    """'major.minor' of a Triton version string ('3.9.0', '3.7.1+git...', '3.10.0rc1')."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version


def internals_ok(version: str = triton.__version__) -> bool:
    """Whether the internals above were checked on this Triton (module docstring)."""
    return release(version) in CHECKED


INTERNALS_OK = internals_ok()


def _gluon_tma():
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:   # a Triton without Gluon's Hopper module: dw_gluon is not built
        return None, None
    load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    return load, store


tma_load, tma_store = _gluon_tma()
