"""The Triton kernels of linear_logprobs under TRITON_INTERPRET=1, on CPU tensors.

The launchers are called directly with the raw kernels (`wrap` = identity): the interpreter
cannot run through wrap_triton (research/inductor-apis.md §6). TRITON_INTERPRET is read when
@triton.jit decorates the kernels, so it is set before the kernel module is imported; if the
kernels were decorated without it (or on a CUDA machine), this module is skipped.

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

import lowerings.linear_logprobs.cuda as tk  # noqa: E402

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
    monkeypatch.setattr(tk, "TILES", (16, 16, 16, 1, 1))
    monkeypatch.setattr(tk, "FWD_COLS_PER_SPLIT", 48)
    monkeypatch.setattr(tk, "CHUNK_V", 32)
    monkeypatch.setattr(tk, "GROUP_N", 2)    # 2 row blocks: the last group is partial


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


CASES = [  # n, h, v, bias, temperature, offset, with_entropy
    (40, 24, 75, True, 0.7, 0.0, True),     # V not a multiple of the tile, H of BLOCK_K; 3 row blocks
    (1, 16, 75, False, 1.0, 0.0, True),     # N = 1
    (19, 16, 75, True, 1.0, 1e4, False),    # logits near +1e4
    (19, 16, 75, True, 1.0, -1e4, True),    # all-negative logits
]


@pytest.mark.parametrize("n,h,v,bias,temperature,offset,with_entropy", CASES)
def test_forward_backward_fp32(n, h, v, bias, temperature, offset, with_entropy):
    x, w, ids, b = make(n, h, v, torch.float32, bias, offset)
    lp, ent, lse = tk.forward(x, w, ids, b, temperature, False, with_entropy)
    rlp, rent, rlse = golden(x, w, ids, b, temperature)
    atol = 1e-5 if offset == 0 else 4e-3              # fp32 ulp of 1e4 is 1e-3
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-6, atol=atol)
    if with_entropy:
        torch.testing.assert_close(ent.double(), rent, rtol=0, atol=atol)
    else:
        assert torch.equal(ent, torch.zeros_like(ent))

    g = torch.Generator().manual_seed(1)
    g_lp, g_ent, g_lse = (torch.randn(n, generator=g) for _ in range(3))
    if not with_entropy:
        g_ent = torch.zeros_like(g_ent)
    dx, dw, db = tk.backward(x, w, ids, b, lse, ent, g_lp, g_ent, g_lse, temperature, False,
                             with_entropy, True, True, bias)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    br = b.double().requires_grad_() if bias else None
    out = golden(xr, wr, ids, br, temperature)
    loss = (out[0] * g_lp).sum() + (out[2] * g_lse).sum()
    if with_entropy:
        loss = loss + (out[1] * g_ent).sum()
    loss.backward()
    # At |z| = 1e4 the fp32 ulp is 1e-3 and the entropy grad p * (log p + H) subtracts two
    # such numbers; the chunked torch body lands at 6e-3 there, the kernel at 2.4e-2.
    tol = dict(rtol=1e-4, atol=1e-4 if offset == 0 else 4e-2)
    torch.testing.assert_close(dx.double(), xr.grad, **tol)
    torch.testing.assert_close(dw.double(), wr.grad, **tol)
    if bias:
        torch.testing.assert_close(db.double(), br.grad, **tol)
    else:
        assert db.numel() == 0


# fp16 rather than bf16: numpy has no bf16, and the interpreter's bf16 loads come back as
# garbage (checked on triton 3.6); the GPU test covers bf16.
DTYPE_16 = torch.float16


def test_half_frozen_weight_and_no_bias_grad():
    x, w, ids, b = make(9, 32, 75, DTYPE_16, True)
    lp, ent, lse = tk.forward(x, w, ids, b, 1.0, True, True)
    rlp, rent, _ = golden(x, w, ids, b, 1.0)       # golden on the same bf16 values
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-5)
    g = torch.ones(9)
    dx, dw, db = tk.backward(x, w, ids, b, lse, ent, g, g, torch.zeros(9), 1.0, True, True,
                             True, False, False)
    assert dx.dtype == DTYPE_16 and dw.numel() == 0 and db.numel() == 0
    xr = x.double().requires_grad_()
    out = golden(xr, w, ids, b, 1.0)
    (out[0].sum() + out[1].sum()).backward()
    # dz is stored in bf16 (as eager bf16 would); 1e-2 relative covers that rounding only
    err = (dx.double() - xr.grad).norm() / xr.grad.norm()
    assert err < 1e-2, err


def test_deterministic():
    x, w, ids, b = make(19, 16, 75, torch.float32, True)
    a = tk.forward(x, w, ids, b, 1.0, False, True)
    g = torch.randn(19)
    da = tk.backward(x, w, ids, b, a[2], a[1], g, g, g, 1.0, False, True, True, True, True)
    b2 = tk.forward(x, w, ids, b, 1.0, False, True)
    db = tk.backward(x, w, ids, b, a[2], a[1], g, g, g, 1.0, False, True, True, True, True)
    for p, q in zip(a + da, b2 + db):
        assert torch.equal(p, q)


@pytest.mark.parametrize("group_rows,groups", [(16, 3), (32, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, DTYPE_16])
def test_row_groups(monkeypatch, dtype, group_rows, groups):
    """The backward in row groups against one group: 3 groups of R = 16 rows (the last one 8),
    or 2 of R = 32 (2 row blocks; the last group's 8 rows leave the second block's d_bias row
    of the first group behind). dW summed over the groups (one rounding to dW's dtype each),
    dX and d_bias written per group."""
    x, w, ids, b = make(40, 24, 75, dtype, True, seed=3)
    lp, ent, lse = tk.forward(x, w, ids, b, 0.7, False, True)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent, g_lse = (torch.randn(40, generator=g) for _ in range(3))
    args = (x, w, ids, b, lse, ent, g_lp, g_ent, g_lse, 0.7, False, True, True, True, True)
    one = tk.backward(*args)
    monkeypatch.setattr(tk, "DX_GROUP_BYTES", group_rows * 24 * 4)
    assert tk._row_groups(40, 24) == groups
    three = tk.backward(*args)
    for a, c in zip(one, three):
        assert a.dtype == c.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        else:   # dW rounded to fp16 after each group instead of once
            err = (c.double() - a.double()).norm() / a.double().norm()
            assert err < 2e-3, err


import lowerings.linear_logprobs.cuda_rows as rk  # noqa: E402

# Row masks (N = 40): padding at the end of each "sequence" of 10, scattered, none, all.
MASKS = {
    "right_padded": (torch.arange(40) % 10) < torch.tensor([7, 3, 10, 1]).repeat_interleave(10),
    "scattered": torch.rand(40, generator=torch.Generator().manual_seed(5)) > 0.5,
    "all_valid": torch.ones(40, dtype=torch.bool),
    "all_padded": torch.zeros(40, dtype=torch.bool),
}


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("group_rows", [16, 1 << 20])
def test_row_masked_path(monkeypatch, kind, group_rows):
    """cuda_rows (valid rows compacted first, kernels stopping at a device count) against the
    float64 golden on the valid rows; padded rows give 0 outputs, 0 dX rows and nothing in
    dW / d_bias, whatever their incoming grads. group_rows=16: 3 row groups, so the count
    ends inside a group and later groups are empty."""
    monkeypatch.setattr(rk, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(tk, "DX_GROUP_BYTES", group_rows * 24 * 4)
    mask = MASKS[kind]
    x, w, ids, b = make(40, 24, 75, torch.float32, True, seed=3)
    lp, ent, lse = rk.forward(x, w, ids, b, mask, 0.7, False, True)
    rlp, rent, rlse = golden(x, w, ids, b, 0.7)
    m = mask.double()
    for got, ref in ((lp, rlp), (ent, rent), (lse, rlse)):
        torch.testing.assert_close(got.double(), ref * m, rtol=1e-6, atol=1e-5)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent, g_lse = (torch.randn(40, generator=g) for _ in range(3))
    dx, dw, db = rk.backward(x, w, ids, b, mask, lse, ent, g_lp, g_ent, g_lse, 0.7, False, True,
                             True, True, True)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    out = golden(xr, wr, ids, br, 0.7)
    ((out[0] * g_lp + out[1] * g_ent + out[2] * g_lse) * m).sum().backward()
    for got, ref in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(dx[~mask], torch.zeros_like(dx[~mask]))


def test_row_masked_half_no_weight_grad(monkeypatch):
    monkeypatch.setattr(rk, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    mask = MASKS["scattered"]
    x, w, ids, b = make(40, 32, 75, DTYPE_16, False)
    lp, ent, lse = rk.forward(x, w, ids, None, mask, 1.0, False, True)
    rlp, _, _ = golden(x, w, ids, None, 1.0)
    torch.testing.assert_close(lp.double(), rlp * mask, rtol=0, atol=1e-5)
    g = torch.ones(40)
    dx, dw, db = rk.backward(x, w, ids, None, mask, lse, ent, g, g, torch.zeros(40), 1.0, False,
                             True, True, False, False)
    assert dx.dtype == DTYPE_16 and dw.numel() == 0 and db.numel() == 0
    xr = x.double().requires_grad_()
    out = golden(xr, w, ids, None, 1.0)
    ((out[0] + out[1]) * mask).sum().backward()
    err = (dx.double() - xr.grad).norm() / xr.grad.norm()
    assert err < 1e-2, err


# logit_scale / final_logit_softcapping (Cohere-style scale, Gemma-2 cap): the scale folded into
# inv_temp without a cap; with one, tanh in the tile and (1 - tanh^2) in the dlogits kernel.
# Logits have std ~5 at H=24, so a cap of 3 saturates many of them.
@pytest.mark.parametrize("scale,cap,bias,rows", [(0.5, None, True, False), (0.5, 3.0, True, False),
                                                 (1.0, 30.0, False, False), (1.7, 3.0, True, True)])
def test_scale_and_softcap(monkeypatch, scale, cap, bias, rows):
    monkeypatch.setattr(rk, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    x, w, ids, b = make(40, 24, 75, torch.float32, bias, seed=6)
    mask = MASKS["scattered"] if rows else torch.ones(40, dtype=torch.bool)
    kw = dict(logit_scale=scale, softcap=cap)
    if rows:
        lp, ent, lse = rk.forward(x, w, ids, b, mask, 0.7, False, True, **kw)
    else:
        lp, ent, lse = tk.forward(x, w, ids, b, 0.7, False, True, **kw)
    m = mask.double()
    for got, ref in zip((lp, ent, lse), golden(x, w, ids, b, 0.7, scale, cap)):
        torch.testing.assert_close(got.double(), ref * m, rtol=1e-6, atol=1e-5)
    g = torch.Generator().manual_seed(7)
    g_lp, g_ent, g_lse = (torch.randn(40, generator=g) for _ in range(3))
    if rows:
        dx, dw, db = rk.backward(x, w, ids, b, mask, lse, ent, g_lp, g_ent, g_lse, 0.7, False,
                                 True, True, True, bias, **kw)
    else:
        dx, dw, db = tk.backward(x, w, ids, b, lse, ent, g_lp, g_ent, g_lse, 0.7, False, True,
                                 True, True, bias, **kw)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    br = b.double().requires_grad_() if bias else None
    out = golden(xr, wr, ids, br, 0.7, scale, cap)
    ((out[0] * g_lp + out[1] * g_ent + out[2] * g_lse) * m).sum().backward()
    for got, ref in ((dx, xr.grad), (dw, wr.grad)) + (((db, br.grad),) if bias else ()):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_minus_inf_bias_bans_tokens():
    """Banned tokens (bias -inf) at 0, 5 and 48..63, the whole first tile of split 1: finite
    values and grads, 0 log 0 = 0 in the entropy (issue 15). A split with every column banned
    also needs cuda._combine to guard (m - m_all) * s where s = 0 (not tested here)."""
    x, w, ids, b = make(19, 16, 75, torch.float32, True)
    banned = torch.tensor([0, 5] + list(range(48, 64)))
    b[banned] = -torch.inf
    ids = torch.where(torch.isin(ids, banned), 70, ids)
    lp, ent, lse = tk.forward(x, w, ids, b, 0.7, False, True)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent, g_lse = (torch.randn(19, generator=g) for _ in range(3))
    dx, dw, db = tk.backward(x, w, ids, b, lse, ent, g_lp, g_ent, g_lse, 0.7, False, True, True,
                             True, True)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    z = (xr @ wr.T + br) / 0.7
    logp = z.log_softmax(-1)
    rlse, rlp = z.logsumexp(-1), logp.gather(-1, ids[:, None])[:, 0]
    rent = -(logp.exp() * torch.where(logp == -torch.inf, 0, logp)).sum(-1)
    ((rlp * g_lp).sum() + (rent * g_ent).sum() + (rlse * g_lse).sum()).backward()
    for got, want in ((lp, rlp), (ent, rent), (lse, rlse), (dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-4)


# The fused-gradient block steps (fused.py with fused_cuda.py's kernels): the logits tile stored
# as d = z - running max (fp16 for 16-bit operands) plus per-tile maxima, dlogits formed in place,
# the Triton dW / dX steps stopping at each block's count. Checked against the float64 golden of
# sum(G_lp * logprobs + G_ent * entropy) over the valid rows.
import lowerings.linear_logprobs.fused as fk  # noqa: E402
import lowerings.linear_logprobs.fused_cuda as fck  # noqa: E402


def _fused_run(monkeypatch, x, w, ids, b, mask, blocks, block_rows, by_block,
               dlogits_tile=(16, 16, 1), **kw):
    monkeypatch.setattr(rk, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(rk, "DW_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(fck, "DLOGITS_TILE", dlogits_tile)
    monkeypatch.setattr(fk, "_triton_body", lambda t: True)
    g = torch.Generator().manual_seed(11)
    G_lp, G_ent = torch.randn(x.shape[0], generator=g), torch.randn(x.shape[0], generator=g)
    seen = []

    def grad_fn(r0, idx, lp, ent):
        seen.append(idx.clone())
        return G_lp[idx], G_ent[idx]

    res = fk.fused_linear_logprobs(x, w, ids, b, mask, grad_fn, blocks=blocks,
                                   block_rows=block_rows, by_block=by_block, need_b=b is not None,
                                   **kw)
    return res, G_lp, G_ent, torch.cat(seen)


@pytest.mark.parametrize("kind", ["right_padded", "scattered", "all_valid", "all_padded"])
@pytest.mark.parametrize("blocks,block_rows,by_block,dlogits_tile", [
    (1, 40, False, (16, 16, 1)), (3, 16, False, (16, 16, 1)), (4, 10, True, (16, 16, 1)),
    (3, 16, False, (8, 32, 1))])   # dlogits tiles wider than the stored-max tiles: per-column maxima
# fused_cuda.DW_PERSISTENT; DX_SPLITS: 1 = one K loop, 8 = split over V where the dX grid is
# small (here always: 4 "SMs" in the interpreter, _sms), partials summed by the reduce kernel;
# cuda_rows.DW_ACC_INIT: dW's old value as the accumulator's start
@pytest.mark.parametrize("persistent,dx_splits,acc_init", [
    (False, 1, False), (True, 1, False), (True, 8, False), (False, 1, True), (True, 8, True)])
def test_fused_blocks(monkeypatch, kind, blocks, block_rows, by_block, dlogits_tile, persistent,
                      dx_splits, acc_init):
    monkeypatch.setattr(fck, "DW_PERSISTENT", persistent)
    monkeypatch.setattr(fck, "DX_SPLITS", dx_splits)
    monkeypatch.setattr(rk, "DW_ACC_INIT", acc_init)
    mask = MASKS[kind]
    x, w, ids, b = make(40, 24, 75, torch.float32, True, seed=3)
    res, G_lp, G_ent, seen = _fused_run(monkeypatch, x, w, ids, b, mask, blocks, block_rows, by_block,
                                        dlogits_tile, temperature=0.7, with_entropy=True)
    assert sorted(seen.tolist()) == list(range(40))          # every row handed to grad_fn once
    if by_block:   # whole blocks of original rows
        assert all(set(seen[i * 10:(i + 1) * 10].tolist()) == set(range(i * 10, (i + 1) * 10)) for i in range(4))
    m = mask.double()
    for got, ref in zip(res[:3], golden(x, w, ids, b, 0.7)):
        torch.testing.assert_close(got.double(), ref * m, rtol=1e-5, atol=1e-4)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    out = golden(xr, wr, ids, br, 0.7)
    ((out[0] * G_lp + out[1] * G_ent) * m).sum().backward()
    for got, ref in ((res.d_hidden, xr.grad), (res.d_weight, wr.grad), (res.d_bias, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(res.d_hidden[~mask], torch.zeros_like(res.d_hidden[~mask]))


@pytest.mark.parametrize("kind", ["right_padded", "all_valid"])
def test_fused_dx_many_splits(monkeypatch, kind):
    """One 16 x 16 dX tile a block on 4 interpreter "SMs": the split rule takes S = 4, so each
    row's dX is the sum of four fp32 partials over V (_dx_split_reduce_kernel)."""
    monkeypatch.setattr(fck, "DX_SPLITS", 8)
    mask = MASKS[kind]
    x, w, ids, _ = make(40, 16, 75, torch.float32, False, seed=4)
    res, G_lp, G_ent, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 3, 16, False,
                                     with_entropy=True)
    xr = x.double().requires_grad_()
    out = golden(xr, w, ids, None, 1.0)
    ((out[0] * G_lp + out[1] * G_ent) * mask).sum().backward()
    torch.testing.assert_close(res.d_hidden.double(), xr.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scale,cap", [(1.0, None), (1.7, 3.0)])
def test_fused_half_precision(monkeypatch, scale, cap):
    """16-bit operands: z kept as fp16 d = z - max; error vs the float64 golden of the same
    (rounded) inputs within that of the recompute path's bf16 dlogits (~1e-2 relative)."""
    mask = MASKS["scattered"]
    x, w, ids, _ = make(40, 32, 75, DTYPE_16, False, seed=9)
    res, G_lp, G_ent, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 3, 16, False,
                                     with_entropy=True, logit_scale=scale, softcap=cap)
    assert res.d_hidden.dtype == DTYPE_16 and res.d_weight.dtype == DTYPE_16 and res.d_bias is None
    torch.testing.assert_close(res.logprobs.double(), golden(x, w, ids, None, 1.0, scale, cap)[0] * mask,
                               rtol=0, atol=1e-4)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    out = golden(xr, wr, ids, None, 1.0, scale, cap)
    ((out[0] * G_lp + out[1] * G_ent) * mask).sum().backward()
    for got, ref in ((res.d_hidden, xr.grad), (res.d_weight, wr.grad)):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < 1e-2, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("g", [0.37, 1.0, -2.5])
