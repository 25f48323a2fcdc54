"""The Triton kernels of the fused-gradient block steps (fused/schedule.py with fused/blocks.py's kernels)
under TRITON_INTERPRET=1, on CPU tensors (the setting, tiles and golden: interpret.py): the logits
tile stored as d = z - running max (fp16 for 16-bit operands) plus per-tile maxima, dlogits formed
in place, the Triton dW / dX steps stopping at each block's count. Checked against the float64
golden of sum(G_lp * logprobs + G_ent * entropy) over the valid rows."""
import pytest
import torch
from interpret import DTYPE_16, MASKS, golden, make, small_tiles  # noqa: F401 (autouse fixture)

import lowerings.linear_logprobs.tuning as tuning
import lowerings.linear_logprobs.recompute.dense as tk
import lowerings.linear_logprobs.recompute.rows as rk
import lowerings.linear_logprobs.fused.schedule as fk
import lowerings.linear_logprobs.fused.blocks as fck
import lowerings.linear_logprobs.fused.steps as fsteps
import triton
import triton.language as tl
from lowerings.linear_logprobs.kernels.splits import _dx_splits


def _fused_run(monkeypatch, x, w, ids, b, mask, blocks, block_rows, whole_blocks,
               dlogits_tile=(16, 16, 1), **kw):
    """whole_blocks: block b takes its R original rows [b R, (b + 1) R) (a grouped plan of those
    groups, as whole sequences get); else the global valid-first order. Returns the result, the
    random incoming gradients and the rows grad_fn saw: every row in slot order (global order),
    or each block's valid rows (whole blocks: its other slots are masked by the caller)."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(tuning, "DW_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    monkeypatch.setattr(fck, "DLOGITS_TILE", dlogits_tile)
    monkeypatch.setattr(fsteps, "_triton_body", lambda t: True)
    g = torch.Generator().manual_seed(11)
    G_lp, G_ent = torch.randn(x.shape[0], generator=g), torch.randn(x.shape[0], generator=g)
    seen = []

    def grad_fn(r0, idx, lp, ent):
        seen.append((r0, idx.clone()))   # the blocks run last to first
        return G_lp[idx], G_ent[idx]

    if whole_blocks:
        kw["plan"] = fk.order_rows_grouped(mask, torch.arange(x.shape[0]) // block_rows, blocks,
                                           block_rows)
    res = fk.fused_linear_logprobs(x, w, ids, b, mask, grad_fn, blocks=blocks,
                                   block_rows=block_rows, need_b=b is not None, **kw)
    in_order = [i for _, i in sorted(seen, key=lambda s: s[0])]
    if whole_blocks:
        counts = kw["plan"][1].tolist()
        return res, G_lp, G_ent, [i[:c] for i, c in zip(in_order, counts)]
    # token-level blocks are G x R slots; those past N (row 0 again, past every count) are dropped
    return res, G_lp, G_ent, torch.cat(in_order)[:x.shape[0]]


def _assert_seen(seen, mask, whole_blocks):
    """Every row handed to grad_fn once (global order); whole blocks: each block's valid rows,
    those of its 10 original rows, in row order."""
    if whole_blocks:
        for i, rows in enumerate(seen):
            want = torch.arange(i * 10, (i + 1) * 10)
            assert torch.equal(rows, want[mask[want]])
    else:
        assert sorted(seen.tolist()) == list(range(40))


@pytest.mark.parametrize("kind", ["right_padded", "scattered", "all_valid", "all_padded"])
@pytest.mark.parametrize("blocks,block_rows,whole_blocks,dlogits_tile", [
    (1, 40, False, (16, 16, 1)), (3, 16, False, (16, 16, 1)), (4, 10, True, (16, 16, 1)),
    (3, 16, False, (8, 32, 1))])   # dlogits tiles wider than the stored-max tiles: per-column maxima
# DX_SPLITS: 1 = one K loop, 8 = split over V where the dX grid is small (here always: 4 "SMs"
# in the interpreter, device.grid_sms), partials summed by the reduce kernel
@pytest.mark.parametrize("dx_splits", [1, 8])
def test_fused_blocks(monkeypatch, kind, blocks, block_rows, whole_blocks, dlogits_tile, dx_splits):
    monkeypatch.setattr(fck, "DX_SPLITS", dx_splits)
    mask = MASKS[kind]
    x, w, ids, b = make(40, 24, 75, torch.float32, True, seed=3)
    res, G_lp, G_ent, seen = _fused_run(monkeypatch, x, w, ids, b, mask, blocks, block_rows, whole_blocks,
                                        dlogits_tile, temperature=0.7, with_entropy=True)
    _assert_seen(seen, mask, whole_blocks)
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
@pytest.mark.parametrize("per_sm", [0, 4])   # one program striding over every chunk; one a chunk
def test_scale_kernel(monkeypatch, dtype, g, per_sm):
    """fused_steps.scale_'s Triton body: t *= g in fp32 math, rounded once; g == 1 writes nothing."""
    monkeypatch.setattr(fsteps, "SCALE_BLOCK", 64)
    monkeypatch.setattr(fsteps, "SCALE_PER_SM", per_sm)
    monkeypatch.setattr(fsteps, "_triton_body", lambda t: True)
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(n, generator=gen).to(dtype) for n in (200, 64, 1)]
    want = [(t.float() * g).to(dtype) for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    fsteps.scale_(ts, torch.tensor(g))
    for t, w, p in zip(ts, want, ptrs):
        assert t.data_ptr() == p
        # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest): one bf16 ulp
        tol = dict(rtol=2**-7, atol=0) if dtype == torch.bfloat16 and g != 1 else dict(rtol=0, atol=0)
        torch.testing.assert_close(t, w, **tol)


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
    (271, 16, 132, 1024, 2),    # recompute: a 1024-row group's 271-row tail, its 8 row slots
    (200, 16, 132, 1024, 4),    # ... 200 rows: 2 row tiles -> 4 splits fill 97%
    (600, 16, 132, 1024, 1),    # ... 5 of 8 row tiles: no 2 x 640 rows of slots
])
def test_dx_splits(n, h_blocks, sms, max_rows, want):
    """The dX step's split count over V (kernels.splits._dx_splits), as its docstring states it: the
    fused path's partials buffer or the recompute path's row slots bound it (max_rows)."""
    out = torch.zeros(2, dtype=torch.int32)
    _dx_splits_probe[(1,)](torch.tensor([n, h_blocks, sms, max_rows], dtype=torch.int32), out,
                           S_MAX=8, BLOCK_M=128)
    assert out.tolist() == [want, triton.cdiv(n, 128) * 128]


