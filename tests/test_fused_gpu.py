"""grpo_loss's fused-gradient mode on CUDA (skipped without a GPU): bf16 numerics three-way
against the fp32-upcast reference, no host sync, bitwise repeatability, compiled == eager, and
the incoming gradient's scaling of the stored gradients."""
import pytest
import torch

import compiled_grpo as cg
import lowerings.linear_logprobs.tuning as tuning

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gpu_inputs(B=4, T=256, Hd=4096, Vd=151936, seed=0, p_valid=0.6):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, T, Hd, device="cuda", generator=g).bfloat16()
    w = (torch.randn(Vd, Hd, device="cuda", generator=g) * (2 / Hd ** 0.5)).bfloat16()   # z ~ N(0, 4)
    ids = torch.randint(0, Vd, (B, T), device="cuda", generator=g)
    lengths = (torch.rand(B, device="cuda", generator=g) * T * 2 * p_valid).long().clamp(1, T)
    mask = torch.arange(T, device="cuda")[None, :] < lengths[:, None]
    with torch.no_grad():
        lp = cg.token_logprobs(x, w, ids, mask=mask).logprobs
    old = lp + 0.1 * torch.randn(B, T, device="cuda", generator=g)
    ref = lp + 0.1 * torch.randn(B, T, device="cuda", generator=g)
    adv = torch.randn(B, device="cuda", generator=g)
    return dict(hidden=x, weight=w, token_ids=ids, advantages=adv, mask=mask, old_logprobs=old, ref_logprobs=ref)


def _bf16_logprobs(hidden, weight, token_ids, bias=None, *, mask=None, temperature=1.0, with_entropy=False, **_):
    """TRL-style eager code: bf16 logits [.., V], fp32 log_softmax (the 'same-dtype eager' leg)."""
    from lowerings.linear_logprobs import LinearLogprobs
    z = (hidden @ weight.T).float() / temperature
    logp = z.log_softmax(-1)
    ids = torch.where(mask, token_ids, 0)
    lp = torch.where(mask, logp.gather(-1, ids[..., None])[..., 0], 0)
    ent = torch.where(mask, -(logp.exp() * logp).sum(-1), 0) if with_entropy else None
    return LinearLogprobs(lp, ent, lp)


def _three_way(inp, **kw):
    """Relative errors of (loss, d_hidden, d_weight) against the fp32-upcast reference of eager
    bf16 ("pt"), the recompute mode and the fused mode of grpo_loss (config fields kw)."""
    from compiled_grpo.api import _grpo_loss
    from compiled_grpo.reference import reference_grpo_loss
    res = {}
    for name in ("ref", "pt", "recompute", "fused"):
        mode = "fused" if name == "fused" else "recompute"
        cfg = cg.GRPOConfig(gradient_mode=mode, **kw)
        h = inp["hidden"].clone().requires_grad_()
        w = inp["weight"].clone().requires_grad_()
        args = dict(inp, hidden=h, weight=w)
        if name == "ref":
            out = reference_grpo_loss(**args, config=cfg)
        elif name == "pt":
            out = _grpo_loss(_bf16_logprobs, **args, config=cfg)
        else:
            out = cg.grpo_loss(**args, config=cfg)
        out.loss.backward()
        res[name] = (out.loss.detach().float(), h.grad.float(), w.grad.float())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {what: {k: rel(res[k][i], res["ref"][i]) for k in ("pt", "recompute", "fused")}
            for i, what in enumerate(("loss", "d_hidden", "d_weight"))}


@pytest.mark.parametrize("level", ["token", "sequence"])
# an entropy bonus: the in-place dlogits pass; none: the exp-scaled backward (fused.exp_scaled),
# or the pass again with fused_scaled_backward=False
@pytest.mark.parametrize("entropy_coef,scaled", [(0.01, True), (0.0, True), (0.0, False)])
def test_three_way_gpu(level, entropy_coef, scaled):
    """Fused-mode grads of grpo_loss (bf16, H=4096, V=151936, 60% valid, 3 row blocks) against
    the fp32-upcast reference: within 2x of eager bf16's error, and of the recompute path's."""
    errs = _three_way(_gpu_inputs(), loss_type="grpo", beta=0.04, entropy_coef=entropy_coef,
                      importance_sampling_level=level, fused_workspace_mib=400.0,
                      fused_scaled_backward=scaled)
    print(level, entropy_coef, scaled, errs)
    for what, e in errs.items():
        assert e["fused"] <= 2 * e["pt"] + 1e-5, (what, e)
        assert e["fused"] <= 2 * e["recompute"] + 1e-5, (what, e)


