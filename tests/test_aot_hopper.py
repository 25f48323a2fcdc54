"""The CUDA kernels build for Hopper (sm_90) at their launch tiles and fit its shared memory,
checked on any machine through Triton's ahead-of-time compile (lowerings/linear_logprobs/
aot_check.py). A subprocess: this session imported Triton under TRITON_INTERPRET=1 (conftest),
which swaps the kernels for interpreted ones."""
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.kernels.aot_check import cases

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench.kernels.aot_check"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == len(list(cases())), r.stdout   # every launch configuration
    # The forwards hold a 128 x 256 fp32 logits tile and the row statistics in 255 registers
    # with none to spare: a scalar the compiler cannot prove a multiple of the vocab tile (the
    # fused forward's splits read on the device, before tl.multiple_of) spilled 1.3-4.4 KB a
    # thread inside the column loop.
    # (16-bit operands; the fp32 forwards, fp32 inputs' 3xTF32 products, spill ~1.5 KB a thread:
    # known, stated in the README's lm_head precision table, not yet tuned; fp32_lm_head over a
    # bf16 head, one TF32 product (cuda.logits_precision), spills 248 / 452 B in the fused
    # forward: held to that size below)
    # The exp-scaled backward's forwards (STORE_E) spill one shared-memory address of the tile
    # store, reloaded once a tile (8 B a thread without entropy, 20 B with; since their epilogue
    # lost ~20% of its instructions to ftz exps and 32-bit id compares, kernels.logits._exp /
    # _col_ids): held to that size so it cannot grow unseen.
    forwards = [line for line in lines if "_fwd_kernel" in line and " fp32" not in line]
    for line in (line for line in lines if " fp32 of bf16, " in line and "_fwd_kernel" in line):
        st, ld = map(int, re.search(r"spills (\d+)/(\d+) B", line).groups())
        assert st <= 256 and ld <= 512, line   # as measured (aot_check, triton 3.6)
    plain = [line for line in forwards if "STORE_E" not in line]
    assert plain and all("spills 0/0 B" in line for line in plain), "\n".join(forwards)
    for line in forwards:
        if "STORE_E" in line:
            st, ld = map(int, re.search(r"spills (\d+)/(\d+) B", line).groups())
            assert st <= 20 and ld <= 20, line   # as measured (aot_check, triton 3.6)


# Instructions in the main loop (one K step and, behind a branch, a tile's epilogue) of the
# kernels whose epilogue bounds small heads, as measured at 0997970 (bench.kernels.sass, triton
# 3.6) plus 5%: tl.exp's denormal wrapper, a 64-bit one-hot compare or an unvectorized ws
# store each add hundreds (dc4aa49: 2675 and 3319).
MAIN_LOOP_BOUND = {"forward, fused, STORE_E, WITH_ENTROPY=False": 2039 * 21 // 20,
                   "dlogits, recompute": 2118 * 21 // 20}


def test_epilogue_instruction_budget():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for label, bound in MAIN_LOOP_BOUND.items():
        r = subprocess.run([sys.executable, "-m", "bench.kernels.sass", label], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        n = int(re.search(r"main loop (\d+)", r.stdout).group(1))
        assert 0 < n <= bound, r.stdout