@pytest.mark.parametrize("seed", range(2))
def test_first_fit_kernel(seed):
    """fused_order.first_fit_blocks' CUDA body (_first_fit_kernel, one program sequential over
    the sequences, 8 lengths a load here: several chunks, the last partial) = its CPU loop, on
    first-fit-decreasing orders of random lengths (zeros included) and next_fit_blocks' block
    counts, BLOCK_G past G too."""
    import random
    from lowerings.linear_logprobs.fused.order import first_fit_blocks, next_fit_blocks
    from lowerings.linear_logprobs.kernels.fused_block import _first_fit_kernel
    rng = random.Random(seed)
    for _ in range(25):
        bound = rng.randint(1, 40)
        rows = rng.randint(bound, 100)
        lengths = torch.tensor([rng.choice([0, rng.randint(0, bound)])
                                for _ in range(rng.randint(1, 30))])
        blocks = next_fit_blocks(lengths.numel(), int(lengths.sum()), rows, bound)
        lengths = lengths.sort(descending=True, stable=True).values
        out = torch.full_like(lengths, -1)
        _first_fit_kernel[(1,)](lengths, out, lengths.numel(), rows, blocks,
                                BLOCK_G=triton.next_power_of_2(max(blocks, 2)), CHUNK=8)
        assert out.tolist() == first_fit_blocks(lengths, rows, blocks).tolist()


def _no_dlogits_pass(*a, **k):
    raise AssertionError("the exp-scaled backward launched the dlogits pass")


class _NoLaunch:
    def __getitem__(self, grid):
        return _no_dlogits_pass