def test_three_way_gpu_narrow_h():
    """H = 896 (qwen2.5-0.5b), whose dW step takes 128-wide H tiles (dw_steps.dw_ws_tiles):
    within 2x of eager bf16's error and of the recompute path's, and the dW bits of the 256-wide
    tiles (each element's K sum is the same MMAs in the same order)."""
    from lowerings.linear_logprobs.recompute import dw_steps
    assert dw_steps.dw_ws_tiles(896) == dw_steps.DW_WS_TILES_NARROW
    assert dw_steps.dw_ws_tiles(4096) == dw_steps.DW_WS_TILES
    inp = _gpu_inputs(Hd=896)
    errs = _three_way(inp, loss_type="grpo", beta=0.04, fused_workspace_mib=400.0)
    print(errs)
    for what, e in errs.items():
        assert e["fused"] <= 2 * e["pt"] + 1e-5, (what, e)
        assert e["fused"] <= 2 * e["recompute"] + 1e-5, (what, e)

    def dw(tiles):
        w = inp["weight"].clone().requires_grad_()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dw_steps, "dw_ws_tiles", lambda h: tiles)
            cg.grpo_loss(**dict(inp, weight=w), config=cg.GRPOConfig(
                gradient_mode="fused", fused_workspace_mib=100.0)).loss.backward()   # 3 blocks
        return w.grad
    assert torch.equal(dw(dw_steps.DW_WS_TILES_NARROW), dw(dw_steps.DW_WS_TILES))


def _fused_grads(inp: dict, fast_launch: bool) -> tuple:
    """(loss, dX, dW) of grpo_loss's fused step (3 blocks: a 100 MiB workspace), the second of
    two calls, with fast_launch.ENABLED set to `fast_launch` (on: the second call's launches all
    take the compiled launcher). Also bench/probes/fast_launch.py's check."""
    import lowerings.linear_logprobs.launching.fast as fl
    h, w = inp["hidden"].clone().requires_grad_(), inp["weight"].clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fl, "ENABLED", fast_launch)
        for _ in range(2):
            h.grad = w.grad = None
            out = cg.grpo_loss(**dict(inp, hidden=h, weight=w), config=cg.GRPOConfig(
                gradient_mode="fused", fused_workspace_mib=100.0, beta=0.04))
            out.loss.backward()
    return out.loss.detach(), h.grad, w.grad


def test_fast_launch_is_bitwise_tritons():
    """fast_launch (the compiled launcher after a key's first launch) against Triton's own launch
    path: loss and grads bitwise equal, H = 896 and 4096, 3 blocks, the second call of each on
    the launcher throughout."""
    import lowerings.linear_logprobs.launching.fast as fl
    for hd in (896, 4096):
        inp = _gpu_inputs(Hd=hd)
        got = [_fused_grads(inp, on) for on in (True, False)]
        assert any(launcher.compiled for launcher in fl._LAUNCHERS.values())
        for a, b in zip(*got):
            assert torch.equal(a, b), hd


def test_three_way_gpu_far_targets():
    """The exp-scaled backward where rows are stored against their own maxima: logits ~N(0, 400)
    and half the targets the least likely token (logp ~ -180: far past the target + E_LEAD +
    E_HEADROOM reference, so those rows are re-referenced by the combine kernel), the other half
    the most likely one (stored against the reference), bf16."""
    inp = _gpu_inputs(B=2, T=256)
    inp["weight"] = (inp["weight"].float() * 10).bfloat16()
    with torch.no_grad():
        z = (inp["hidden"] @ inp["weight"].T).float()
        far = torch.arange(z.shape[1], device="cuda")[None, :] % 2 == 0
        inp["token_ids"] = torch.where(far, z.argmin(-1), z.argmax(-1))
        lp = cg.token_logprobs(inp["hidden"], inp["weight"], inp["token_ids"], mask=inp["mask"]).logprobs
    assert lp[inp["mask"] & far].max() < -60
    inp["old_logprobs"], inp["ref_logprobs"] = lp + 0.05, lp - 0.05
    errs = _three_way(inp, loss_type="dapo", beta=0.04, fused_workspace_mib=400.0)
    print(errs)
    for what, e in errs.items():
        assert e["fused"] <= 2 * e["recompute"] + 1e-5, (what, e)


