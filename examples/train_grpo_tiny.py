"""Train a randomly initialised Qwen3-shaped model with GRPO through compiled_grpo's TRL drop-in.

    pip install -e ".[trl]" matplotlib
    python examples/train_grpo_tiny.py                       # CPU: a tiny model, about a minute
    python examples/train_grpo_tiny.py --size qwen3-0.6b     # GPU: Qwen3-0.6B's shape, bf16

The task is synthetic so nothing is downloaded: prompts "12 + 13 =" and a rule reward (the share
of the letter "a" among the completion's characters, plus a small bonus for stopping early), which
a random model can learn in a few dozen steps. The tokenizer is built here (one token per
character; the larger sizes pad the vocabulary with filler tokens up to the model's V). The only
line that differs from a plain TRL script is the import of ``GRPOTrainer``; ``--trainer trl`` runs
the stock ``trl.GRPOTrainer`` on the same seed for comparison. Writes ``train_grpo_tiny.png``
(loss, reward, entropy per step) and ``log_history.json`` to ``--output-dir``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from compiled_grpo.integrations.trl import GRPOTrainer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +="

# name: model shape, batch (completions per step = batch x grad accumulation), completion length, dtype
SIZES = {
    "tiny": dict(model=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=128),
                 batch=32, generations=8, completion=32, lr=2e-3, steps=150, bf16=False),
    "qwen3-0.6b": dict(model=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
                       batch=32, generations=8, completion=512, lr=1e-5, steps=100, bf16=True),
}


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One token per character; filler tokens <w{i}> pad the vocabulary to the model's size."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    vocab.update({f"<w{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_reward(max_len: int):
    def letter_a(completions, **kwargs):
        """Share of "a" among the completion's characters, + up to 0.2 for stopping early."""
        return [c.count("a") / max(len(c), 1) + 0.2 * (1 - len(c) / (4 * max_len)) for c in completions]
    return letter_a


class ProgressAndHistory(TrainerCallback):
    """A tqdm bar with the latest reward / loss / entropy, replacing the Trainer's printed dicts."""

    def __init__(self, total: int):
        self.bar, self.total = None, total

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=self.total, desc="GRPO", unit="step")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.update(state.global_step - self.bar.n)
            self.bar.set_postfix(reward=f"{logs.get('reward', float('nan')):.3f}", loss=f"{logs['loss']:.4f}",
                                 entropy=f"{logs.get('entropy', float('nan')):.3f}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = [h for h in history if "loss" in h]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key in zip(axes, ("loss", "reward", "entropy")):
        pts = [(h["step"], h[key]) for h in logs if key in h]  # reward: logged on generation steps only
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="tiny", help="tiny (CPU, ~1 min) or qwen3-0.6b (GPU)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
    p.add_argument("--trainer", choices=("compiled_grpo", "trl"), default="compiled_grpo",
                   help="compiled_grpo's drop-in or the stock trl.GRPOTrainer, same seed")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.02, help="KL to the reference model (0 drops the reference)")
    p.add_argument("--compile", action="store_true",
                   help="compile the loss (GRPOTrainer(compile_loss=True)); on CPU the first, cold Inductor "
                   "compile takes 1-2 min on 2 cores, later runs hit the cache")
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "train_grpo_tiny"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    size = SIZES[a.size]
    steps = a.steps or size["steps"]
    gpu = torch.cuda.is_available()
    if a.size != "tiny" and not gpu:
        print(f"warning: --size {a.size} is meant for a GPU; this will be very slow on CPU")
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # weight-loading bars; the training bar is ours
    os.makedirs(a.output_dir, exist_ok=True)

    # A random model saved to disk: TRL loads the reference model (beta > 0) from the policy's path.
    torch.manual_seed(a.seed)
    model_dir = os.path.join(a.output_dir, f"model-{a.size}")
    tokenizer = char_tokenizer(size["model"]["vocab_size"])
    config = Qwen3Config(**size["model"], max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, tie_word_embeddings=a.size != "tiny")
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    n_params = sum(t.numel() for t in Qwen3ForCausalLM(config).parameters()) if a.size == "tiny" else None

    prompts = Dataset.from_dict({"prompt": [f"{i} + {i + 1} =" for i in range(512)]})
    args = trl.GRPOConfig(
        output_dir=a.output_dir, max_steps=steps, per_device_train_batch_size=size["batch"],
        num_generations=size["generations"], max_completion_length=size["completion"], learning_rate=size["lr"],
        loss_type=a.loss_type, beta=a.beta, temperature=1.0, logging_steps=1, seed=a.seed, bf16=size["bf16"] and gpu,
        use_cpu=not gpu, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer_cls = GRPOTrainer if a.trainer == "compiled_grpo" else trl.GRPOTrainer
    kwargs = {"compile_loss": True} if a.compile and a.trainer == "compiled_grpo" else {}
    trainer = trainer_cls(model=model_dir, reward_funcs=make_reward(size["completion"]), args=args,
                          train_dataset=prompts, processing_class=tokenizer, callbacks=[ProgressAndHistory(steps)],
                          **kwargs)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)

    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0

    history = trainer.state.log_history
    with open(os.path.join(a.output_dir, "log_history.json"), "w") as f:
        json.dump(history, f, indent=1)
    png = os.path.join(a.output_dir, "train_grpo_tiny.png")
    device = torch.cuda.get_device_name() if gpu else "CPU"
    plot(history, png, f"{a.trainer} GRPOTrainer, {a.size} ({a.loss_type}, beta={a.beta}), {device}")
    rewards = [h["reward"] for h in history if "reward" in h]
    k = max(1, len(rewards) // 5)
    print(f"{steps} steps in {seconds:.0f} s on {device}"
          + (f" ({n_params / 1e3:.0f}k parameters)" if n_params else "")
          + f"; mean reward first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} {sum(rewards[-k:]) / k:.3f}")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
