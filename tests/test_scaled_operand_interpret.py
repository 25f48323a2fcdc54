"""The A-operand-scaled dX / dW GEMMs of bench/kernels/scaled_operand.py (a
measured design alternative of the fused path, README: issue 11) under TRITON_INTERPRET=1, on CPU
tensors: the timing script's numbers are only worth something if its scaled steps compute
(s-scaled a) @ w and (s-scaled a).T @ x."""
import pytest
import torch
import triton

from interpret import DTYPE_16   # fp16: numpy, so the interpreter, has no bf16
from bench.kernels import scaled_operand as bso

R, V, H, TILE = 48, 160, 32, 32   # 3 row tiles (the last partial), 5 vocab tiles of TILE columns


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(R, V, generator=g).to(DTYPE_16)
    w = torch.randn(V, H, generator=g).to(DTYPE_16)
    x = torch.randn(R, H, generator=g).to(DTYPE_16)
    s = torch.rand(R, triton.cdiv(V, TILE), generator=g)
    return a, w, x, s


def _scaled(a, s, scale):
    """a * s[r, v // TILE], rounded as the kernel's mode rounds it (1: from fp32, 2: in a.dtype)."""
    s_full = s.repeat_interleave(TILE, 1)[:, :V]
    if scale == 1:
        return (a.float() * s_full).to(a.dtype).float()
    return (a * s_full.to(a.dtype)).float()


@pytest.mark.parametrize("scale", [0, 1, 2])
def test_dx_scaled_operand(operands, scale):
    a, w, x, s = operands
    out = torch.zeros(R, H, dtype=DTYPE_16)
    bso._dx_kernel[(triton.cdiv(R, 16) * triton.cdiv(H, 16),)](
        a, w, s, out, R, V, H, s.shape[1], SCALE=scale, USE_TMA=False, TILE_V=TILE, BLOCK_M=16,
        BLOCK_H=16, BLOCK_K=16, GROUP_M=2)
    ref = (a.float() if scale == 0 else _scaled(a, s, scale)) @ w.float()
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max(), rtol=0)


@pytest.mark.parametrize("scale", [0, 1, 2])
def test_dw_scaled_operand(operands, scale):
    a, w, x, s = operands
    out = torch.zeros(V, H, dtype=DTYPE_16)
    bso._dw_kernel[(3,)](a, x, s, out, R, V, H, s.shape[1], 3, SCALE=scale, USE_TMA=False,
                         TILE_V=TILE, BLOCK_C=16, BLOCK_H=16, BLOCK_K=16, GROUP_C=2)
    ref = (a.float() if scale == 0 else _scaled(a, s, scale)).T @ x.float()
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max(), rtol=0)
