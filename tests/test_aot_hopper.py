"""The CUDA kernels build for Hopper (sm_90) at their launch tiles and fit its shared memory,
checked on any machine through Triton's ahead-of-time compile (lowerings/linear_logprobs/
aot_check.py). A subprocess: this session imported Triton under TRITON_INTERPRET=1 (conftest),
which swaps the kernels for interpreted ones."""
import os
import subprocess
import sys
from pathlib import Path

from lowerings.linear_logprobs.aot_check import cases

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "lowerings.linear_logprobs.aot_check"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == len(list(cases())), r.stdout   # every launch configuration
