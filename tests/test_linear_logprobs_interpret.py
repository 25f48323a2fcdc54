"""The Triton kernels of the recompute op (linear_logprobs: recompute/dense.py, recompute/rows.py) under
TRITON_INTERPRET=1, on CPU tensors (the setting, tiles and golden: interpret.py)."""
import pytest
import torch
from interpret import DTYPE_16, MASKS, golden, make, small_tiles, tk, tuning  # noqa: F401 (autouse fixture)

import lowerings.linear_logprobs.recompute.rows as rk


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


@pytest.mark.parametrize("masked", [False, True])
def test_dlogits_grid_size_changes_no_bit(monkeypatch, masked):
    """The dlogits kernel is a persistent grid of one program a SM (device.grid_sms; 4 for CPU
    tensors): a program walks tiles pid, pid + programs, ... . Its gradients are bitwise the same
    for 1, 3 and 7 programs (a tile's values do not depend on which program computes it), d_bias
    included, in the dense and the row-masked (padded rows compacted last) backward."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    x, w, ids, b = make(40, 24, 75, torch.float32, True, seed=7)
    mask = MASKS["scattered"]
    g = torch.Generator().manual_seed(8)
    g_lp, g_ent, g_lse = (torch.randn(40, generator=g) for _ in range(3))
    runs = []
    for programs in (1, 3, 7):
        monkeypatch.setattr(tk, "grid_sms", lambda device, p=programs: p)
        monkeypatch.setattr(rk, "grid_sms", lambda device, p=programs: p)
        if masked:
            lp, ent, lse = rk.forward(x, w, ids, b, mask, 0.7, False, True)
            runs.append(rk.backward(x, w, ids, b, mask, lse, ent, g_lp, g_ent, g_lse, 0.7, False,
                                    True, True, True, True))
        else:
            lp, ent, lse = tk.forward(x, w, ids, b, 0.7, False, True)
            runs.append(tk.backward(x, w, ids, b, lse, ent, g_lp, g_ent, g_lse, 0.7, False, True,
                                    True, True, True))
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


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
    monkeypatch.setattr(tuning, "DX_GROUP_BYTES", group_rows * 24 * 4)
    assert tk._row_groups(40, 24) == groups
    three = tk.backward(*args)
    for a, c in zip(one, three):
        assert a.dtype == c.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        else:   # dW rounded to fp16 after each group instead of once
            err = (c.double() - a.double()).norm() / a.double().norm()
            assert err < 2e-3, err


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("group_rows", [16, 1 << 20])
def test_row_masked_path(monkeypatch, kind, group_rows):
    """cuda_rows (valid rows compacted first, kernels stopping at a device count) against the
    float64 golden on the valid rows; padded rows give 0 outputs, 0 dX rows and nothing in
    dW / d_bias, whatever their incoming grads. group_rows=16: 3 row groups, so the count
    ends inside a group and later groups are empty."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(tuning, "DX_GROUP_BYTES", group_rows * 24 * 4)
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


