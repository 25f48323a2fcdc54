"""TRL 1.16's loss options (vespo, off_policy_mask_threshold, top_entropy_quantile, the vLLM
importance-sampling correction) against TRL's OWN code, float64.

No TRL formula is retyped here. A tiny ``trl.GRPOTrainer`` is built once; per case its options are
set and TRL runs its own code:
- the loss: ``GRPOTrainer._compute_loss`` (which calls ``get_off_policy_mask``,
  ``get_gamma_weights``, ``get_high_entropy_mask``) with the policy's log-probs and entropies
  replaced by compiled_grpo's float64 reference (``reference_token_logprobs`` of the same hidden
  states and lm_head weight), so loss, gradients w.r.t. hidden and weight and the metrics TRL logs
  compare to float64 rounding with ``cg.grpo_loss`` in both gradient modes;
- the vLLM IS weight: ``GRPOTrainer._generate_and_score_completions`` with ``use_vllm`` on and the
  generation replaced by fixed completions and sampler log-probs; its ``importance_sampling_ratio``
  and ``sampling/*`` metrics against ours.
trl is a hard import (the test extra installs it): CI never skips this file.
"""
import dataclasses

import pytest
import torch
import trl
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM

import compiled_grpo as cg
from trl_harness import char_tokenizer, count_a, make_args

B, T, H, V = 4, 6, 8, 48
NO_CLAMPS = dict(log_ratio_clamp=None, kl_input_clamp=None, kl_output_clamp=None)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    out = tmp_path_factory.mktemp("trl_options")
    args = make_args(out, beta=0.0, per_device_train_batch_size=B, num_generations=B, max_completion_length=T,
                     num_iterations=1)
    return trl.GRPOTrainer(model=Qwen3ForCausalLM(config), reward_funcs=count_a, args=args,
                           train_dataset=Dataset.from_dict({"prompt": ["1 + 2 ="] * B}),
                           processing_class=char_tokenizer())


OPTIONS = ("loss_type", "beta", "importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile",
           "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
           "vllm_importance_sampling_clip_max", "entropy_coef", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
           "vespo_lambda_neg")
TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig) if f.name in OPTIONS}


def configure(trainer, **trl_options):
    """Set options on the trainer's trl.GRPOConfig (TRL's defaults for the others) and re-copy what
    GRPOTrainer.__init__ copies onto self."""
    args = trainer.args
    for name, value in {**TRL_DEFAULTS, "beta": 0.0, **trl_options}.items():
        setattr(args, name, value)
    for name in OPTIONS:
        if not name.startswith("vespo"):
            setattr(trainer, name, getattr(args, name))
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer._entropy_bonus_enabled = args.entropy_coef != 0.0
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics["train"].clear()
    trainer.model.train()
    return args


def cg_config(args, **kw):
    """compiled_grpo's config of the same options (guards off: TRL's numbers)."""
    return cg.GRPOConfig(
        loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high or args.epsilon,
        importance_sampling_level=args.importance_sampling_level,
        beta=args.beta, use_bias_correction_kl=args.use_bias_correction_kl, entropy_coef=args.entropy_coef,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=args.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, metrics="with_entropy", **NO_CLAMPS, **kw)


def batch(seed, lengths=(6, 3, 5, 1), spread=0.6):
    """Right-padded completions (TRL's layout), float64 hidden/weight leaves, old/ref/sampler log-probs."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    ids = torch.randint(2, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [B, T] bool
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    with torch.no_grad():
        p = cg.reference_token_logprobs(hidden, weight, ids).logprobs
    noise = lambda: spread * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, adv=adv, old=p + noise(), ref=p + noise(),
                samp=p + noise())


def trl_loss(trainer, b, monkeypatch, *, old=True, is_ratio=None, samp=True):
    """TRL's _compute_loss on our reference log-probs/entropies; returns loss, (d hidden, d weight), metrics."""
    ref = cg.reference_token_logprobs(b["hidden"], b["weight"], b["ids"], with_entropy=True)

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return ref.logprobs, ref.entropy, None

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", logps_and_entropies)
    m = b["mask"].long()  # TRL's completion_mask
    inputs = dict(prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=b["ids"], completion_mask=m, advantages=b["adv"],
                  num_items_in_batch=m.sum(), ref_per_token_logps=b["ref"])
    if old:
        inputs["old_per_token_logps"] = b["old"]
    if samp:
        inputs["sampling_per_token_logps"] = b["samp"]
    if is_ratio is not None:
        trainer.use_vllm = True
        inputs["importance_sampling_ratio"] = is_ratio
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        trainer.use_vllm = False
    grads = torch.autograd.grad(loss, (b["hidden"], b["weight"]))
    return loss, grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def ours(b, cfg, mode, *, old=True, samp=True):
    cfg = dataclasses.replace(cfg, gradient_mode=mode, fused_workspace_mib=2 * T * V * 8 / 2**20)
    out = cg.grpo_loss(b["hidden"], b["weight"], b["ids"], b["adv"], b["mask"], b["old"] if old else None, b["ref"],
                       sampling_per_token_logps=b["samp"] if samp else None,
                       num_items_in_batch=int(b["mask"].sum()), config=cfg)
    return out, torch.autograd.grad(out.loss, (b["hidden"], b["weight"]))


