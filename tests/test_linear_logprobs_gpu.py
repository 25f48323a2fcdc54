"""CUDA tests of linear_logprobs (skipped without a GPU): three-way numerics at the real head
size, determinism, frozen head, no [N, V] allocation, compile with dynamic N.

Three-way idiom (STYLE.md 6): x_ref = float32 upcast reference that materializes the logits,
x_pt = eager PyTorch in bf16 (bf16 logits, fp32 log_softmax: what TRL-style code does), x = ours;
assert err(x) <= 2 * err(x_pt) + floor. Legend: N tokens, H = 4096, V = 151936."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lowerings.linear_logprobs.tuning as tuning
from lowerings.linear_logprobs import linear_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, V = 4096, 151936


def make(n, h=H, v=V, seed=0, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * (2 / h ** 0.5)).bfloat16()  # z ~ N(0, 4)
    b = torch.randn(v, device="cuda", generator=g).bfloat16() if bias else None
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x, w, ids, b


def materialized(x, w, ids, b, temperature, upcast, scale=1.0, cap=None):
    """(logprobs, entropy) from [N, V] logits: fp32 operands if upcast, else bf16 GEMM."""
    z = x.float() @ w.float().T if upcast else (x @ w.T).float()          # [N, V]
    if b is not None:
        z = z + b.float()
    z = z * scale                                   # HF's order: scale, softcap, temperature
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    z = z / temperature
    logp = z.log_softmax(-1)
    return logp.gather(-1, ids[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def err(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("bias,temperature,scale,cap", [(False, 1.0, 1.0, None), (True, 0.7, 1.0, None),
                                                        (True, 0.7, 1.5, 3.0), (False, 1.0, 0.5, None)])
def test_three_way_numerics(bias, temperature, scale, cap):
    """(scale 1.5, cap 3: most logits of std 2 * 1.5 reach the tanh's bend; the HAS_CAP kernels.)"""
    x, w, ids, b = make(1024, bias=bias)
    g_lp = torch.randn(1024, device="cuda")
    g_ent = torch.randn(1024, device="cuda")
    results = {}
    for name in ("ref", "pt", "ours"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        bg = b.clone().requires_grad_() if bias else None
        if name == "ours":
            out = linear_logprobs(xg, wg, ids, bg, temperature=temperature, with_entropy=True,
                                  logit_scale=scale, final_logit_softcapping=cap)
            lp, ent = out.logprobs, out.entropy
        else:
            lp, ent = materialized(xg, wg, ids, bg, temperature, name == "ref", scale, cap)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results[name] = [lp, ent, xg.grad, wg.grad] + ([bg.grad] if bias else [])
    names = ["logprobs", "entropy", "d_hidden", "d_weight", "d_bias"]
    for i, (ref, pt, ours) in enumerate(zip(results["ref"], results["pt"], results["ours"])):
        e, e_pt = err(ours, ref), err(pt, ref)
        assert e <= 2 * e_pt + 1e-5, (names[i], e, e_pt)
        assert torch.isfinite(ours).all()


def test_deterministic_and_frozen_weight():
    x, w, ids, b = make(777, v=50000, bias=True)   # N, V not multiples of any tile
    runs = []
    for _ in range(2):
        xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
        out = linear_logprobs(xg, w, ids, bg, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        runs.append((out.logprobs, out.entropy, xg.grad, bg.grad))
    assert w.grad is None
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def test_no_nv_allocation():
    n = 4096
    x, w, ids, _ = make(n)
    xg, wg = x.requires_grad_(), w.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = linear_logprobs(xg, wg, ids, with_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    torch.cuda.synchronize()
    grads = xg.grad.numel() * 2 + wg.grad.numel() * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    # one row group's fp32 dX accumulator (32 MiB) + the dlogits workspace (24 MiB) + small;
    # N*V*2 = 1.2 GiB
    import lowerings.linear_logprobs.recompute.dense as tk
    assert extra < tuning.DX_GROUP_BYTES + tuning.WS_BYTES + 16 * 2**20, extra / 2**20
    assert extra < n * V * 2 / 8


def test_compile_dynamic_n_matches_eager():
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")

    def loss_fn(x, w, ids):
        out = linear_logprobs(x, w, ids, temperature=0.7, with_entropy=True)
        return (out.logprobs * 2 + out.entropy * 0.1).sum()

    fn = torch.compile(loss_fn, backend=cnt, fullgraph=True)
    for i, n in enumerate((300, 517)):
        x, w, ids, _ = make(n, h=256, v=5000, seed=n)
        torch._dynamo.mark_dynamic(ids, 0)
        grads = []
        for f in (fn, loss_fn):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            # mark the tensor passed in: clone() drops the mark, and a static x would then
            # specialize ids' N through the logprobs.view(ids.shape) (ConstraintViolationError)
            torch._dynamo.mark_dynamic(xg, 0)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                loss = f(xg, wg, ids)
            loss.backward()
            grads.append((loss, xg.grad, wg.grad))
        for a, c in zip(*grads):
            torch.testing.assert_close(a, c, rtol=1e-2, atol=1e-3)
    assert cnt.frame_count == 1


def _peak_beyond_grads(fn, xg, wg):
    """Peak memory of one fwd+bwd beyond inputs and the grads it produces (bytes)."""
    fn(xg, wg).backward()                       # warm-up (compile, cuBLAS workspaces)
    grads = xg.grad.numel() * xg.grad.element_size() + wg.grad.numel() * wg.grad.element_size()
    xg.grad = wg.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(xg, wg).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - grads


def test_compiled_backward_memory_matches_eager():
    """The compiled backward keeps one dW and one fp32 dX buffer (in-place custom ops), like
    eager: no per-chunk [V, H] / [N, H] copies from functionalization."""
    torch._dynamo.reset()
    n = 4096
    x, w, ids, _ = make(n)
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def loss_fn(x, w):
        out = linear_logprobs(x, w, ids, with_entropy=True)
        return (out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager = _peak_beyond_grads(loss_fn, xg, wg)
    compiled = _peak_beyond_grads(torch.compile(loss_fn, fullgraph=True), xg, wg)
    assert compiled < eager + 64 * 2**20, (eager / 2**20, compiled / 2**20)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA operand loads need sm_90+")
def test_tma_matches_pointer_loads(monkeypatch):
    """The TMA and pointer paths of the logits-tile GEMM agree: the forward's log-probs, entropy
    and lse bitwise (the same dots in the same order), the gradients within rounding (their
    GEMM steps may tile differently); N, V not multiples of any tile, so TMA's zero fill
    replaces masks."""
    import lowerings.linear_logprobs.recompute.dense as tk
    x, w, ids, b = make(777, v=50000, bias=True)
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setattr(tuning, "TMA", mode)
        assert tk._use_tma(x, w) == (mode == "1")
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        out = linear_logprobs(xg, wg, ids, bg, temperature=0.7, with_entropy=True)
        (out.logprobs.sum() + (out.entropy * 0.3).sum() + out.lse.sum() * 0.1).backward()
        runs.append((out.logprobs, out.entropy, out.lse, xg.grad, wg.grad, bg.grad))
    for a, c in zip(*runs):   # the forward statistics run the same dots in the same order: bitwise
        torch.testing.assert_close(a, c)
    assert all(torch.equal(a, c) for a, c in zip(runs[0][:3], runs[1][:3])), "forward not bitwise"


def test_tma_scratch_one_buffer_a_stream():
    """Triton's global scratch (in-kernel tensor maps) comes from one buffer a (device, stream):
    reused while big enough, grown when not, its own buffer on another stream, a fresh one
    while a CUDA graph is captured; a kernel using it on a side stream and under graph replay
    gives the default stream's result."""
    import lowerings.linear_logprobs.recompute.dense as tk
    tk._SCRATCH.clear()
    s0 = torch.cuda.current_stream().cuda_stream
    a = tk._tma_alloc(1000, 128, s0)
    assert tk._tma_alloc(600, 128, s0).data_ptr() == a.data_ptr()
    big = tk._tma_alloc(5000, 128, s0)
    assert big.numel() >= 5000 and tk._tma_alloc(10, 128, s0).data_ptr() == big.data_ptr()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert tk._tma_alloc(10, 128, side.cuda_stream).data_ptr() != big.data_ptr()
    x, w, ids, _ = make(300, v=5000)
    want = linear_logprobs(x, w, ids).logprobs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got_side = linear_logprobs(x, w, ids).logprobs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_graph = linear_logprobs(x, w, ids).logprobs
        cached = {t.data_ptr() for t in tk._SCRATCH.values()}
        capture_stream = torch.cuda.current_stream().cuda_stream
        assert tk._tma_alloc(10, 128, capture_stream).data_ptr() not in cached
    graph.replay()
    torch.testing.assert_close(got_side, want, rtol=0, atol=0)
    torch.testing.assert_close(got_graph, want, rtol=0, atol=0)


def _padded_mask(n, t=256, seed=0):
    """A right-padded [n / t, t] batch flattened: completion lengths ~ U[1, t]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n // t,), device="cuda", generator=g)
    return (torch.arange(t, device="cuda")[None, :] < lengths[:, None]).reshape(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_row_mask_three_way(bias, compiled):
    """The row-masked path (recompute/rows.py) on the valid rows against the fp32 reference, three-way
    as above; padded rows: outputs 0, d_hidden 0, whatever their incoming grads (random here)."""
    n = 3072
    x, w, ids, b = make(n, bias=bias)
    mask = _padded_mask(n)
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    fn = lambda *a: linear_logprobs(*a[:4], with_entropy=True, row_mask=a[4])  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    results = {}
    for name in ("ref", "pt", "ours"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        bg = b.clone().requires_grad_() if bias else None
        if name == "ours":
            out = fn(xg, wg, ids, bg, mask)
            lp, ent = out.logprobs, out.entropy
            assert not lp[~mask].any() and not ent[~mask].any()
        else:
            lp, ent = materialized(xg, wg, ids, bg, 1.0, upcast=name == "ref")
            lp, ent = lp * mask, ent * mask
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results[name] = [lp[mask], ent[mask], xg.grad, wg.grad] + ([bg.grad] if bias else [])
    assert not results["ours"][2][~mask].any()
    names = ["logprobs", "entropy", "d_hidden", "d_weight", "d_bias"]
    for i, (ref, pt, ours) in enumerate(zip(results["ref"], results["pt"], results["ours"])):
        e, e_pt = err(ours, ref), err(pt, ref)
        assert e <= 2 * e_pt + 1e-5, (names[i], e, e_pt)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs sm_90+")
def test_row_mask_dx_bulk_reduce_is_the_pointer_sum(monkeypatch):
    """The recompute path's dX step adds its fp32 tile into the group's accumulator by a TMA
    bulk reduce-add (cuda_rows.DX_ACC_TMA) or by load, add, store: the same fp32 sums, so dX,
    dW and d_bias are bitwise equal. N = 3072 at H = 4096, V = 151936: 3 row groups of 1024
    (one with padding) and 9 vocab chunks on an H100 / H200."""
    import lowerings.linear_logprobs.recompute.rows as rk
    n = 3072
    x, w, ids, b = make(n, bias=True, seed=5)
    mask = _padded_mask(n, seed=6)
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    runs = []
    for bulk in (False, True):
        monkeypatch.setattr(rk, "DX_ACC_TMA", bulk)
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        out = linear_logprobs(xg, wg, ids, bg, with_entropy=True, row_mask=mask)
        ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
        runs.append((xg.grad, wg.grad, bg.grad))
    for name, a, c in zip(("d_hidden", "d_weight", "d_bias"), *runs):
        assert torch.equal(a, c), name


def test_row_mask_no_host_sync_and_deterministic():
    """A masked fwd+bwd, eager and compiled, under set_sync_debug_mode("error"); twice: bitwise
    equal; compiled with dynamic N once for two N."""
    cnt = CompileCounterWithBackend("inductor")

    def step(fn, x, w, ids, mask):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch._dynamo.mark_dynamic(xg, 0)                   # clone() drops the mark
        out = fn(xg, wg, ids, mask)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out.logprobs.detach(), xg.grad, wg.grad

    fn = lambda x, w, ids, m: linear_logprobs(x, w, ids, with_entropy=True, row_mask=m)  # noqa: E731
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for n in (2048, 1536):
        x, w, ids, _ = make(n, v=32768)
        mask = _padded_mask(n)
        for t in (ids, mask):                               # N dynamic (x: in step)
            torch._dynamo.mark_dynamic(t, 0)
        for f in (fn, cfn):
            with torch._dynamo.config.patch(error_on_recompile=n != 2048):
                step(f, x, w, ids, mask)                    # compile / autotune outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                a = step(f, x, w, ids, mask)
                b = step(f, x, w, ids, mask)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            for p, q in zip(a, b):
                assert torch.equal(p, q)
    assert cnt.frame_count == 1


def test_row_mask_dx_split_k_tail_group(monkeypatch):
    """The recompute path's dX step splits the vocab columns of a group whose valid rows fill
    at most half its row tiles (cuda_rows.DX_SPLITS). N = 3072 at H = 4096, V = 151936: 1224
    valid rows scattered, so the second 1024-row group holds 200 (2 of its 8 row tiles: 4
    splits) and the third none. dX three-way against the fp32 reference and close to the
    unsplit step's, bitwise the same on a second run, and bitwise the unsplit step's on the
    full first group's rows; dW and d_bias bitwise unchanged."""
    import lowerings.linear_logprobs.recompute.rows as rk
    n = 3072
    x, w, ids, b = make(n, bias=True, seed=9)
    g = torch.Generator(device="cuda").manual_seed(10)
    mask = torch.zeros(n, dtype=torch.bool, device="cuda")
    mask[torch.randperm(n, device="cuda", generator=g)[:1224]] = True
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def grads(fn):
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        lp, ent = fn(xg, wg, bg)
        ((lp * g_lp * mask).sum() + (ent * g_ent * mask).sum()).backward()
        return xg.grad, wg.grad, bg.grad

    def ours(xg, wg, bg):
        out = linear_logprobs(xg, wg, ids, bg, with_entropy=True, row_mask=mask)
        return out.logprobs, out.entropy

    runs = {}
    for split in (False, True, "again"):
        monkeypatch.setattr(rk, "DX_SPLITS", 8 if split else 1)
        runs[split] = grads(ours)
    for a, c in zip(runs[True], runs["again"]):
        assert torch.equal(a, c)
    assert torch.equal(runs[True][1], runs[False][1]) and torch.equal(runs[True][2], runs[False][2])
    assert not runs[True][0][~mask].any()
    first = mask.nonzero()[:1024, 0]                   # the first group: valid rows in order
    assert torch.equal(runs[True][0][first], runs[False][0][first])
    assert err(runs[True][0], runs[False][0]) < 1e-3
    ref = grads(lambda xg, wg, bg: materialized(xg, wg, ids, bg, 1.0, upcast=True))
    pt = grads(lambda xg, wg, bg: materialized(xg, wg, ids, bg, 1.0, upcast=False))
    e, e_pt = err(runs[True][0], ref[0]), err(pt[0], ref[0])
    assert e <= 2 * e_pt + 1e-5, (e, e_pt)