_LAYOUTS = [(1, 40, False), (3, 16, False), (4, 10, True)]   # (blocks, block_rows, whole_blocks)
_KINDS = ["right_padded", "scattered", "all_valid", "all_padded"]
# fused_cuda's (E_LEAD, E_HEADROOM): the defaults (every row stored against its target logit +
# 16), over every mask and layout with the dX step split 8 ways, and unsplit on two masks; a
# headroom of 1, under which most rows' maxima pass M + 1: their tiles are stored against their
# own maxima and the combine kernel re-references them (rows of both kinds in one program), over
# every mask with valid rows on the two multi-block layouts; a lead of -inf, M = -inf (what a
# NaN target logit becomes): every row re-referenced, on two of them. (26 cases: each runs ~5 s
# in the interpreter, and CI's 2 cores had 38 of them.)
# The last field: the combine grid's column shares (fused_cuda.COMBINE_SHARES, with no least
# tiles a share) over V = 75's 5 tiles: 16 (5 shares of one tile), 3 (2, 2, 1), 2 (3, 2)
_EXP_CASES = ([(k, *lay, 8, 16.0, 32.0, 16) for k in _KINDS for lay in _LAYOUTS]
              + [(k, *lay, 1, 16.0, 32.0, 2) for k in ("scattered", "all_valid") for lay in _LAYOUTS]
              + [(k, *lay, 8, 0.5, 1.0, 3) for k in _KINDS[:3] for lay in _LAYOUTS[1:]]
              + [(k, 3, 16, False, 1, float("-inf"), 32.0, sh)
                 for k, sh in (("right_padded", 1), ("all_valid", 2))])   # 1: one walks all


@pytest.mark.parametrize("kind,blocks,block_rows,whole_blocks,dx_splits,lead,headroom,shares",
                         _EXP_CASES)
