"""The TRITON_INTERPRET=1 setting of the kernel tests (test_linear_logprobs_interpret.py, the
recompute op's kernels; test_fused_interpret.py, the fused-gradient block steps' kernels), their
tiles of 16 and their float64 golden.

The launchers are called directly with the raw kernels (`wrap` = identity): the interpreter
cannot run through wrap_triton (research/inductor-apis.md §6). TRITON_INTERPRET is read when
@triton.jit decorates the kernels, so it is set before the kernel module is imported; if the
kernels were decorated without it (or on a CUDA machine), the importing test module is skipped.

Legend: N tokens, H hidden, V vocab. Tiles of 16 so V=75 spans 5 tiles, 2 forward splits of 48
columns (the last one partial) and 3 backward chunks of 32 columns."""
import os

import pytest
import torch

# Only on a machine without CUDA: in a pytest process that also runs the GPU tests, the variable
# would send those through the interpreter too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import lowerings.linear_logprobs.tuning as tuning  # noqa: E402
import lowerings.linear_logprobs.recompute.dense as tk  # noqa: E402
import lowerings.linear_logprobs.recompute.plan as split_plan  # noqa: E402

if not isinstance(tk._fwd_kernel, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

# triton 3.6's interpreter turns a scalar kernel argument into a 1-element array and converts it
# with int(array), which numpy >= 2.4 refuses ("only 0-dimensional arrays"): every `range` over a
# runtime scalar then fails. Convert through .item() instead (a test-only shim; compiled kernels
# never go through this code).
_interp = triton.runtime.interpreter
_orig_patch_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "TILES", (16, 16, 16, 1, 1))
    monkeypatch.setattr(split_plan, "FWD_COLS_PER_SPLIT", 48)
    monkeypatch.setattr(tuning, "CHUNK_V", 32)
    monkeypatch.setattr(tuning, "GROUP_N", 2)    # 2 row blocks: the last group is partial


def golden(x, w, ids, b, temperature, scale=1.0, cap=None):
    z = x.double() @ w.double().T                                          # [N, V]
    if b is not None:
        z = z + b.double()
    z = z * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    z = z / temperature
    lse = z.logsumexp(-1)
    return z.gather(-1, ids[:, None])[:, 0] - lse, lse - (z.softmax(-1) * z).sum(-1), lse


def make(n, h, v, dtype, bias, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = torch.randn(v, h, generator=g).to(dtype)
    b = (torch.randn(v, generator=g) + offset).to(dtype) if bias else None
    return x, w, torch.randint(0, v, (n,), generator=g), b


# fp16 rather than bf16: numpy has no bf16, and the interpreter's bf16 loads come back as
# garbage (checked on triton 3.6); the GPU test covers bf16.
DTYPE_16 = torch.float16

# Row masks (N = 40): padding at the end of each "sequence" of 10, scattered, none, all.
MASKS = {
    "right_padded": (torch.arange(40) % 10) < torch.tensor([7, 3, 10, 1]).repeat_interleave(10),
    "scattered": torch.rand(40, generator=torch.Generator().manual_seed(5)) > 0.5,
    "all_valid": torch.ones(40, dtype=torch.bool),
    "all_padded": torch.zeros(40, dtype=torch.bool),
}
