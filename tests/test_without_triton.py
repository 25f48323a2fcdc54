"""compiled_grpo imports and runs its PyTorch body where triton is not installed (pyproject asks for
triton on Linux only): a subprocess with triton blocked runs grpo_loss (recompute and fused) and
token_logprobs on CPU, eager and compiled (aot_eager), and every path gives the same loss. The same
fresh process checks that `import compiled_grpo` leaves Inductor's pattern matcher unloaded (the
naive-fusion pass loads when first named: ~2 s of every process's import on a 2-core CPU)."""
import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["triton"] = None          # import triton -> ModuleNotFoundError, as on a machine without it
import torch
import compiled_grpo as cg
# the naive-fusion pass (and Inductor's pattern matcher under it) loads when first named
assert "torch._inductor.pattern_matcher" not in sys.modules, "import compiled_grpo loaded Inductor's pattern matcher"
torch.manual_seed(0)
B, T, H, V = 2, 8, 16, 50
h = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
ids = torch.randint(0, V, (B, T))
adv = torch.randn(B, dtype=torch.float64)
m = torch.rand(B, T) > 0.3
for mode in ("recompute", "fused"):
    cfg = cg.GRPOConfig(gradient_mode=mode)
    for fn in (cg.grpo_loss, torch.compile(cg.grpo_loss, fullgraph=True, backend="aot_eager")):
        out = fn(h, w, ids, adv, m, config=cfg)
        out.loss.backward()
        print(mode, repr(out.loss.item()))
print("logprobs", cg.token_logprobs(h, w, ids, mask=m).logprobs.sum().item())
assert sys.modules["triton"] is None
print("OK")
"""


def test_cpu_runs_without_triton():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.endswith("OK\n"), run.stdout[-2000:] + run.stderr[-3000:]
    losses = [float(line.split()[1]) for line in run.stdout.splitlines() if line.startswith(("recompute", "fused"))]
    assert len(losses) == 4 and max(losses) - min(losses) < 1e-12, run.stdout   # fp64: one loss to rounding