def assert_matches(trl_result, our_result, metric_map, rtol=None, atol=None):
    (loss, grads, metrics), (out, our_grads) = trl_result, our_result
    torch.testing.assert_close(out.loss, loss.detach(), rtol=rtol or 1e-12, atol=atol or 1e-14)
    for a, b_ in zip(our_grads, grads):
        torch.testing.assert_close(a, b_, rtol=rtol or 1e-10, atol=atol or 1e-13)
    for trl_name, our_name in metric_map.items():
        ours_v = getattr(out.metrics, our_name).item()
        assert abs(ours_v - metrics[trl_name]) <= 1e-6 * max(1.0, abs(metrics[trl_name])), (trl_name, ours_v, metrics)


CLIPS = {"clip_ratio/low_mean": "clip_ratio_low", "clip_ratio/high_mean": "clip_ratio_high",
         "clip_ratio/region_mean": "clip_ratio", "entropy": "entropy"}

CASES = {
    # loss-side options with no vLLM weight (TRL without vLLM: no importance_sampling_ratio input)
    "vespo": dict(loss_type="vespo"),
    "vespo_params_kl": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                            vespo_lambda_neg=2.5, beta=0.05),
    "opsm_sampler": dict(off_policy_mask_threshold=0.05),
    "opsm_grpo_kl_entropy": dict(loss_type="grpo", off_policy_mask_threshold=0.0, beta=0.04, entropy_coef=0.01),
    "top_entropy_0.4_entropy_bonus": dict(top_entropy_quantile=0.4, entropy_coef=0.03),
    "top_entropy_0_bnpo": dict(loss_type="bnpo", top_entropy_quantile=0.0),
    "everything_grpo": dict(loss_type="grpo", off_policy_mask_threshold=0.02, top_entropy_quantile=0.5, beta=0.04),
    # TRL 1.16 allows sequence-level IS for cispo and sapo (a warning for cispo): the GSPO ratio
    # through the loss type's own clip rule
    "cispo_sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.05, beta=0.04),
    "sapo_sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo_sequence": dict(loss_type="dapo", importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("name", CASES)
def test_loss_options_match_trl(name, trainer, monkeypatch):
    args = configure(trainer, vllm_importance_sampling_correction=False, **CASES[name])
    b = batch(seed=len(name))
    ref = trl_loss(trainer, b, monkeypatch)
    metric_map = dict(CLIPS) if args.loss_type not in ("vespo", "cispo", "sapo") else {"entropy": "entropy"}
    if args.loss_type == "cispo":
        metric_map["cispo_clip_ratio"] = "clip_ratio_high"
    if args.beta:
        metric_map["kl"] = "kl_ref"
    modes = ("recompute", "auto") if args.top_entropy_quantile < 1 else ("recompute", "fused")
    # TRL forms sapo's temperatures as a default-dtype (fp32) tensor: its loss is ~1e-8 off the
    # float64 value there
    tol = dict(rtol=1e-7, atol=1e-9) if args.loss_type == "sapo" else {}
    for mode in modes:
        assert_matches(ref, ours(b, cg_config(args), mode), metric_map, **tol)
    if args.loss_type == "vespo":  # TRL's mean over sequences of its [B, 1] phi
        out, _ = ours(b, cg_config(args), "recompute")
        torch.testing.assert_close(out.metrics.vespo_phi_seq_mean.item(), ref[2]["vespo/phi_seq_mean"],
                                   rtol=1e-6, atol=1e-9)


def test_opsm_without_sampler_uses_old_logprobs(trainer, monkeypatch):
    """TRL: inputs.get("sampling_per_token_logps", old_per_token_logps)."""
    args = configure(trainer, vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.01)
    b = batch(seed=5)
    ref = trl_loss(trainer, b, monkeypatch, samp=False)
    for mode in ("recompute", "fused"):
        assert_matches(ref, ours(b, cg_config(args), mode, samp=False), CLIPS)


def fake_generation(trainer, b, monkeypatch):
    """_generate replaced by the batch's completions and sampler log-probs; the old log-probs TRL
    recomputes are the batch's."""
    lengths = b["mask"].sum(-1).tolist()
    ids = [b["ids"][i, :n].tolist() for i, n in enumerate(lengths)]
    samp = [b["samp"][i, :n].tolist() for i, n in enumerate(lengths)]

    def generate(prompts):
        completions = [trainer.processing_class.decode(c) for c in ids]
        return [[2, 3]] * B, ids, None, completions, samp, {}, None, None

    monkeypatch.setattr(trainer, "_generate", generate)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (b["old"].clone(), None, None))


