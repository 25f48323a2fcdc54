"""compiled_grpo.integrations.trl.GRPOTrainer against trl.GRPOTrainer (TRL 1.16) on a tiny random model.

Both trainers train the same randomly initialised 2-layer Qwen3 (H=32, V=48, a character tokenizer)
for 3 steps from the same seed, with a rule reward on synthetic prompts; every metric TRL logs
from its loss (loss, grad_norm, kl, entropy, clip ratios, policy_loss, cispo_clip_ratio) must
agree. The rewards and completion lengths must be identical: the same seed and near-identical
weights sample the same completions, so the comparison is of the same batches. trl is a hard
import: the README's test command installs it (the test extra), so CI never skips this file.
"""
import dataclasses
import math
import warnings

import pytest
import torch
import transformers
import trl
import trl.trainer.utils
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM

import compiled_grpo as cg
from compiled_grpo.integrations.trl import GRPOTrainer
from helpers import torchrun
from trl_harness import assert_same_logs, char_tokenizer, count_a, make_args, save_model, train

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)

# step 2 re-trains step 1's batch: its A < 0 sequences drift by 0.09 to 0.36 (mean sampler - current
# log-prob), so 0.15 drops most of them, far from any value that could flip; step 1 and 3 drift by 0.
OFF_POLICY_THRESHOLD = 0.15


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_model(path)
    return str(path)


@pytest.fixture(scope="module")
def nudged_model_dir(model_dir, tmp_path_factory):
    """The test model with every lm_head weight moved one ulp up: stock TRL trained from it gives
    the trajectory's own sensitivity to a rounding-level change (assert_same_logs' floor_logs)."""
    path = tmp_path_factory.mktemp("tiny_qwen3_nudged")
    model = Qwen3ForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        w = model.lm_head.weight
        w.copy_(torch.nextafter(w, torch.full_like(w, math.inf)))
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


PARITY = {
    "dapo_kl_offpolicy": dict(),
    "grpo_gspo_delta_entropy_accum": dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5,
                                          entropy_coef=0.01, gradient_accumulation_steps=2,
                                          per_device_train_batch_size=4),
    "cispo_entropy_steps_per_generation": dict(loss_type="cispo", epsilon_high=1.02, entropy_coef=0.02,
                                               gradient_accumulation_steps=2, per_device_train_batch_size=4,
                                               steps_per_generation=4),
    "bnpo_accum": dict(loss_type="bnpo", gradient_accumulation_steps=2, per_device_train_batch_size=4),
    "dr_grpo_no_bias_correction": dict(loss_type="dr_grpo", use_bias_correction_kl=False),
    "sapo": dict(loss_type="sapo"),
    "luspo_gspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo", vespo_k_neg=2.5, vespo_lambda_pos=2.5),
    "grpo_off_policy_mask": dict(loss_type="grpo", off_policy_mask_threshold=OFF_POLICY_THRESHOLD),
    "dapo_top_entropy_bonus": dict(top_entropy_quantile=0.5, entropy_coef=0.02),
}


def count_trl_masked(monkeypatch, dropped):
    """Count the valid tokens TRL's own off-policy / high-entropy masks drop (proof the option acts)."""
    def wrap(name, mask_of):
        original = getattr(trl.GRPOTrainer, name)

        def recorded(*args, **kwargs):
            keep = original(*args, **kwargs)
            valid = mask_of(args, kwargs).bool()
            dropped[name] += int((valid & ~keep.bool().expand_as(valid)).sum())
            return keep

        monkeypatch.setattr(trl.GRPOTrainer, name, staticmethod(recorded) if name == "get_off_policy_mask" else recorded)

    wrap("get_off_policy_mask", lambda args, kwargs: kwargs["mask"])
    wrap("get_high_entropy_mask", lambda args, kwargs: args[2])  # (self, entropies, mask, threshold)


@pytest.mark.parametrize("name", PARITY)
def test_parity_with_trl(name, model_dir, tmp_path, monkeypatch):
    dropped = {"get_off_policy_mask": 0, "get_high_entropy_mask": 0}
    count_trl_masked(monkeypatch, dropped)
    ref = train(trl.GRPOTrainer, model_dir, tmp_path / "trl", **PARITY[name])
    ours = train(GRPOTrainer, model_dir, tmp_path / "ours", monkeypatch, **PARITY[name])
    assert any(step.get("clip_ratio/region_mean", step.get("cispo_clip_ratio", 1.0)) > 0 for step in ref)
    assert any(step.get("kl", 0) > 0 for step in ref)
    assert (dropped["get_off_policy_mask"] > 0) == ("off_policy_mask_threshold" in PARITY[name])
    assert (dropped["get_high_entropy_mask"] > 0) == ("top_entropy_quantile" in PARITY[name])
    if PARITY[name].get("loss_type") == "vespo":  # phi != 1: the second update of a batch is off-policy
        assert any(abs(step["vespo/phi_seq_mean"] - 1) > 1e-3 for step in ref)
    assert_same_logs(ref, ours)


