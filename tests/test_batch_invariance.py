"""Batch invariance on CPU (tests/batch_invariance.py states the property): each sequence's
log-probs and entropy computed alone are bitwise those of every batched, padded, packed,
gradient-mode and compiled way, at a shape with several row groups and vocab chunks of the CPU
body. The GPU twin: tests/test_batch_invariance_gpu.py."""
import pytest
import torch

from lowerings.linear_logprobs import cpu
from tests.batch_invariance import make_batch, mismatches


@pytest.mark.parametrize("dtype", [torch.bfloat16])   # (float32 passes too: ~60 s more of compiles)
def test_rows_bitwise_independent_of_the_batch(monkeypatch, dtype):
    monkeypatch.setattr(cpu, "CHUNK_V", 64)                  # 4 vocab chunks, the last partial
    monkeypatch.setattr(cpu, "WS_BYTES", 64 * 4 * 24)        # row groups of ~24 rows
    torch._dynamo.reset()
    out = mismatches(*make_batch(6, 40, 32, 200, dtype, "cpu"))
    assert out and all(v == 0 for v in out.values()), {k: v for k, v in out.items() if v}