def _packed_gpu(inp):
    """The padded inputs' valid tokens packed (cu_seqlens; the mask is a prefix of each row)."""
    keep = inp["mask"]
    lengths = keep.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    packed = {k: (v[keep] if torch.is_tensor(v) and v.dim() >= 2 and k != "weight" else v)
              for k, v in inp.items()}
    return dict(packed, cu_seqlens=cu)


@pytest.mark.parametrize("loss_type,scaled", [("grpo", True), ("grpo", False), ("dapo", True)])
def test_three_way_gpu_packed_gspo(loss_type, scaled, monkeypatch):
    """GSPO on packed inputs (cu_seqlens, max_seqlen = T): whole sequences first-fit decreasing into blocks
    (fused_order.pack_sequences, order_rows_grouped; 200 MiB holds 640 rows: ~1200 tokens in 2-3
    blocks), bf16, H=4096, V=151936: within 2x of eager bf16's error and of the recompute
    path's; bitwise repeatable and free of host syncs."""
    import compiled_grpo.fused as F
    plans = []
    real = F._op.order_rows_grouped
    monkeypatch.setattr(F._op, "order_rows_grouped", lambda *a: plans.append(a[2]) or real(*a))
    inp = dict(_packed_gpu(_gpu_inputs(B=8, T=256, seed=5)), max_seqlen=256)
    kw = dict(loss_type=loss_type, beta=0.04, importance_sampling_level="sequence",
              fused_workspace_mib=200.0, fused_scaled_backward=scaled)
    errs = _three_way(inp, **kw)
    print(loss_type, scaled, errs)
    for what, e in errs.items():
        assert e["fused"] <= 2 * e["pt"] + 1e-5, (what, e)
        assert e["fused"] <= 2 * e["recompute"] + 1e-5, (what, e)
    assert plans and all(g >= 2 for g in plans), plans
    cfg = cg.GRPOConfig(gradient_mode="fused", **kw)
    assert F.why_not_fused(inp["hidden"], inp["weight"], cfg, object(), None, max_seqlen=256) is None

    def step():
        h = inp["hidden"].clone().requires_grad_()
        w = inp["weight"].clone().requires_grad_()
        out = cg.grpo_loss(**dict(inp, hidden=h, weight=w), config=cfg)
        out.loss.backward()
        return out.loss.detach(), out.logprobs, h.grad, w.grad

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, b = step(), step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])   # the dlogits pass; the exp-scaled backward
def test_fused_gpu_no_host_sync_deterministic_and_compiled(entropy_coef):
    """Eager under set_sync_debug_mode("error"), twice bitwise equal; compiled (fullgraph) equal
    to eager within bf16 rounding of dW."""
    inp = _gpu_inputs(B=4, T=512, seed=1)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, entropy_coef=entropy_coef, fused_workspace_mib=400.0,
                        metrics="with_entropy")

    def step(fn):
        h = inp["hidden"].clone().requires_grad_()
        w = inp["weight"].clone().requires_grad_()
        loss = fn(**dict(inp, hidden=h, weight=w))
        loss.backward()
        return loss.detach(), h.grad, w.grad

    eager = lambda **a: cg.grpo_loss(**a, config=cfg).loss  # noqa: E731
    step(eager)                                    # warm-up (Triton compiles, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = step(eager)
        b = step(eager)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = step(torch.compile(eager, fullgraph=True))
    torch.testing.assert_close(c[0], a[0], rtol=1e-5, atol=1e-6)
    for x, y in zip(c[1:], a[1:]):
        assert ((x.float() - y.float()).norm() / y.float().norm()) < 1e-2


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])   # the dlogits pass; the exp-scaled backward
def test_fused_step_replays_as_a_cuda_graph(entropy_coef):
    """The fused step (forward and backward) captured once with torch.cuda.graph, then replayed
    on other inputs copied into the captured ones (another mask too: the blocks' valid counts
    are read on the device): loss and gradients bitwise equal to an eager step on those inputs.
    What a host-bound small policy needs (docs/performance.md, "Small policies and the host")."""
    a, b = _gpu_inputs(B=4, T=512, seed=3), _gpu_inputs(B=4, T=512, seed=4)
    assert not torch.equal(a["mask"], b["mask"])
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, entropy_coef=entropy_coef,
                        fused_workspace_mib=400.0, metrics="with_entropy")
    static = {k: v.clone() for k, v in a.items()}
    h, w = static["hidden"].requires_grad_(), static["weight"].requires_grad_()

    def step():
        h.grad = w.grad = None
        loss = cg.grpo_loss(**dict(static, hidden=h, weight=w), config=cfg).loss
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up off the capturing stream, as torch.cuda.graph asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    with torch.no_grad():
        for k, v in b.items():
            static[k].copy_(v)
    graph.replay()
    hb, wb = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    loss_b = cg.grpo_loss(**dict(b, hidden=hb, weight=wb), config=cfg).loss
    loss_b.backward()
    torch.cuda.synchronize()
    assert torch.equal(loss, loss_b.detach())
    assert torch.equal(h.grad, hb.grad) and torch.equal(w.grad, wb.grad)