@pytest.mark.parametrize("n_valid", [5, 20, 40])
def test_row_masked_dx_split_k(monkeypatch, n_valid):
    """A row group whose valid rows fill at most half its row tiles splits each dX tile's vocab
    columns over the idle programs (cuda_rows.DX_SPLITS; kernels.splits._dx_splits' rule with
    16 SMs): one group of 64 rows (4 row tiles of 16, 2 H tiles), 5 valid rows -> 4 splits,
    20 -> 2, 40 -> none; 3 vocab chunks of 32 / 32 / 11
    columns (2, 2, 1 K steps: some splits get no column and add zeros). dX against the
    float64 golden and against the unsplit step: bitwise where the group does not split (40),
    otherwise close and not bitwise (the split ran: its fp32 partials round otherwise); dW and
    d_bias bitwise unchanged; the padded rows' dX stays 0."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    x, w, ids, b = make(64, 24, 75, torch.float32, True, seed=11)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(12))
    mask = torch.zeros(64, dtype=torch.bool)
    mask[perm[:n_valid]] = True
    g = torch.Generator().manual_seed(13)
    g_lp, g_ent, g_lse = (torch.randn(64, generator=g) for _ in range(3))
    lp, ent, lse = rk.forward(x, w, ids, b, mask, 0.7, False, True)
    monkeypatch.setattr(rk, "grid_sms", lambda device: 16)
    runs = {}
    for split in (False, True):
        monkeypatch.setattr(rk, "DX_SPLITS", 8 if split else 1)
        runs[split] = rk.backward(x, w, ids, b, mask, lse, ent, g_lp, g_ent, g_lse, 0.7, False,
                                  True, True, True, True)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    out = golden(xr, wr, ids, br, 0.7)
    ((out[0] * g_lp + out[1] * g_ent + out[2] * g_lse) * mask.double()).sum().backward()
    dx, dw, db = runs[True]
    for got, ref in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, runs[False][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(dx, runs[False][0]) == (n_valid == 40)
    assert torch.equal(dw, runs[False][1]) and torch.equal(db, runs[False][2])
    assert torch.equal(dx[~mask], torch.zeros_like(dx[~mask]))


def test_row_masked_half_no_weight_grad(monkeypatch):
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
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
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
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
    also needs cuda.combine's kernel to guard (m - m_all) * s where s = 0 (not tested here)."""
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


@pytest.mark.parametrize("masked", [False, True])
def test_zero_rows(masked):
    """N = 0 (an empty batch, B = 0 or T = 0) through both launchers: empty outputs, zero dW / d_bias,
    an empty dX (recompute/dense.py divided by the row group's R = 0 when sizing its vocab chunks)."""
    x, w, ids, b = make(0, 24, 75, torch.float32, True)
    if masked:
        mask = torch.zeros(0, dtype=torch.bool)
        fwd = lambda: rk.forward(x, w, ids, b, mask, 0.7, False, True)  # noqa: E731
        bwd = lambda lse, ent, g: rk.backward(x, w, ids, b, mask, lse, ent, g, g, g, 0.7,  # noqa: E731
                                              False, True, True, True, True)
    else:
        fwd = lambda: tk.forward(x, w, ids, b, 0.7, False, True)  # noqa: E731
        bwd = lambda lse, ent, g: tk.backward(x, w, ids, b, lse, ent, g, g, g, 0.7, False, True,  # noqa: E731
                                              True, True, True)
    lp, ent, lse = fwd()
    assert lp.shape == ent.shape == lse.shape == (0,)
    dx, dw, db = bwd(lse, ent, torch.zeros(0))
    assert dx.shape == (0, 24)
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@pytest.mark.parametrize("rows,bias", [(False, True), (True, True), (False, False)])
def test_round_logits_kernels_match_cpu_body(monkeypatch, rows, bias):
    """The kernels' ROUND (round_logits) against the CPU body's rounding on 16-bit operands whose
    products and sums are exact in fp32 (integers times 2^-10: 17 significant bits), so both
    round the same fp32 values: values agree to fp32 transcendental rounding and grads to the
    16-bit rounding of the dlogits, while the rounding moves the log-probs by far more."""
    from lowerings.linear_logprobs import cpu
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    g = torch.Generator().manual_seed(11)
    n, h, v = 40, 24, 75
    x = torch.randint(-64, 65, (n, h), generator=g).to(DTYPE_16)
    w = (torch.randint(-64, 65, (v, h), generator=g) / 1024).to(DTYPE_16)
    b = (torch.randint(-512, 513, (v,), generator=g) / 256).to(DTYPE_16) if bias else None
    ids = torch.randint(0, v, (n,), generator=g)
    mask = MASKS["scattered"] if rows else torch.ones(n, dtype=torch.bool)
    grads = [torch.randn(n, generator=g) for _ in range(3)]
    out = {}
    for rl in (False, True):
        kw = dict(round_logits=rl)
        if rows:
            fwd = rk.forward(x, w, ids, b, mask, 0.7, False, True, **kw)
            bwd = rk.backward(x, w, ids, b, mask, fwd[2], fwd[1], *grads, 0.7, False, True, True,
                              True, bias, **kw)
        else:
            fwd = tk.forward(x, w, ids, b, 0.7, False, True, **kw)
            bwd = tk.backward(x, w, ids, b, fwd[2], fwd[1], *grads, 0.7, False, True, True, True,
                              bias, **kw)
        ref_f = cpu.forward(x, w, ids, b, 0.7, True, **kw)
        ref_b = cpu.backward(x, w, ids, b, ref_f[2], ref_f[1], *grads, 0.7, True, True, True,
                             bias, row_mask=mask, **kw)
        m = mask.float()
        for got, ref in zip(fwd, ref_f):
            torch.testing.assert_close(got.float(), ref.float() * m, rtol=1e-6, atol=2e-5)
        for got, ref in zip(bwd, ref_b):   # a dlogits element's 16-bit rounding may flip
            if got.numel():
                assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-3
        out[rl] = fwd[0]
    assert (out[True] - out[False]).abs().max() > 1e-3