def test_fused_exp_scaled(monkeypatch, kind, blocks, block_rows, whole_blocks, dx_splits, lead,
                          headroom, shares):
    """The exp-scaled backward (fused.exp_scaled: no entropy gradient, no softcap, no d_bias):
    ws holds e = exp(z - R*), the dlogits are c * e' (the target's entry replaced), applied as
    dX rows' scale and to X's rows before dW; the dlogits pass is never launched. Entropy is
    still an output (with_entropy, entropy_grad=False): its g_ent is ignored."""
    monkeypatch.setattr(fck, "DX_SPLITS", dx_splits)
    monkeypatch.setattr(fck, "E_LEAD", lead)
    monkeypatch.setattr(fck, "E_HEADROOM", headroom)
    monkeypatch.setattr(fck, "COMBINE_SHARES", shares)
    monkeypatch.setattr(fck, "COMBINE_MIN_TILES", 1)
    monkeypatch.setattr(fck, "_fused_dlogits_kernel", _NoLaunch())
    mask = MASKS[kind]
    x, w, ids, _ = make(40, 24, 75, torch.float32, False, seed=3)
    res, G_lp, _, seen = _fused_run(monkeypatch, x, w, ids, None, mask, blocks, block_rows,
                                    whole_blocks, temperature=0.7, logit_scale=1.3,
                                    with_entropy=True, entropy_grad=False)
    _assert_seen(seen, mask, whole_blocks)
    m = mask.double()
    for got, ref in zip(res[:3], golden(x, w, ids, None, 0.7, 1.3)):
        torch.testing.assert_close(got.double(), ref * m, rtol=1e-5, atol=1e-4)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (golden(xr, wr, ids, None, 0.7, 1.3)[0] * G_lp * m).sum().backward()
    for got, ref in ((res.d_hidden, xr.grad), (res.d_weight, wr.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(res.d_hidden[~mask], torch.zeros_like(res.d_hidden[~mask]))


def test_fused_exp_scaled_far_targets(monkeypatch):
    """Logits spread over hundreds (weights x 30) and targets drawn from the least likely
    tokens: logp[y] down to ~-500, so the rows' maxima pass M + E_HEADROOM and are re-referenced
    (kernels.combine._combine_kernel); the rows whose target is the argmax are not. Gradients still match the
    float64 golden (the dlogits of such rows are ~g_lp * (onehot - onehot(argmax)))."""
    monkeypatch.setattr(fck, "_fused_dlogits_kernel", _NoLaunch())
    x, w, _, _ = make(40, 24, 75, torch.float32, False, seed=5)
    w = w * 30
    z = x.double() @ w.double().T
    ids = torch.where(torch.arange(40) % 3 == 0, z.argmax(-1), z.argmin(-1))
    mask = MASKS["scattered"]
    res, G_lp, _, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 3, 16, False)
    lp_ref = golden(x, w, ids, None, 1.0)[0]
    assert lp_ref[mask].min() < -200
    torch.testing.assert_close(res.logprobs.double(), lp_ref * mask, rtol=1e-5, atol=1e-3)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (golden(xr, wr, ids, None, 1.0)[0] * G_lp * mask).sum().backward()
    for got, ref in ((res.d_hidden, xr.grad), (res.d_weight, wr.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("with_entropy,entropy_grad,cap,bias,dtype,rnd,want", [
    (False, True, None, False, torch.float32, False, True),      # no entropy at all
    (True, False, None, False, torch.float32, False, True),      # entropy an output only
    (True, True, None, False, torch.float32, False, False),      # an entropy term in the loss
    (False, False, 3.0, False, torch.float32, False, False),     # softcap: (1 - y^2) per element
    (False, False, None, True, torch.float32, False, False),     # d_bias: the dlogits' column sums
    (False, False, None, False, torch.float16, False, False),    # fp16: e's range does not fit
    (False, False, None, False, torch.bfloat16, False, True),    # bf16
    # round_logits: the contract rounds the logits gradient (TRL's head), which this never forms
    (False, False, None, False, torch.bfloat16, True, False),
])
def test_exp_scaled_rule(with_entropy, entropy_grad, cap, bias, dtype, rnd, want):
    """Which calls take the exp-scaled backward (fused.exp_scaled); vocab shards never do."""
    assert fk.exp_scaled(dtype, with_entropy and entropy_grad, cap, bias, None, rnd) is want
    assert fk.exp_scaled(dtype, with_entropy and entropy_grad, cap, bias, lambda *a: a, rnd) is False


def test_fused_allow_scaled_false_keeps_the_dlogits_pass(monkeypatch):
    """allow_scaled=False (GRPOConfig.fused_scaled_backward=False) where the exp-scaled backward
    would apply: the dlogits pass runs and the exp-scaled kernels never launch."""
    monkeypatch.setattr(fck, "_exp_prep_kernel", _NoLaunch())
    monkeypatch.setattr(fck, "_target_ref_kernel", _NoLaunch())
    mask = MASKS["scattered"]
    x, w, ids, _ = make(40, 24, 75, torch.float32, False, seed=3)
    res, G_lp, _, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 3, 16, False,
                                 allow_scaled=False)
    xr = x.double().requires_grad_()
    (golden(xr, w, ids, None, 1.0)[0] * G_lp * mask).sum().backward()
    torch.testing.assert_close(res.d_hidden.double(), xr.grad, rtol=1e-4, atol=1e-4)


# Packed whole sequences (compiled_grpo's sequence-coupled losses on cu_seqlens inputs): groups of
# rows of any size, k of them a block, each block in R slots of its own (fk.order_rows_grouped).
# 40 rows in sequences of 7, 3, 9, 0, 12, 5, 4 tokens, two a block: blocks of 10, 9, 17 and 4
# rows in 4 x 20 slots, so every block has slots past its rows (perm 0 there, never read).
_GROUP_LENGTHS = [7, 3, 9, 0, 12, 5, 4]


@pytest.mark.parametrize("kind", ["right_padded", "scattered", "all_valid", "all_padded"])
@pytest.mark.parametrize("scaled", [False, True])
def test_fused_grouped_plan(monkeypatch, kind, scaled):
    """The Triton block steps on a grouped plan: the gradients of the valid rows, every row's
    outputs back in place through the plan's slots, padded rows' dX zero."""
    monkeypatch.setattr(fck, "DX_SPLITS", 8)
    if scaled:
        monkeypatch.setattr(fck, "_fused_dlogits_kernel", _NoLaunch())
    mask = MASKS[kind]
    x, w, ids, _ = make(40, 24, 75, torch.float32, False, seed=6)
    seq = torch.repeat_interleave(torch.arange(7), torch.tensor(_GROUP_LENGTHS))   # [40]
    plan = fk.order_rows_grouped(mask, seq // 2, 4, 20)
    res, G_lp, G_ent, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 4, 20, False,
                                     temperature=0.7, with_entropy=True, entropy_grad=not scaled,
                                     plan=plan)
    m = mask.double()
    for got, ref in zip(res[:3], golden(x, w, ids, None, 0.7)):
        torch.testing.assert_close(got.double(), ref * m, rtol=1e-5, atol=1e-4)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    out = golden(xr, wr, ids, None, 0.7)
    (((out[0] * G_lp + (0 if scaled else out[1] * G_ent)) * m).sum()).backward()
    for got, ref in ((res.d_hidden, xr.grad), (res.d_weight, wr.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(res.d_hidden[~mask], torch.zeros_like(res.d_hidden[~mask]))


def test_order_rows_grouped():
    """The plan itself: each group's valid rows in their block's slots, in row order, then perm
    0; masked rows take no slot (slot G R, the 0 after the blocks); counts the valid rows; slot
    the inverse of perm on the valid rows."""
    mask = MASKS["scattered"]
    seq = torch.repeat_interleave(torch.arange(7), torch.tensor(_GROUP_LENGTHS))
    blk = seq // 2
    perm, counts, slot = fk.order_rows_grouped(mask, blk, 4, 20)
    assert perm.shape == (80,) and counts.dtype == torch.int32
    assert torch.equal(slot[~mask], torch.full_like(slot[~mask], 80))
    assert torch.equal(perm.index_select(0, slot[mask]), torch.arange(40)[mask])
    for b in range(4):
        rows = (blk == b).nonzero()[:, 0]
        want = rows[mask[rows]]
        got = perm[b * 20: b * 20 + 20]
        assert torch.equal(got[: len(want)], want) and not got[len(want):].any()
        assert counts[b] == mask[rows].sum()


def test_fused_zero_rows(monkeypatch):
    """N = 0 (an empty batch) through the fused block steps' Triton body: empty outputs, zero dW
    and d_bias, an empty dX."""
    monkeypatch.setattr(fsteps, "_triton_body", lambda t: True)
    x, w, ids, b = make(0, 24, 75, torch.float32, True)
    res = fk.fused_linear_logprobs(x, w, ids, b, torch.zeros(0, dtype=torch.bool),
                                   lambda r0, idx, lp, ent: (lp, ent), blocks=1, block_rows=16,
                                   need_b=True)
    assert res.logprobs.shape == (0,) and res.d_hidden.shape == (0, 24)
    assert torch.equal(res.d_weight, torch.zeros_like(w)) and torch.equal(res.d_bias, torch.zeros_like(b))


@pytest.mark.parametrize("cap", [None, 3.0])
def test_fused_round_logits_recomputes_the_forward_logits(monkeypatch, cap):
    """round_logits on the fused Triton blocks (fp32 leaves multiplied in fp16, as the TRL drop-in
    under autocast): the dlogits pass recomputes the forward's rounded logits exactly (they are
    stored as themselves, fused_cuda._z_view), so the grads are the recompute kernels' to fp32
    summation order. Stored as d = z - max in fp16 (the default path's workspace) they were
    off by |d| 2^-11 where p is small: 4.8e-5 in dX and dW on an H100 (trl_head_probe.py)."""
    monkeypatch.setattr(tuning, "GEMM_TILES", {k: (16, 16, 16, 1, 1) for k in (2, 4, 8)})
    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 24, 75
    x = (torch.randn(n, h, generator=g) * 2).to(DTYPE_16).float()
    w = (torch.randn(v, h, generator=g) / h ** 0.5 * 3).to(DTYPE_16).float()
    ids = torch.randint(0, v, (n,), generator=g)
    mask = MASKS["scattered"]
    kw = dict(softcap=cap, round_logits=True, compute_dtype=DTYPE_16)
    res, G_lp, _, _ = _fused_run(monkeypatch, x, w, ids, None, mask, 3, 16, False, temperature=0.7,
                                 allow_scaled=False, **kw)
    lp, ent, lse = tk.forward(x, w, ids, None, 0.7, False, False, **kw)
    zero = torch.zeros(n)
    dx, dw, _ = tk.backward(x, w, ids, None, lse, ent, G_lp * mask, zero, zero, 0.7, False, False,
                            True, True, False, **kw)
    assert torch.equal(res.logprobs, lp * mask)
    for got, ref in ((res.d_hidden, dx), (res.d_weight, dw)):
        assert got.dtype == torch.float32
        assert float((got - ref).norm() / ref.norm()) < 2e-6
