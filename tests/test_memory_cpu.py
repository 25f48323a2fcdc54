"""Memory is asserted: the peak each gradient mode and path holds on CPU beyond its inputs and
gradients, against the bound docs/gradient-modes.md states (bench/memory.py's ``bound_mib``).

Each case runs in fresh processes (two gloo ranks for the TP cases) at N = 2048, H = 64,
V = 65536 (one [N, V] fp32 tensor: 512 MiB), measured as the growth of VmHWM after the inputs
are built (bench/memory.py says how). The naive log_softmax(h @ W.T) path runs the same way as
the control: the probe does see a materialized [N, V] tensor.
"""
import functools
import sys

import pytest

from bench import memory

# one measurement a (case, budget) a process: the budget test reads the fused case's 640 MiB run
_run = functools.lru_cache(maxsize=None)(lambda case, budget: memory.run(case, "ci", budget))

pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="/proc/self/status and clear_refs are Linux only")

# "auto" is "recompute" on CPU (docs/gradient-modes.md; the choice is test_fused_modes'): its
# process would measure the recompute case again (17 s of CI). A small budget is held to its bound
# at 128 MiB, fused, in the budget test below (the 32 MiB fused case, 44 s of CI, and the TP
# fused case at 128 MiB, 22 s, were dropped for CI time: TP fused keeps its 640 MiB case)
CASES = [(c, 640.0) for c in memory.CASES if c not in ("naive", "auto")]


@pytest.mark.parametrize("case,budget", CASES, ids=[f"{c}-{b:.0f}" for c, b in CASES])
def test_peak_beyond_inputs_and_grads_within_the_documented_bound(case, budget):
    for r in _run(case, budget):
        assert r["beyond_mib"] <= r["bound_mib"], r
        if "fused" not in case:   # the recompute paths' tiles are far from one [N, V] tensor
            assert r["beyond_mib"] < r["nv_mib"] / 2, r


def test_fused_workspace_budget_is_what_the_fused_mode_holds():
    """Issue 67: the CPU fused body held 4-7x fused_workspace_mib ([R, V] temporaries per block).
    Its peak now rises with the budget by about the budget: 640 MiB buys R = 2048 rows (the
    CPU cap) of the workspace and tiles here, 128 MiB 384 rows."""
    small_run = _run("fused", 128.0)[0]
    assert small_run["beyond_mib"] <= small_run["bound_mib"], small_run
    big, small = _run("fused", 640.0)[0]["beyond_mib"], small_run["beyond_mib"]
    assert 400 <= big - small <= 640 - 128 + memory.FIXED_MIB, (big, small)


def test_the_probe_sees_a_logits_tensor():
    r = _run("naive", 640.0)[0]
    assert r["beyond_mib"] > r["nv_mib"], r
