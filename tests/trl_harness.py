"""The harness of the TRL parity tests (tests/test_trl_integration.py, test_trl_options.py,
trl_multiprocess.py): the tiny random Qwen3 (H=32, V=48, a character tokenizer), the rule reward,
the trainer arguments, 3 training steps of either trainer, and the step-by-step comparison of
their logs."""
import torch
import trl
import trl.trainer.utils
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from compiled_grpo.integrations.trl import GRPOTrainer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +="
LOSS_METRICS = ("loss", "grad_norm", "kl", "entropy", "policy_loss", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio",
                "vespo/phi_seq_mean")
SAME_BATCH = ("reward", "reward_std", "completions/mean_length", "num_tokens")


def char_tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def save_model(path) -> None:
    """The random test model and its tokenizer, saved (TRL builds the reference model from the
    policy's path when beta > 0)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)


def count_a(completions, **kwargs):
    return [c.count("a") / 4 + len(c) / 64 for c in completions]


def make_args(out, **overrides):
    # num_iterations=2, a large lr and a small epsilon: the second update of each batch is off-policy
    # enough that every clip ratio is non-zero.
    base = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
                max_steps=3, logging_steps=1, learning_rate=3e-2, beta=0.04, epsilon=0.05, num_iterations=2,
                bf16=False, use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    return trl.GRPOConfig(**{**base, **overrides})


def train(trainer_cls, model_dir, out, monkeypatch=None, trainer_kwargs=None, **overrides):
    dataset = Dataset.from_dict({"prompt": [f"{i} + {i + 1} =" for i in range(16)]})
    trainer = trainer_cls(model=model_dir, reward_funcs=count_a, args=make_args(out, **overrides),
                          train_dataset=dataset, processing_class=char_tokenizer(), **(trainer_kwargs or {}))
    calls = {"grpo_loss": 0}
    if trainer_cls is GRPOTrainer:  # prove the loss is ours and TRL's fused head never runs
        inner = trainer._grpo_loss

        def counted(*args, **kwargs):
            calls["grpo_loss"] += 1
            return inner(*args, **kwargs)

        trainer._grpo_loss = counted

        def trl_head(*args, **kwargs):
            raise AssertionError("TRL's fused lm_head ran inside compiled_grpo's trainer")

        monkeypatch.setattr(trl.trainer.utils._ChunkedLogProbFunction, "apply", trl_head)
    trainer.train()
    if trainer_cls is GRPOTrainer:
        monkeypatch.undo()
        assert calls["grpo_loss"] == 3 * trainer.args.gradient_accumulation_steps
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_same_logs(ref_logs, our_logs, rtol=2e-4, atol=2e-6, floor_logs=None):
    """Every loss metric of every step within rtol (or atol) of stock TRL's. ``floor_logs``: stock
    TRL's logs from the same model with its lm_head weight one ulp away
    (test_trl_integration.nudged_model_dir): where a rounding-level change of the gradients
    already moves TRL's own trajectory by more than rtol (bf16 autocast over an fp32 head), a
    metric may differ by up to twice that drift."""
    assert len(ref_logs) == len(our_logs) == 3 and (floor_logs is None or len(floor_logs) == 3)
    worst = 0.0
    for step, (ref, ours) in enumerate(zip(ref_logs, our_logs)):
        assert set(ref) == set(ours), f"step {step}: logged names differ: {set(ref) ^ set(ours)}"
        for name in SAME_BATCH:
            if name in ref:
                assert ours[name] == ref[name], f"step {step} {name}: different batch ({ours[name]} vs {ref[name]})"
                if floor_logs is not None:   # the drift is measured on the same batches
                    assert floor_logs[step][name] == ref[name], f"step {step} {name}: the floor run's batch differs"
        for name in LOSS_METRICS:
            if name in ref:
                a, b = ref[name], ours[name]
                tol = max(rtol * abs(a), atol)
                if floor_logs is not None:
                    tol = max(tol, 2 * abs(floor_logs[step][name] - a))
                assert abs(a - b) <= tol, f"step {step} {name}: TRL {a} vs ours {b} (tolerance {tol:.1e})"
                worst = max(worst, abs(a - b) / max(abs(a), 1e-3))
    return worst
