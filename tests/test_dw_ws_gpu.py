"""The fused path's warp-specialized Gluon dW step (kernels.dw_gluon, sm_90; skipped elsewhere)
against an fp32 reference and the Triton step it replaces: stored and accumulated blocks, a
partial last K step (two consumers on each tile's vocab halves, the default, and one on the
whole tile), the skip rules of a block with no valid row, bitwise repeatability."""
import pytest
import torch

from lowerings.linear_logprobs.recompute import dense
from lowerings.linear_logprobs.recompute import dw_steps
from bench.kernels.dw_ws import triton_step as _triton_step
from bench.kernels.dw_ws import ws_step as _ws_step
from lowerings.linear_logprobs.recompute.dense import cdiv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs an sm_90 GPU (Hopper wgmma)")]


def _operands(r=320, v=1000, h=512, seed=0):
    """ws [r, Vp] (V = 1000: a partial last vocab tile; Vp its 64-column stride), xg [r, h], an
    old dW; rows past any count hold NaN, which a K loop stopping at n never reads."""
    dense._ensure_allocator()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = (torch.rand(r, cdiv(v, 64) * 64, device="cuda", generator=g) * 0.1).bfloat16()
    xg = torch.randn(r, h, device="cuda", generator=g).bfloat16()
    dw0 = (torch.randn(v, h, device="cuda", generator=g) * 0.1).bfloat16()
    return ws, xg, dw0


@pytest.mark.parametrize("tiles", [None, (128, 256, 64, 3, 8, 168, 1)],
                         ids=["default", "one-consumer"])
@pytest.mark.parametrize("n", [320, 257, 1])
def test_stores_and_adds_the_valid_rows(n, tiles):
    ws, xg, dw0 = _operands()
    ws[n:], xg[n:] = float("nan"), float("nan")
    v = dw0.shape[0]
    counts = torch.tensor([n], dtype=torch.int32, device="cuda")
    prod = ws[:n, :v].float().T @ xg[:n].float()
    for acc in (False, True):
        ref = prod + dw0.float() if acc else prod
        dw, dw_t = dw0.clone(), dw0.clone()
        _ws_step(ws, xg, dw, counts, ws.shape[0], acc, final=1, tiles=tiles)
        _triton_step(ws.nan_to_num(0.0), xg.nan_to_num(0.0), dw_t, counts, ws.shape[0], acc)
        scale = ref.abs().max()
        err = ((dw.float() - ref).abs().max() / scale).item()
        err_t = ((dw_t.float() - ref).abs().max() / scale).item()
        assert torch.isfinite(dw).all()
        # one rounding of the fp32 sum (plus the old value's, adding): within bf16's 2^-8 of
        # the largest entry, and never worse than the Triton step (which rounds twice adding)
        assert err <= 2 ** -8 and err <= err_t * 1.01 + 1e-6, (acc, err, err_t)
        dw2 = dw0.clone()
        _ws_step(ws, xg, dw2, counts, ws.shape[0], acc, final=1, tiles=tiles)
        assert torch.equal(dw, dw2)   # bitwise repeatable


def test_skip_rules_of_the_fused_pair():
    """kernels.dw._dw_skips, ON_DEVICE: a block with no valid row stores zeros only when it is
    the final block run and none before it had rows; adding needs an earlier block with rows."""
    ws, xg, dw0 = _operands()
    r = ws.shape[0]
    none_before = torch.tensor([0, 0], dtype=torch.int32, device="cuda")   # this block, later
    some_before = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    step = lambda dw, counts, acc, final: _ws_step(ws, xg, dw, counts, r, acc, n_later=1,   # noqa: E731
                                                   final=final, on_device=True)
    dw = dw0.clone()
    step(dw, none_before, False, 0)
    assert torch.equal(dw, dw0)                        # not final: left as is
    step(dw, none_before, False, 1)
    assert torch.equal(dw, torch.zeros_like(dw0))      # final, nothing before: zeros
    dw = dw0.clone()
    step(dw, some_before, False, 1)
    step(dw, some_before, True, 1)
    assert torch.equal(dw, dw0)                        # an earlier block stored; no rows to add
    counts = torch.tensor([7, 5], dtype=torch.int32, device="cuda")
    step(dw, counts, False, 0)
    assert torch.equal(dw, dw0)                        # storing is the earlier block's job
    step(dw, counts, True, 0)
    ref = dw0.float() + ws[:7, :dw0.shape[0]].float().T @ xg[:7].float()
    assert ((dw.float() - ref).abs().max() / ref.abs().max()).item() <= 2 ** -8


def test_fused_path_takes_it_on_sm90():
    ws = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
    assert dw_steps._dw_ws_ok(ws, True) == dw_steps.DW_WS
    assert not dw_steps._dw_ws_ok(ws, False)
