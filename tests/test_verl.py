"""verl 0.9.1's fused-kernel switch with compiled_grpo's backend (compiled_grpo/integrations/verl.py),
against verl's own torch backend, through verl's own apply_monkey_patch, on a tiny HF Qwen3 (fp32,
CPU): log-probs, entropy and the gradients of a loss over both, padded and remove-padding
(packed [1, nnz]) inputs, temperatures; the plugin registration a fresh `import verl` does.

verl 0.9.1 pins transformers < 5.11 and TRL's tests want 5.24: this file runs in CI's verl leg
(its own venv, `pip install -e ".[verl-test]"`, COMPILED_GRPO_VERL_LEG=1, where a missing verl is
an error); the main leg, without verl, skips it saying so.
"""
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("COMPILED_GRPO_VERL_LEG"):
    import verl  # noqa: F401
else:
    pytest.importorskip("verl", reason="verl 0.9.1 (transformers < 5.11) runs in CI's verl leg")

from verl.models.transformers.monkey_patch import apply_monkey_patch  # noqa: E402

import compiled_grpo as cg  # noqa: E402
from compiled_grpo.integrations import verl as cg_verl  # noqa: E402

V, H = 512, 64


def _model(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).float()


def _batch(packed: bool):
    g = torch.Generator().manual_seed(1)
    if packed:   # remove-padding: the valid tokens of 3 sequences end to end, positions restart
        lens = [11, 5, 16]
        ids = torch.randint(0, V, (1, sum(lens)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        return dict(input_ids=ids, position_ids=pos)
    ids = torch.randint(0, V, (3, 16), generator=g)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, 11:] = 0
    mask[1, 5:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=pos)


def _run(model, backend: str, batch: dict, temperature: float):
    """(log_probs, entropy, grads) of verl's patched forward with `backend`."""
    apply_monkey_patch(model=model, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend=backend)
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False, return_dict=True, temperature=temperature)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = (torch.randn(out.log_probs.shape, generator=g) for _ in range(2))
    ((out.log_probs * w_lp).sum() + (out.entropy.float() * w_ent).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach().float(), grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "remove_padding"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_backend_equals_verls_torch_backend(packed, tied, temperature):
    model = _model(tied)
    batch = _batch(packed)
    lp_v, ent_v, g_v = _run(model, "torch", batch, temperature)
    lp_c, ent_c, g_c = _run(model, cg_verl.BACKEND, batch, temperature)
    assert type(model).forward is cg_verl.forward_with_compiled_grpo_backend
    assert lp_c.shape == lp_v.shape and lp_c.dtype == torch.float32 and (lp_c <= 0).all()
    # fp32 both: verl's chunked log_softmax against the op's online one
    torch.testing.assert_close(lp_c, lp_v, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_c, ent_v, rtol=0, atol=2e-5)
    assert g_c.keys() == g_v.keys()
    for name in g_v:
        torch.testing.assert_close(g_c[name], g_v[name], rtol=1e-4, atol=1e-5, msg=name)


def test_head_is_batch_invariant():
    """The backend's log-probs of a row are the same bits whatever rows come with it: verl's
    old and current log-probs, computed in micro-batches of other sizes, agree exactly."""
    model = _model(False)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 24, H, generator=g)
    labels = torch.randint(0, V, (4, 24), generator=g)
    with torch.no_grad():
        lp_all, ent_all = cg_verl.head_logprobs(model.lm_head, hidden, labels, 0.9)
        for b in range(4):
            lp_one, ent_one = cg_verl.head_logprobs(model.lm_head, hidden[b:b + 1], labels[b:b + 1], 0.9)
            assert torch.equal(lp_one[0], lp_all[b]) and torch.equal(ent_one[0], ent_all[b])
        lp_flat, _ = cg_verl.head_logprobs(model.lm_head, hidden.reshape(1, -1, H), labels.reshape(1, -1), 0.9)
        assert torch.equal(lp_flat.reshape(4, 24), lp_all)
        ref = cg.reference_token_logprobs(hidden.double(), model.lm_head.weight.double(), labels,
                                          temperature=0.9).logprobs
    torch.testing.assert_close(lp_all.double(), ref, rtol=0, atol=1e-5)


def test_head_call_runs_the_modules_hooks():
    """head_logprobs calls the lm_head module (FSDP2's unshard / post-backward are its hooks)
    and leaves its forward as it was."""
    model = _model(False)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append("post"))
    cg_verl.head_logprobs(model.lm_head, torch.randn(2, 3, H), torch.zeros(2, 3, dtype=torch.long))
    assert seen == ["pre", "post"] and "forward" not in vars(model.lm_head)


