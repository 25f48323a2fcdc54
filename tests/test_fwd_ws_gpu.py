"""The fused path's warp-specialized Gluon forward (kernels.fwd_gluon, sm_90; skipped elsewhere) against
the Triton forward it replaces (kernels.logits._fwd_kernel), through fused_cuda.block_forward: the
block's log-probs, entropy and lse, the stored tile values and their zoff references, for a
full block, a block whose last row half has no valid row, and one valid row, with one 8-warp
consumer (the default tiles) and with two of 4 warps; bitwise repeatable."""
import pytest
import torch

from lowerings.linear_logprobs import cuda as dense
from lowerings.linear_logprobs import fused_cuda as fc
from lowerings.linear_logprobs.cuda import cdiv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs an sm_90 GPU (Hopper wgmma)")]

R, V, H = 256, 1000, 512   # two 128-row blocks; V: a partial last vocab tile


def _block_forward(n, scaled, with_entropy, ws_kernel, monkeypatch, seed=0, tiles=None):
    """(lp, ent, lse, ws, zoff, ref) of block_forward over the first n of R rows (the Gluon
    kernel at `tiles`, fused_cuda.FWD_WS_TILES by default)."""
    monkeypatch.setattr(fc, "FWD_WS", ws_kernel)
    monkeypatch.setattr(fc, "FWD_WS_TILES", tiles or fc.FWD_WS_TILES)
    dense._ensure_allocator()
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(R, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * (2 / H ** 0.5)).bfloat16()
    ids = torch.randint(0, V, (R,), device="cuda", generator=g)
    perm = torch.randperm(R, device="cuda", generator=g)
    counts = torch.tensor([n], dtype=torch.int32, device="cuda")
    ws = torch.full((R, cdiv(V, 64) * 64), float("nan"), device="cuda").bfloat16()
    zoff = torch.full((R, cdiv(V, dense.TILES[1])), float("nan"), device="cuda")
    xg = torch.empty(R, H, dtype=torch.bfloat16, device="cuda")
    ref = torch.zeros(3 * R, device="cuda")
    lp, ent, lse = fc.block_forward(x, w, ids[perm], None, perm, counts, ws, zoff, xg, 0, 0, R,
                                    1.0, with_entropy, 1.0, None, ref, scaled)
    return lp, ent, lse, ws if scaled else fc._z_view(ws), zoff, ref


@pytest.mark.parametrize("tiles", [None, (64, 4, 0, 1), (64, 3, 1, 2), (64, 4, 0, 2)],
                         ids=["default", "register-stores", "two-consumers", "two-consumers-regs"])
@pytest.mark.parametrize("scaled,with_entropy", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("n", [R, 70, 1])
def test_matches_the_triton_forward(n, scaled, with_entropy, tiles, monkeypatch):
    got = _block_forward(n, scaled, with_entropy, True, monkeypatch, tiles=tiles)
    want = _block_forward(n, scaled, with_entropy, False, monkeypatch)
    names = ("logprobs", "entropy", "lse", "ws", "zoff", "ref")
    for name, a, b in zip(names, got, want):
        a, b = a[:n].float(), b[:n].float()
        if name == "ws":   # the stored tiles, V's columns (the row stride's pad is never read)
            a, b = a[:, :V], b[:, :V]
        assert torch.isfinite(a).all(), name
        # the same tile order and fp32 accumulation; the wgmma K order may differ by an ulp
        torch.testing.assert_close(a, b, rtol=2e-2 if name == "ws" else 1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    again = _block_forward(n, scaled, with_entropy, True, monkeypatch, tiles=tiles)
    for name, a, b in zip(names, got, again):   # bitwise repeatable (ws: V's columns)
        assert torch.equal(a[:n, :V], b[:n, :V]) if name == "ws" else torch.equal(a[:n], b[:n])


def test_fused_path_takes_it_where_enabled(monkeypatch):
    monkeypatch.setattr(fc, "FWD_WS", True)   # off by default (fused_cuda.FWD_WS)
    x = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
    assert fc._fwd_ws_ok(x, None, None, True) == fc.FWD_DEVICE_SPLITS
    assert not fc._fwd_ws_ok(x, None, 30.0, True)                  # softcap: the Triton kernel
    assert not fc._fwd_ws_ok(x, torch.empty(64, device="cuda"), None, True)   # bias: likewise