def test_incoming_gradient_scales_stored_grads():
    """(c * loss).backward() gives c times loss.backward()'s grads (fused_steps.scale_: one fp32 pass
    when c != 1, none when c == 1), to bf16 rounding."""
    inp = _gpu_inputs(B=2, T=512, seed=2)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, fused_workspace_mib=400.0)
    grads = {}
    for c in (1.0, 0.37):
        h = inp["hidden"].clone().requires_grad_()
        w = inp["weight"].clone().requires_grad_()
        (c * cg.grpo_loss(**dict(inp, hidden=h, weight=w), config=cfg).loss).backward()
        grads[c] = (h.grad.float(), w.grad.float())
    for one, scaled in zip(grads[1.0], grads[0.37]):
        torch.testing.assert_close(scaled, 0.37 * one, rtol=2**-7, atol=1e-30)
    # the scaled gradients are not reused: a second backward through the graph is an error
    # (the Triton scaling runs as the mutating custom op compiled_grpo::scale_grads_)
    h = inp["hidden"].clone().requires_grad_()
    out = cg.grpo_loss(**dict(inp, hidden=h), config=cfg)
    (0.37 * out.loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs sm_90+")
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_dw_tma_epilogue_matches_pointer_epilogue(monkeypatch, mode):
    """The dW steps' TMA epilogue (tuning.DW_TMA_OUT: bulk store, then L2 reduce-adds of later
    row blocks) against the load-add-store epilogue, on 3 row blocks of 60% valid rows, in both
    gradient modes: d_hidden bitwise equal (untouched), d_weight within the one extra bf16
    rounding a block adds, and the TMA epilogue bitwise repeatable."""
    import lowerings.linear_logprobs.recompute.dense as tk
    inp = _gpu_inputs(B=4, T=512, seed=3)
    cfg = cg.GRPOConfig(loss_type="dapo", beta=0.04, gradient_mode=mode, fused_workspace_mib=400.0)

    def grads():
        h = inp["hidden"].clone().requires_grad_()
        w = inp["weight"].clone().requires_grad_()
        cg.grpo_loss(**dict(inp, hidden=h, weight=w), config=cfg).loss.backward()
        return h.grad, w.grad

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(tuning, "DW_TMA_OUT", on)
        runs[on] = grads()
    assert torch.equal(runs[True][0], runs[False][0])
    dw_tma, dw_ptr = runs[True][1].float(), runs[False][1].float()
    assert ((dw_tma - dw_ptr).norm() / dw_ptr.norm()) < 2**-8
    assert torch.equal(grads()[1], runs[True][1])