def test_vision_language_models_name_verls_backends():
    model = _model(False)
    model.config.model_type = "qwen2_vl"
    with pytest.raises(NotImplementedError, match="impl_backend 'torch' or 'triton'"):
        apply_monkey_patch(model=model, use_remove_padding=True, use_fused_kernels=True,
                           fused_kernels_backend=cg_verl.BACKEND)


def test_import_verl_registers_the_backend():
    """A fresh process: `import verl` loads compiled_grpo's `verl.plugins` entry point, which
    registers the backend; nothing else is imported by hand (as in verl's Ray workers)."""
    code = ("import verl\nfrom verl.models.transformers import monkey_patch as mp\n"
            "print(getattr(mp.patch_forward_with_backends, '_compiled_grpo', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout


def _fsdp2_worker(rank, world, init_file, results):
    """verl#7427's layout: FSDP2 with the untied lm_head sharded on its own (and each decoder
    layer, and the root), a different batch a rank, the backend's forward + backward; the
    gradients against one process's over both batches (FSDP2 averages over the ranks)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _model(False)
        apply_monkey_patch(model=model, use_remove_padding=True, use_fused_kernels=True,
                           fused_kernels_backend=cg_verl.BACKEND)
        ref = copy.deepcopy(model)
        batches = [dict(_batch(True), input_ids=_batch(True)["input_ids"].roll(r, -1)) for r in range(world)]

        def loss_of(m, batch):
            out = m(**batch, use_cache=False, return_dict=True, temperature=0.8)
            return -(out.log_probs.sum() + 0.1 * out.entropy.sum())

        (sum(loss_of(ref, b) for b in batches) / world).backward()
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.lm_head, mesh=mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss_of(model, batches[rank]).backward()
        worst = 0.0
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.full_tensor()
            worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
        results[rank] = worst
    finally:
        dist.destroy_process_group()


def test_fsdp2_untied_lm_head_sharded_on_its_own(tmp_path):
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "pg"), results), nprocs=2, join=True)
    assert sorted(results.keys()) == [0, 1]
    assert max(results.values()) < 1e-5, dict(results)


# --- the loss: verl's own functions against grpo_loss with integrations.verl_config ---------------

def _actor(mode, agg, kl, entropy_coeff, **kw):
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                           loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=mode),
                           use_kl_loss=kl is not None, kl_loss_type=kl or "low_var_kl", kl_loss_coef=0.05,
                           entropy_coeff=entropy_coeff, **kw)


def _verl_loss(actor, logp, ent, old, ref, adv, mask):
    """verl/workers/utils/losses.py ppo_loss's composition, on one data-parallel rank."""
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
    agg = actor.loss_agg_mode
    pg, _ = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=actor)
    loss = pg
    if actor.entropy_coeff:
        loss = loss - actor.entropy_coeff * agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=agg)
    if actor.use_kl_loss:
        kld = kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=actor.kl_loss_type)
        loss = loss + actor.kl_loss_coef * agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg)
    return loss


def _loss_inputs(seed=0, B=5, T=12, Hd=16, Vd=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, Hd, generator=g, dtype=torch.float64)
    weight = torch.randn(Vd, Hd, generator=g, dtype=torch.float64) / 2
    ids = torch.randint(0, Vd, (B, T), generator=g)
    lens = torch.randint(1, T + 1, (B,), generator=g)          # no fully masked sequence
    mask = torch.arange(T)[None, :] < lens[:, None]
    with torch.no_grad():
        lp = cg.reference_token_logprobs(hidden, weight, ids).logprobs
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)   # ratios past the clips
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return hidden, weight, ids, mask, old, ref, adv


