"""examples/train_grpo_tiny.py, the end-to-end example of docs/trl.md, runs as it shows it (here
for 3 steps instead of 150): the TRL drop-in trains, prints its summary and draws its plot."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def test_train_grpo_tiny_runs(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_grpo_tiny.py"), "--steps", "3",
                          "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                              # a crash prints the Python stacks of every thread (a CI run on a
                              # loaded machine once saw a bare SIGSEGV in libc, not reproduced)
                              "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "3 steps in" in run.stdout and (tmp_path / "train_grpo_tiny.png").exists(), run.stdout[-2000:]