def test_scale_kernel(monkeypatch, dtype, g):
    """fused.scale_'s Triton body: t *= g in fp32 math, rounded once; g == 1 writes nothing."""
    monkeypatch.setattr(fk, "SCALE_BLOCK", 64)
    monkeypatch.setattr(fk, "_triton_body", lambda t: True)
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(n, generator=gen).to(dtype) for n in (200, 64, 1)]
    want = [(t.float() * g).to(dtype) for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    fk.scale_(ts, torch.tensor(g))
    for t, w, p in zip(ts, want, ptrs):
        assert t.data_ptr() == p
        # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest): one bf16 ulp
        tol = dict(rtol=2**-7, atol=0) if dtype == torch.bfloat16 and g != 1 else dict(rtol=0, atol=0)
        torch.testing.assert_close(t, w, **tol)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lowerings.linear_logprobs.kernels_fused import _dx_splits  # noqa: E402


@triton.jit
def _dx_splits_probe(args_ptr, out_ptr, S_MAX: tl.constexpr, BLOCK_M: tl.constexpr):
    n_split, n_pad = _dx_splits(tl.load(args_ptr), tl.load(args_ptr + 1), tl.load(args_ptr + 2),
                                tl.load(args_ptr + 3), S_MAX, BLOCK_M)
    tl.store(out_ptr, n_split)
    tl.store(out_ptr + 1, n_pad)


@pytest.mark.parametrize("n,h_blocks,sms,max_rows,want", [
    (2048, 16, 132, 3072, 1),   # a full qwen3-8b block on H100: 256 tiles already fill 97%
    (271, 16, 132, 3072, 5),    # its tail: 48 tiles (36%) -> 240 (91%)
    (425, 16, 132, 3072, 2),    # the long shape's tail: 64 tiles -> 128 (97%)
    (1280, 9, 132, 5461, 4),    # gemma2-2b's blocks: 90 tiles (68%) -> 360 (91%)
    (1280, 9, 132, 3640, 1),    # ... unless 4 x 1280 partial rows do not fit
    (0, 16, 132, 3072, 1),      # an empty block
])
def test_dx_splits(n, h_blocks, sms, max_rows, want):
    """The dX step's split count over V (kernels_fused._dx_splits), as its docstring states it."""
    out = torch.zeros(2, dtype=torch.int32)
    _dx_splits_probe[(1,)](torch.tensor([n, h_blocks, sms, max_rows], dtype=torch.int32), out,
                           S_MAX=8, BLOCK_M=128)
    assert out.tolist() == [want, triton.cdiv(n, 128) * 128]