KLS = (None, "k1", "mse", "low_var_kl")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "cispo"])
def test_loss_equals_verls_in_float64(mode, agg):
    """Every KL setting and entropy bonus the mapping takes for this (loss_mode, loss_agg_mode):
    the loss and the gradients w.r.t. hidden and weight equal verl's within float64 rounding
    (1e-7 relative where verl divides by L + 1e-8); the rest raise naming the setting."""
    from compiled_grpo.integrations.verl_config import grpo_config
    hidden, weight, ids, mask, old, ref, adv = _loss_inputs(seed=len(mode) + len(agg))
    extra = dict(clip_ratio_low=1.0, clip_ratio_high=4.0) if mode == "cispo" else {}
    mapped = 0
    for kl in KLS:
        for coeff in (0.0, 0.01):
            actor = _actor(mode, agg, kl, coeff, **extra)
            try:
                cfg = grpo_config(actor, response_length=ids.shape[1])
            except ValueError as e:
                assert any(s in str(e) for s in ("loss_agg_mode", "entropy_coeff", "sapo")), e
                continue
            mapped += 1
            h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = cg.reference_token_logprobs(h1, w1, ids, with_entropy=True)
            want = _verl_loss(actor, out.logprobs, out.entropy, old, ref, adv[:, None].expand_as(old),
                              mask.double())
            want.backward()
            h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            got = cg.grpo_loss(h2, w2, ids, adv, mask, old, ref, config=cfg).loss
            got.backward()
            what = f"{mode} {agg} kl={kl} entropy={coeff}"
            for name, a, b in (("loss", got, want), ("d_hidden", h2.grad, h1.grad), ("d_weight", w2.grad, w1.grad)):
                err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))   # of the tensor's scale
                assert err < 1e-7, (what, name, err)
    # 4 KL settings x 2 entropy bonuses; the bonus maps with token-mean only, sapo's KL with
    # seq-mean-token-mean only, cispo with token-mean only
    want = {"cispo": 8 if agg == "token-mean" else 0,
            "sapo": 4 if agg == "seq-mean-token-mean" else 1}.get(mode, 8 if agg == "token-mean" else 4)
    assert mapped == want, (mode, agg, mapped)


@pytest.mark.parametrize("setting,match", [
    (dict(mode="dppo_tv"), "loss_mode"), (dict(mode="geo_mean"), "loss_mode"),
    (dict(agg="token-sum"), "token-sum"), (dict(kl="low_var_kl+"), "kl_loss_type"),
    (dict(kl="abs"), "kl_loss_type"), (dict(mode="cispo"), "cispo"),
])
def test_unmapped_settings_name_themselves(setting, match):
    from compiled_grpo.integrations.verl_config import grpo_config
    args = dict(mode="vanilla", agg="token-mean", kl=None)
    args.update(setting)
    actor = _actor(args["mode"], args["agg"], args["kl"], 0.0)
    with pytest.raises(ValueError, match=match):
        grpo_config(actor, response_length=12)


# --- the naive-fusion pass on verl's own log-prob and entropy code ---------------------------------

def _fused_like_verl(step, hidden, weight, dtype):
    """step compiled with the naive-fusion pass (caches off): its outputs and the gradients of
    their sum equal step's run as it is (bf16: within the logits' rounding); the counters."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch(fx_graph_cache=False), cg.naive_logprob_fusion():
        got = torch.compile(step, fullgraph=True)(hidden, weight)
    want = step(hidden, weight)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    gw = torch.autograd.grad(sum(x.float().sum() for x in want), [hidden, weight])
    gg = torch.autograd.grad(sum(x.float().sum() for x in got), [hidden, weight])
    for a, c in zip([*got, *gg], [*want, *gw]):
        torch.testing.assert_close(a.float(), c.float(), rtol=tol, atol=tol)
    return counters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("remove_padding", [False, True])
def test_naive_fusion_fuses_verls_functions(dtype, remove_padding):
    """verl's logprobs_from_logits (its row loop: logsumexp rows in fp32, log_softmax rows in
    bf16) and entropy_from_logits, padded [B, T] or remove-padding [1, nnz] -> squeeze(0) with
    the engine's per-token temperature (_scale_logits_by_temperature), compiled with the pass:
    one fused call, equal to verl's code run as it is (bf16: within the logits' rounding)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.workers.engine.fsdp.transformer_impl import _scale_logits_by_temperature

    g = torch.Generator().manual_seed(5)
    b, t, h_, v = 3, 7, 16, 37
    hidden = torch.randn(b, t, h_, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h_, generator=g) / 2).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    temps = torch.full((b * t,), 0.8)

    def step(hidden, weight):
        if remove_padding:
            logits = (hidden.reshape(1, b * t, h_) @ weight.T).squeeze(0)
            logits = _scale_logits_by_temperature(logits, temps.unsqueeze(-1), is_unit_temperature=False)
            labels = ids.reshape(-1)
        else:
            logits = (hidden @ weight.T).div(0.8)
            labels = ids
        return logprobs_from_logits(logits, labels), entropy_from_logits(logits)

    counters = _fused_like_verl(step, hidden, weight, dtype)
    assert counters["compiled_grpo"]["naive_logprob_fusion"] == 1
    assert counters["compiled_grpo"]["naive_entropy_fusion"] == 1
    assert not counters["compiled_grpo_unfused"], dict(counters["compiled_grpo_unfused"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_fusion_fuses_megatron_engines_in_place_temperature_and_chunked_entropy(dtype):
    """verl's megatron engine: the remove-padding logits scaled in place by the per-token
    temperature (`logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))`), then
    logprobs_from_logits and, with `entropy_from_logits_with_chunking`, the entropy written chunk
    by chunk into a zeros buffer (verl_F.entropy_from_logits_with_chunking, 3 chunks here):
    one fused call, equal to verl's code run as it is."""
    from verl.utils.torch_functional import entropy_from_logits_with_chunking, logprobs_from_logits

    g = torch.Generator().manual_seed(6)
    nnz, h_, v = 21, 16, 37
    hidden = torch.randn(1, nnz, h_, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h_, generator=g) / 2).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (nnz,), generator=g)
    temperature = torch.linspace(0.7, 1.1, nnz)

    def step(hidden, weight):
        logits = (hidden @ weight.T).squeeze(0)                              # [nnz, V]
        logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))
        return logprobs_from_logits(logits, labels), entropy_from_logits_with_chunking(logits, chunk_size=8)

    counters = _fused_like_verl(step, hidden, weight, dtype)
    c = counters["compiled_grpo"]
    assert (c["naive_logprob_fusion"], c["naive_entropy_fusion"], c["naive_inplace_scale"]) == (1, 1, 1), dict(c)
    assert c["naive_row_loop_fold"] >= 1 and not counters["compiled_grpo_unfused"]


