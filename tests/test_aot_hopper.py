"""The CUDA kernels build for Hopper (sm_90) at their launch tiles and fit its shared memory,
checked on any machine through Triton's ahead-of-time compile (bench/kernels/aot_check.py), with
spill and instruction budgets per Triton release of the support matrix. A subprocess: this
session imported Triton under TRITON_INTERPRET=1 (conftest), which swaps the kernels for
interpreted ones."""
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.kernels.aot_check import cases
from lowerings.linear_logprobs.launching.triton_compat import release

ROOT = Path(__file__).resolve().parents[1]


# Spill bytes (stores, loads) a thread of each kernel with 16-bit operands, per Triton release of
# the support matrix, as measured by aot_check (Triton's own ptxas for sm_90, with its flags; the
# wheel's ptxas, not TRITON_PTXAS_PATH's): a kernel not listed spills nothing. Budgets are the
# measurements, never loosened to pass: a kernel that spills more fails, a new release fails
# until it is measured and added here (and in the README's support matrix). fp32 operands (3xTF32
# products, labels "fp32, ...") spill ~1-2 KB a thread on every release: known, stated in the
# the lm_head precision table in docs/losses-and-metrics.md, not held here.
#  - the forwards hold a 128 x 256 fp32 logits tile and the row statistics in 255 registers with
#    none to spare; the STORE_E forwards spill one shared-memory address of the tile store,
#    reloaded once a tile (3.6, 3.7)
#  - 3.7: the plain fused forwards spill 8 B outside the main loop (one reload a tile in it:
#    bench.kernels.sass), the ROUND forward 168 B (84 local loads / stores in its main loop)
#  - 3.9: LLVM's SLP vectorizer packs the epilogue's one-hot compares into 16- / 64-bit masks
#    (selp.b16 / shl.b16 / or.b16 in the PTX); with it off the fused forward spills 36 / 64 B, not
#    316 / 592 (an experiment: Triton turns it off only for sm_80). Every ptxas (12.8 to 13.4)
#    spills on that PTX: it is the code, not the assembler.
SPILLS = {
    "3.6": {
        "forward, fused, STORE_E, WITH_ENTROPY=True": (20, 20),
        "forward, fused, STORE_E, WITH_ENTROPY=False": (8, 8),
        "dX step, recompute, STORE=True": (148, 148),
        "fp32 of bf16, forward, fused (STORE_Z)": (248, 452),
        "fp32 of bf16, dlogits, recompute": (376, 228),
    },
    "3.7": {
        "forward, fused (STORE_Z)": (8, 8),
        "forward, fused, no entropy": (8, 8),
        "forward, fused, ROUND (round_logits)": (168, 168),
        "forward, fused, STORE_E, WITH_ENTROPY=True": (16, 16),
        "forward, fused, STORE_E, WITH_ENTROPY=False": (8, 8),
        "forward, softcapped": (8, 8),
        "dX step, recompute, STORE=True": (148, 148),
        "fp32 of bf16, forward, fused (STORE_Z)": (156, 264),
        "fp32 of bf16, dlogits, recompute": (168, 168),
    },
    "3.8": {
        "forward, fused, STORE_E, WITH_ENTROPY=True": (52, 100),
        "dX step, recompute, STORE=True": (148, 148),
        "fp32 of bf16, forward, fused (STORE_Z)": (372, 684),
        "fp32 of bf16, dlogits, recompute": (192, 192),
    },
    "3.9": {
        "forward, fused (STORE_Z)": (316, 592),
        "forward, fused, no entropy": (364, 692),
        "forward, fused, ROUND (round_logits)": (408, 792),
        "forward, fused, STORE_E, WITH_ENTROPY=True": (388, 736),
        "forward, fused, STORE_E, WITH_ENTROPY=False": (376, 716),
        "forward, recompute": (16, 16),
        "forward, softcapped": (324, 548),
        "dW step, persistent, TMA_OUT=False": (8, 8),
        "dW step, persistent, fused, ACCUMULATE=True, TMA_OUT=False": (8, 8),
        "dX step, recompute, STORE=True": (156, 160),
        "fp32 of bf16, forward, fused (STORE_Z)": (656, 1232),
        "fp32 of bf16, forward, recompute": (184, 296),
        "fp32 of bf16, dlogits, recompute": (536, 348),
    },
}


def _env() -> dict:
    """No interpreter; the wheel's own ptxas (a TRITON_PTXAS_PATH would change the figures)."""
    drop = {"TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_kernels_compile_for_sm90():
    assert release() in SPILLS, f"Triton {release()}: measure its spills (aot_check) and add them"
    budget = SPILLS[release()]
    r = subprocess.run([sys.executable, "-m", "bench.kernels.aot_check"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == len(list(cases())), r.stdout   # every launch configuration
    labels = {label for label, *_ in cases()}
    assert set(budget) <= labels, set(budget) - labels
    for label in labels - {label for label in labels if label.startswith("fp32, ")}:
        line = next(line for line in lines if line[6:].startswith(label + " "))
        st, ld = map(int, re.search(r"spills (\d+)/(\d+) B", line).groups())
        bst, bld = budget.get(label, (0, 0))
        assert st <= bst and ld <= bld, f"triton {release()}: {line} (budget {bst}/{bld} B)"


# Instructions in the main loop (one K step and, behind a branch, a tile's epilogue) of the
# kernels whose epilogue bounds small heads, per Triton release, as measured (bench.kernels.sass)
# plus 5%: tl.exp's denormal wrapper, a 64-bit one-hot compare or an unvectorized ws store each
# add hundreds (dc4aa49: 2675 and 3319). 3.6: at 0997970; 3.7-3.9 on 2026-11-28.
MAIN_LOOP = {
    "3.6": {"forward, fused, STORE_E, WITH_ENTROPY=False": 2039, "dlogits, recompute": 2118},
    "3.7": {"forward, fused, STORE_E, WITH_ENTROPY=False": 2024, "dlogits, recompute": 2101},
    "3.8": {"forward, fused, STORE_E, WITH_ENTROPY=False": 2390, "dlogits, recompute": 2322},
    "3.9": {"forward, fused, STORE_E, WITH_ENTROPY=False": 2190, "dlogits, recompute": 2343},
}


def test_epilogue_instruction_budget():
    assert release() in MAIN_LOOP, f"Triton {release()}: measure (bench.kernels.sass) and add"
    for label, measured in MAIN_LOOP[release()].items():
        r = subprocess.run([sys.executable, "-m", "bench.kernels.sass", label], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        n = int(re.search(r"main loop (\d+)", r.stdout).group(1))
        assert 0 < n <= measured * 21 // 20, r.stdout