def test_row_masked_exact_tf32_plumbing(monkeypatch):
    """fp32 operands holding bf16 values with the op's fp32_lm_head flag (op.upcast_lm_head):
    the logits GEMMs run one TF32 product (tuning.logits_precision) and the dX / dW steps two, the
    logits gradient split into a rounded TF32 head and its tail (kernels.tiles._dot "tf32x2").
    The interpreter multiplies fp32 exactly, so here the split's sum must give the unsplit
    products' values: logprobs bitwise, grads within fp32 summation-order rounding, and both
    against the float64 golden (the GPU's TF32 products: test_lm_head_precision.py)."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    x, w, ids, b = make(40, 24, 75, torch.float32, True, seed=21)
    x, w = x.bfloat16().float(), w.bfloat16().float()      # bf16 values in fp32
    mask = MASKS["scattered"]
    g = torch.Generator().manual_seed(22)
    g_lp, g_ent, g_lse = (torch.randn(40, generator=g) for _ in range(3))
    runs, launched = {}, {}

    def spy(exact):   # wrap: each launch's kernel and DOT_PREC, then the launch itself
        def wrap(kernel):
            def at(grid):
                def launch(*args, **kwargs):
                    if "DOT_PREC" in kwargs:
                        launched[exact].add((kernel.fn.__name__, kwargs["DOT_PREC"]))
                    return kernel[grid](*args, **kwargs)
                return launch
            return type("Spy", (), {"__getitem__": lambda self, grid: at(grid)})()
        return wrap

    for exact in (False, True):
        launched[exact] = set()
        lp, ent, lse = rk.forward(x, w, ids, b, mask, 0.7, exact, True, wrap=spy(exact))
        grads = rk.backward(x, w, ids, b, mask, lse, ent, g_lp, g_ent, g_lse, 0.7, exact, True,
                            True, True, True, wrap=spy(exact))
        runs[exact] = (lp, ent, lse) + grads
    # the precisions the kernels were launched with: one product for the logits, two for dX / dW
    assert launched[False] == {(k, tuning.FP32_DOT) for k, _ in launched[False]}, launched
    assert len(launched[True]) == 4 and {k: p for k, p in launched[True]} == {
        "_fwd_kernel": "tf32", "_dlogits_kernel": "tf32", "_dx_step_kernel": "tf32x2",
        "_dw_step_persistent_kernel": "tf32x2"}, launched[True]
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][2], runs[False][2])
    for a, c in zip(runs[True][3:], runs[False][3:]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    out = golden(xr, wr, ids, br, 0.7)
    m = mask.double()
    ((out[0] * g_lp + out[1] * g_ent + out[2] * g_lse) * m).sum().backward()
    for got, ref in zip(runs[True][3:], (xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