COMPILED = {"dapo_kl_offpolicy": dict(),
            "vespo_off_policy_top_entropy": dict(loss_type="vespo", off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
                                                 top_entropy_quantile=0.5, entropy_coef=0.02)}


@pytest.mark.parametrize("name", COMPILED)
def test_parity_compiled_loss(name, model_dir, tmp_path, monkeypatch):
    """compile_loss: grpo_loss under torch.compile(fullgraph=True), one graph for the run (aot_eager
    keeps the test fast; the default Inductor backend gives the same numbers)."""
    torch._dynamo.reset()
    ref = train(trl.GRPOTrainer, model_dir, tmp_path / "trl", **COMPILED[name])
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ours = train(GRPOTrainer, model_dir, tmp_path / "ours", monkeypatch,
                 trainer_kwargs={"compile_loss": {"backend": "aot_eager"}}, **COMPILED[name])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1
    assert_same_logs(ref, ours)


def test_logit_scale_and_softcap(tmp_path, monkeypatch):
    """A model whose config scales / softcaps its logits (TRL's lookup): parity when compiled_grpo
    has the fields, a ValueError naming the config attribute otherwise (never a silent mismatch)."""
    config = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    config.logit_scale, config.final_logit_softcapping = 2.0, 5.0
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    fields = {f.name for f in dataclasses.fields(cg.GRPOConfig)}
    if {"logit_scale", "final_logit_softcapping"} <= fields:
        ref = train(trl.GRPOTrainer, model, tmp_path / "trl")
        assert_same_logs(ref, train(GRPOTrainer, model, tmp_path / "ours", monkeypatch))
    else:
        missing = "logit_scale" if "logit_scale" not in fields else "final_logit_softcapping"
        with pytest.raises(ValueError, match=missing):
            train(GRPOTrainer, model, tmp_path / "ours", monkeypatch)


@pytest.mark.parametrize("overrides, match", [
    (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True"),
    # vespo sums log(TRL's IS ratio) over padded positions too, where clip_max < 1 makes it != 1
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
          vllm_importance_sampling_clip_max=0.5), r"vllm_importance_sampling_clip_min/_clip_max=\(None, 0.5\)"),
])
def test_unsupported_option_raises_at_construction(overrides, match, tmp_path):
    args = make_args(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):  # before the (absent) model is loaded
        GRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=count_a, args=args,
                    train_dataset=Dataset.from_dict({"prompt": ["1 ="]}), processing_class=char_tokenizer())


def test_top_entropy_quantile_multi_process_raises():
    """TRL's quantile spans every rank's entropies; compiled_grpo's spans the local batch."""
    from compiled_grpo.integrations.trl import check_supported_world

    check_supported_world(make_args("unused", top_entropy_quantile=0.5), 1)
    check_supported_world(make_args("unused"), 2)
    with pytest.raises(ValueError, match="top_entropy_quantile=0.5"):
        check_supported_world(make_args("unused", top_entropy_quantile=0.5), 2)