IS_CASES = [("token_truncate", None, 3.0), ("token_truncate", 0.8, 1.3), ("token_mask", 0.7, 1.4),
            ("token_mask", None, 1.2), ("sequence_truncate", 0.5, 2.0), ("sequence_mask", None, 3.0),
            ("sequence_mask", 0.3, 1.5)]


@pytest.mark.parametrize("mode, lo, hi", IS_CASES)
def test_vllm_importance_sampling_matches_trl(mode, lo, hi, trainer, monkeypatch):
    args = configure(trainer, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                     vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi,
                     loss_type="dapo", beta=0.04)
    b = batch(seed=11, spread=0.3)
    b["samp"] = b["samp"].float().double()  # TRL builds its sampler log-probs with torch.tensor(list): float32
    b["samp"][1, 0] = float("nan")  # a token the sampler could not score: no correction, as TRL
    fake_generation(trainer, b, monkeypatch)
    trainer.use_vllm, trainer.beta = True, 0.0  # the KL's reference log-probs are the batch's, given below
    try:
        gen = trainer._generate_and_score_completions([{"prompt": "1 + 2 ="}] * B)
    finally:
        trainer.use_vllm, trainer.beta = False, args.beta
    monkeypatch.undo()
    trl_ratio = gen["importance_sampling_ratio"]  # [B, T] token_*, [B, 1] sequence_*
    assert torch.equal(gen["completion_mask"].bool(), b["mask"])
    assert torch.equal(torch.where(b["mask"], gen["completion_ids"], 0), torch.where(b["mask"], b["ids"], 0))
    cfg = cg_config(args)
    w = cg.api.sampling_weight(b["old"], b["samp"], b["mask"], cfg)
    torch.testing.assert_close(torch.where(b["mask"], w, 0), torch.where(b["mask"], trl_ratio, 0), rtol=1e-12,
                               atol=0)
    # the loss with TRL's own ratio as its input, against ours from the sampler's log-probs
    ref = trl_loss(trainer, b, monkeypatch, is_ratio=trl_ratio)
    sampling = {f"sampling/{k}/{s}": f"{k}_{s}" for k, stats in
                (("importance_sampling_ratio", ("min", "mean", "max")), ("sampling_logp_difference", ("mean", "max")))
                for s in stats}  # logged by TRL's generation step above
    for gm in ("recompute", "fused"):
        assert_matches(ref, ours(b, cfg, gm), {**CLIPS, **sampling, "kl": "kl_ref"})
    # on-policy (old_logprobs=None): ours uses sg(p) as TRL's old log-probs would be
    if mode.startswith("token"):
        ref = trl_loss(trainer, b, monkeypatch, old=False,
                       is_ratio=cg.api.sampling_weight(cg.reference_token_logprobs(b["hidden"], b["weight"],
                                                                                   b["ids"]).logprobs.detach(),
                                                       b["samp"], b["mask"], cfg))
        assert_matches(ref, ours(b, cfg, "fused", old=False), CLIPS)


def test_vespo_with_token_is_ratio_matches_trl(trainer, monkeypatch):
    """VESPO folds TRL's token-level IS ratio into its gamma weight (log space), no extra factor."""
    args = configure(trainer, loss_type="vespo", vllm_importance_sampling_correction=True,
                     vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.6,
                     vllm_importance_sampling_clip_max=1.5)
    b = batch(seed=3, spread=0.3)
    cfg = cg_config(args)
    ratio = cg.api.sampling_weight(b["old"], b["samp"], b["mask"], cfg)
    ref = trl_loss(trainer, b, monkeypatch, is_ratio=torch.where(b["mask"], ratio, 1.0))  # TRL: 1 at padding
    for gm in ("recompute", "fused"):
        assert_matches(ref, ours(b, cfg, gm), {"entropy": "entropy"})


def test_high_entropy_mask_is_trls(trainer):
    """The threshold without host sync equals torch.quantile's in TRL's get_high_entropy_mask, ties included,
    for fp32 entropies (TRL's). fp64 entropies are compared in fp32 here, where TRL compares them with their
    own fp32-rounded quantile and may drop the quantile's token (test_edge_cases: a deliberate difference)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n_b, n_t = 1 + trial % 5, 1 + (trial * 7) % 11
        ent = (torch.rand(n_b, n_t, generator=g) * 3).round(decimals=trial % 3)  # fp32, ties
        mask = torch.rand(n_b, n_t, generator=g) > 0.3
        for q in (0.0, 0.2, 0.37, 0.5, 0.9, 0.999):
            expected = trainer.get_high_entropy_mask(ent, mask.long(), 1 - q)
            assert torch.equal(cg.loss.high_entropy_mask(ent, mask, top_quantile=q), expected), (trial, q)