def test_bench_providers_run_verls_backends(tmp_path):
    """bench's `verl_torch` provider (verl's FusedLinearForPPO, as its patched forward calls it)
    runs padded and packed on CPU with the errors of the naive bf16 head it computes (bf16
    logits); `verl_triton` names CUDA where there is none."""
    import csv
    from bench.__main__ import main
    args = ["--device", "cpu", "--shapes", "cpu-tiny", "cpu-tiny-packed", "--providers", "naive_eager",
            "verl_torch", "verl_triton", "--out", str(tmp_path), "--reps", "2", "--warmup", "1"]
    assert main(args) == 0
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {(r["shape"], r["provider"]): r for r in csv.DictReader(f)}
    naive = rows[("cpu-tiny", "naive_eager")]
    for shape in ("cpu-tiny", "cpu-tiny-packed"):
        r = rows[(shape, "verl_torch")]
        assert r["status"] == "ok", r
        for col in ("loss_rel_err", "dx_rel_err", "dw_rel_err"):
            assert float(r[col]) <= 2 * float(naive[col]) + 1e-6, (shape, col, r[col], naive[col])
        assert "needs CUDA" in rows[(shape, "verl_triton")]["status"]


@pytest.mark.parametrize("mode,agg,fused", [("vanilla", "token-mean", True),
                                            ("vanilla", "seq-mean-token-mean", True),
                                            ("gspo", "seq-mean-token-mean", False)])
def test_naive_fusion_on_verls_loss(mode, agg, fused):
    """verl's own step, compiled with the pass: logprobs_from_logits (its fp32 logsumexp loop),
    entropy_from_logits, then verl's policy loss, k3 KL, entropy bonus and aggregation
    (_verl_loss). Per-token losses take the fused schedule (the gradient in the forward's
    blocks: counters["compiled_grpo_gradient"]["fused"]); GSPO's sequence ratio keeps the
    recompute op. Loss and gradients within 2x the same code's eager error of float64."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    hidden, weight, ids, mask, old, ref, adv = _loss_inputs(seed=11)
    actor = _actor(mode, agg, "low_var_kl", 0.01)

    def step(hidden, weight, old, ref, adv, mask):
        logits = (hidden @ weight.T).float() / 0.9
        lp, ent = logprobs_from_logits(logits, ids), entropy_from_logits(logits)
        return _verl_loss(actor, lp, ent, old, ref, adv[:, None].expand_as(old), mask)

    def run(fn, dtype):
        h, w = (t.detach().to(dtype).requires_grad_() for t in (hidden, weight))
        rest = [t.to(dtype) for t in (old, ref, adv, mask.float())]
        loss = fn(h, w, *rest)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    gold = run(step, torch.float64)
    want = run(step, torch.float32)
    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch(fx_graph_cache=False), cg.naive_logprob_fusion():
        got = run(torch.compile(step, fullgraph=True), torch.float32)
    assert counters["compiled_grpo"]["naive_logprob_fusion"] == 1
    assert dict(counters["compiled_grpo_gradient"]) == ({"fused": 1} if fused else {"not_separable": 1})
    for e, o, g in zip(want, got, gold):
        err_e, err_o = (float((x.double() - g).norm() / g.norm()) for x in (e, o))
        assert err_o <= 2 * err_e + 1e-6, (err_o, err_e)