def test_config_mapping():
    args = make_args("unused", loss_type="dr_grpo", epsilon=0.1, epsilon_high=0.3, delta=2.0, beta=0.1,
                     importance_sampling_level="sequence", temperature=0.7, max_completion_length=64,
                     entropy_coef=0.05, use_bias_correction_kl=False, cast_lm_head_to_fp32=True)
    from compiled_grpo.integrations.trl import grpo_config_from_trl

    cfg = grpo_config_from_trl(args)
    assert (cfg.loss_type, cfg.epsilon_low, cfg.epsilon_high, cfg.delta, cfg.beta) == ("dr_grpo", 0.1, 0.3, 2.0, 0.1)
    assert (cfg.importance_sampling_level, cfg.temperature, cfg.max_completion_length) == ("sequence", 0.7, 64)
    assert (cfg.entropy_coef, cfg.use_bias_correction_kl, cfg.fp32_lm_head, cfg.kl_estimator) == (0.05, False, True,
                                                                                                   "k3")
    assert (cfg.log_ratio_clamp, cfg.kl_input_clamp, cfg.kl_output_clamp) == (None, None, None)
    assert grpo_config_from_trl(make_args("unused")).epsilon_high == 0.05  # epsilon_high None -> epsilon
    cfg = grpo_config_from_trl(make_args("unused", loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5,
                                         vespo_k_neg=3.5, vespo_lambda_neg=1.0, off_policy_mask_threshold=0.3,
                                         top_entropy_quantile=0.4, use_vllm=True,
                                         vllm_importance_sampling_mode="token_mask"))
    assert (cfg.loss_type, cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (
        "vespo", 1.5, 2.5, 3.5, 1.0)
    assert (cfg.off_policy_mask_threshold, cfg.top_entropy_quantile) == (0.3, 0.4)
    # TRL forms the IS weight itself (passed as sampling_ratio): compiled_grpo must not form a second one
    assert cfg.vllm_importance_sampling_correction is False


VLLM_INPUTS = {
    # TRL's importance_sampling_ratio per token (token_truncate), a KL term, the off-policy mask on the sampler's
    # log-probs: the ratio multiplies the policy term once, and the mask reads sampling_per_token_logps
    "grpo_token_is_off_policy_kl": (dict(loss_type="grpo", off_policy_mask_threshold=0.05), "token_truncate"),
    # vespo folds log(ratio) into phi (no multiplication); token_mask zeroes some ratios
    "vespo_token_mask_off_policy": (dict(loss_type="vespo", beta=0.0, off_policy_mask_threshold=0.05),
                                    "token_mask"),
    # a per-sequence ratio [B, 1] with the high-entropy mask and the entropy bonus
    "dapo_sequence_is_top_entropy": (dict(top_entropy_quantile=0.5, entropy_coef=0.02, beta=0.0), "sequence_mask"),
}


@pytest.mark.parametrize("name", VLLM_INPUTS)
def test_vllm_inputs_match_trl_compute_loss(name, model_dir, tmp_path, monkeypatch):
    """vLLM generation cannot run here: both trainers' _compute_loss get the inputs TRL's
    _generate_and_score_completions builds with use_vllm (old and sampler log-probs and TRL's
    importance_sampling_ratio, from compiled_grpo's sampling_importance_weight, tested against TRL in
    test_trl_options.py); loss, gradients and logged metrics must agree."""
    overrides, is_mode = VLLM_INPUTS[name]
    dropped = {"get_off_policy_mask": 0, "get_high_entropy_mask": 0}
    count_trl_masked(monkeypatch, dropped)
    g = torch.Generator().manual_seed(1)
    b, p, t = 8, 4, 10
    lengths = torch.tensor([10, 3, 7, 1, 10, 6, 2, 9])
    completion_mask = (torch.arange(t)[None] < lengths[:, None]).long()  # [B, T], right-padded as TRL's
    inputs = dict(prompt_ids=torch.randint(2, 40, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.long),
                  completion_ids=torch.randint(2, 40, (b, t), generator=g) * completion_mask,
                  completion_mask=completion_mask, advantages=torch.randn(b, generator=g),
                  num_items_in_batch=completion_mask.sum())
    results = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        torch.manual_seed(0)
        trainer = cls(model=model_dir, reward_funcs=count_a, args=make_args(tmp_path / cls.__module__, **overrides),
                      train_dataset=Dataset.from_dict({"prompt": ["1 ="]}), processing_class=char_tokenizer())
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # what use_vllm=True sets
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        if cls is trl.GRPOTrainer:  # the batch's log-probs, from TRL's own code
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            am = torch.cat([inputs["prompt_mask"], completion_mask], 1)
            with torch.no_grad():
                logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, t)[0]
                if trainer.beta != 0.0:
                    inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                        trainer.ref_model, ids, am, t)[0]
            valid = completion_mask.bool()
            old = logps + 0.05 * torch.randn(b, t, generator=g)
            samp = old + 0.3 * torch.randn(b, t, generator=g)
            samp[2, 1] = float("nan")  # a token the sampler could not score
            samp[0, 0] = old[0, 0] + 3.0  # IS ratio exp(-3): zeroed by token_mask, clipped by the others
            inputs.update(old_per_token_logps=old, sampling_per_token_logps=samp,
                          importance_sampling_ratio=cg.sampling_importance_weight(
                              old, samp, valid, mode=is_mode, clip_min=0.2 if is_mode == "token_mask" else None,
                              clip_max=5.0 if is_mode == "token_mask" else 2.0))
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
        head = trainer.model.get_output_embeddings().weight.grad.clone()
        first = trainer.model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        results.append((loss.detach(), head, first, {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    (ref_loss, ref_head, ref_first, ref_metrics), (loss, head, first, metrics) = results
    assert (dropped["get_off_policy_mask"] > 0) == ("off_policy_mask_threshold" in overrides)
    assert (dropped["get_high_entropy_mask"] > 0) == ("top_entropy_quantile" in overrides)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head, ref_head, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-7)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        assert math.isclose(metrics[key], value, rel_tol=1e-5, abs_tol=1e-7), f"{key}: TRL {value} vs ours {metrics[key]}"


BF16 = {  # TRL's default precision: bf16 autocast (its head rounds logits and their grads to bf16)
    "dapo_kl_offpolicy_temperature": dict(bf16=True, temperature=0.8),
    "grpo_gspo_delta_entropy_accum": dict(bf16=True, **PARITY["grpo_gspo_delta_entropy_accum"]),
    "cast_lm_head_to_fp32": dict(bf16=True, cast_lm_head_to_fp32=True, temperature=0.8),
}


@pytest.mark.parametrize("name", BF16)
def test_parity_with_trl_bf16(name, model_dir, nudged_model_dir, tmp_path, monkeypatch):
    """Under TRL's default bf16 autocast the drop-in sets GRPOConfig.round_logits and
    lm_head_dtype=bf16 (fp32 hidden states and lm_head multiplied in bf16, the logits and their
    gradient rounded to bf16, fp32 grads), TRL's head's numbers: every logged metric of 3 steps
    (num_iterations 2, beta 0.04, clip ratios non-zero) as stock TRL's.

    With cast_lm_head_to_fp32 the head runs in fp32, where the CPU body's dX / dW differ from
    TRL's head by fp32 rounding (another dlogits expression, another reduction order: 1e-7), and
    the bf16-autocast backbone turns any such difference into whole bf16 roundings of its weights
    after an Adam step: stock TRL from a one-ulp-nudged lm_head drifts from itself by 1.1e-3
    (grad_norm) and 4.2e-4 (kl) at the third step, exactly as the drop-in does (AVX2 CPU,
    2026-11-27; within 2e-4 on the AVX-512 CPUs of earlier runs). There the tolerance is twice
    TRL's own drift."""
    ref = train(trl.GRPOTrainer, model_dir, tmp_path / "trl", **BF16[name])
    ours = train(GRPOTrainer, model_dir, tmp_path / "ours", monkeypatch, **BF16[name])
    assert any(step.get("kl", 0) > 0 for step in ref)
    assert any(step.get("clip_ratio/region_mean", 1.0) > 0 for step in ref)
    floor = None
    if BF16[name].get("cast_lm_head_to_fp32"):
        floor = train(trl.GRPOTrainer, nudged_model_dir, tmp_path / "trl_nudged", **BF16[name])
    assert_same_logs(ref, ours, floor_logs=floor)


def _run_trl_multiprocess(tmp_path, flags: list) -> None:
    """tests/trl_multiprocess.py on 2 processes: stock TRL and the drop-in, every step's logs."""
    run = torchrun(2, ["tests/trl_multiprocess.py", *flags], 900, env={"OUTDIR": str(tmp_path)})
    assert run.returncode == 0 and "TRL MULTIPROCESS: PASS" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("bf16", [False, True])
def test_two_processes_parity_with_trl(bf16, tmp_path):
    """The drop-in under accelerate's multi-process data parallel (2 processes under torchrun, gloo
    on CPU): each process scores its half of every batch and DDP averages the gradients; every
    logged metric of 3 steps equals stock TRL's on 2 processes (tests/trl_multiprocess.py)."""
    _run_trl_multiprocess(tmp_path, ["--bf16"] if bf16 else [])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the device tool's nvidia-h100-x2)")
@pytest.mark.parametrize("bf16", [False, True])
def test_two_gpus_parity_with_trl(bf16, tmp_path):
    """The same on 2 GPUs over NCCL: the drop-in's CUDA kernels against TRL's head on cuBLAS,
    every logged metric of 3 steps (tests/trl_multiprocess.py --cuda), bf16 (TRL's default: the
    logits and their gradient rounded to bf16) and fp32; 2 x H200: worst 1.7e-7 and 3.2e-6
    (bench/results/trl_dropin_2gpu_h200x4_4ff4024.txt)."""
    _run_trl_multiprocess(tmp_path, ["--cuda"] + (["--bf16"] if bf16 else []))


def test_trl_head_probe_runs_on_cpu(capsys):
    """bench/probes/trl_head_probe.py (the drop-in's head against TRL's ChunkedLogProbFunction
    under bf16 autocast; its GPU runs are in bench/results) on CPU: log-probs and dX equal to
    TRL's head's bit for bit on every path, as both run the same fp32 products; dW too, but for
    the fused mode, whose dW GEMM reduces over the block's R row slots (its padded slots are 0)
    where TRL's reduces over the N rows: another K, so another blocking of the sum on some CPUs
    (1e-7 on an AVX2 CPU, none on the AVX-512 CPUs of earlier runs); its error against the float64 model of the
    same roundings stays TRL's."""
    from bench.probes import trl_head_probe
    trl_head_probe.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "run |" not in line]
    assert len(rows) == 8
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "trl":
            trl_dw_err = float(cells[7])
        assert cells[1:4] == ["0.0e+00", "0", "0.0e+00"], line
        if cells[0] == "fused":
            assert float(cells[4]) <= 1e-6 and float(cells[7]) <= 2 * trl_dw_err, line
        else:
            assert cells[4] == "0.0e+00", line
