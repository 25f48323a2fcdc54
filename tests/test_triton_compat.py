"""triton_compat (lowerings/linear_logprobs/launching/triton_compat.py): the Triton releases the internals
were checked on, and what the package does on one outside them: fast launch and the precompile
workers step aside and every launch goes through Triton's own `kernel[grid](...)`. Subprocesses:
the pretended version must be in place before the package imports triton_compat."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowerings.linear_logprobs.launching import triton_compat

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "script.py"    # a file: JITFunction reads its kernel's source
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("version,release,ok", [
    ("3.6.0", "3.6", True), ("3.7.1", "3.7", True), ("3.8.0", "3.8", True),
    ("3.9.0+git1234abcd", "3.9", True), ("3.10.0rc1", "3.10", False), ("3.5.1", "3.5", False),
    ("4.0.0", "4.0", False)])
def test_release_and_checked(version, release, ok):
    assert triton_compat.release(version) == release
    assert triton_compat.internals_ok(version) is ok


def test_installed_triton_is_checked():
    """The suite runs on a Triton of the support matrix (CI: the README's stack and the compat
    leg's): a newer one must be checked, then added to CHECKED, not run past silently."""
    assert triton_compat.INTERNALS_OK, triton_compat.release()


def test_gluon_tma_names_are_current():
    """dw_gluon's TMA copies resolve to Gluon's current names where this Triton has them (3.8
    on), to the pre-3.8 ones only where it lacks them (3.9 makes the old names raise)."""
    from triton.experimental.gluon.language.nvidia.hopper import tma
    if hasattr(tma, "async_load"):
        assert triton_compat.tma_load is tma.async_load
        assert triton_compat.tma_store is tma.async_store
    else:
        assert triton_compat.tma_load is tma.async_copy_global_to_shared
        assert triton_compat.tma_store is tma.async_copy_shared_to_global


_UNCHECKED = r'''
import triton
triton.__version__ = "3.99.0"          # a release the internals were not checked on
import torch
from triton.runtime.jit import JITFunction
from lowerings.linear_logprobs.launching import fast as fl
from lowerings.linear_logprobs.launching import precompile
from lowerings.linear_logprobs.launching import triton_compat
assert not triton_compat.INTERNALS_OK
assert fl.ENABLED is False and precompile.WORKERS == 0

# a launch takes Triton's own path every time (its run stands in: no GPU here)
def body(x_ptr, n):
    pass
kernel = JITFunction(body)
calls = []
kernel.run = lambda *args, grid, warmup, **kw: calls.append(grid)
launch = fl.launcher(kernel)
for grid in ((1,), (2,), (3,)):
    launch[grid](torch.zeros(4), 4)
assert calls == [(1,), (2,), (3,)], calls
# precompile captures nothing and starts no worker
assert precompile.precompile(lambda: launch[(1,)](torch.zeros(4), 4)) == 0
print("OK")
'''


def test_unchecked_triton_takes_tritons_own_path(tmp_path):
    assert _run(_UNCHECKED, tmp_path).strip().endswith("OK")
