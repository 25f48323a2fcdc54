"""verl's actor update on one GPU, engine against engine: compiled_grpo's (strategy=compiled_grpo,
compiled_grpo/integrations/verl_engine.py) and verl 0.9.1's own FSDP2 engine with its logits
(``torch``, verl's default), with its fused-kernel backends (``verl_fused_torch``,
``verl_fused_triton``) and with compiled_grpo's backend (``backend``, the recompute op). World
size 1, no Ray: each engine is built and driven as verl's TrainingWorker does (``initialize``,
``train_batch`` with ``partial(ppo_loss, config=actor)`` on a rollout-shaped batch through
``left_right_2_no_padding``). verl's default actor precision: fp32 parameters, bf16 compute.

Per engine: the update's time (median of --reps after one warm-up), the peak memory it adds
beyond the parameters and optimizer state, the grad norm and verl's pg_loss of the first update.
For ours also the head alone: the lm_head call of the first micro-batch (where the fused mode
does all three GEMMs), against ``cg.grpo_loss`` fused forward + backward on the same tensors
outside the engine (the bar: within 3%).

    python -m bench.verl_engine --model qwen3-0.6b          # 28 layers, tied head
    python -m bench.verl_engine --model qwen3-8b-head       # 2 layers of Qwen3-8B, its untied head

Attention is sdpa (the GPU image has no flash-attn): verl's remove-padding batch then attends
across its packed sequences, the same for every engine; the head sees the same rows either way.
``--cpu`` runs a tiny model on CPU (bench/verl_cpu.py's platform) to check the script.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

MODELS = {   # Qwen3Config fields
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b-head": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "cpu-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}
ENGINES = ("compiled_grpo", "backend", "verl_fused_triton", "verl_fused_torch", "torch")
ACTOR = dict(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
             clip_ratio_low=0.2, clip_ratio_high=0.28)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def save_model(path: str, model: str, vocab: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=4096, **MODELS[model])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(path)


def rollout(B: int, P: int, R: int, vocab: int, old=None, seed: int = 0):
    """B sequences: prompts of P//4..P tokens (left-padded), responses of R//4..R (right-padded),
    per-sequence advantages, ref log-probs; ``old`` the old log-probs [B, R] (random if None)."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding
    g = torch.Generator().manual_seed(seed)
    pl = torch.randint(P // 4, P + 1, (B,), generator=g)
    rl = torch.randint(R // 4, R + 1, (B,), generator=g)
    ids = torch.randint(0, vocab, (B, P + R), generator=g)
    cols = torch.arange(P + R)
    attn = (((cols >= P - pl[:, None]) & (cols < P)) | ((cols >= P) & (cols < P + rl[:, None]))).long()
    fields = {"input_ids": ids, "prompts": ids[:, :P], "responses": ids[:, P:], "attention_mask": attn,
              "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": attn[:, P:].clone(),
              "old_log_probs": -torch.rand(B, R, generator=g) * 4 - 10 if old is None else old,
              "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous(),
              "ref_log_prob": -torch.rand(B, R, generator=g) * 4 - 10}
    return left_right_2_no_padding(DataProto.from_single_dict(fields).to_tensordict())


def with_keys(td, micro: int, fused: bool, temperature: float = 1.0, global_batch_size=None):
    """The keys verl's trainer (``_update_actor``) and training worker set on the batch."""
    from verl.utils import tensordict_utils as tu
    gbs = td.batch_size[0] if global_batch_size is None else global_batch_size
    tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=gbs, use_remove_padding=True,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=micro, use_fused_kernels=fused,
                         temperature=temperature)
    return td


def build(kind: str, path: str, cpu: bool, lr: float = 1e-6):
    """An initialized engine of ``kind`` (ENGINES) on the saved model; ``cpu``: fp32 throughout
    (verl's default bf16 compute otherwise), no torch.compile of verl's entropy."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    import compiled_grpo.integrations.verl  # noqa: F401  (the plugin: backend and engine)
    backends = {"backend": "compiled_grpo", "verl_fused_torch": "torch", "verl_fused_triton": "triton"}
    fused = (dict(use_fused_kernels=True, fused_kernel_options={"impl_backend": backends[kind]})
             if kind in backends else {})
    model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                          enable_gradient_checkpointing=not cpu, override_config={"attn_implementation": "sdpa"},
                          **fused)
    extra = dict(mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                 model_dtype="fp32", use_torch_compile=False) if cpu else {}
    cfg = FSDPEngineConfig(strategy="fsdp2", use_dynamic_bsz=False, **extra)
    # what ActorConfig.__post_init__ does with actor.strategy (FSDPEngineConfig's own assert knows
    # fsdp / fsdp2 / fsdp_turbo only)
    object.__setattr__(cfg, "strategy", "compiled_grpo" if kind == "compiled_grpo" else "fsdp2")
    if kind == "compiled_grpo":
        cls = EngineRegistry.get_engine_cls("language_model", cfg.strategy)
    else:   # what verl's registry gives for fsdp2 on cuda / npu (it has no cpu entry)
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as cls
    eng = cls(model_config=model, engine_config=cfg, checkpoint_config=CheckpointConfig(),
              optimizer_config=FSDPOptimizerConfig(lr=lr, clip_grad=1.0, total_training_steps=100))
    eng.initialize()
    return eng


class HeadTimer:
    """Wraps ``compiled_grpo.grpo_loss`` (what the engine's head calls: in the fused mode its
    forward does all three GEMMs) to time each call and keep the first call's inputs."""

    def __init__(self):
        import compiled_grpo
        self.module, self.original, self.ms, self.inputs = compiled_grpo, compiled_grpo.grpo_loss, [], None
        compiled_grpo.grpo_loss = self

    def __call__(self, hidden, weight, *args, **kwargs):
        if self.inputs is None:
            self.inputs = (hidden.detach().clone(), weight.detach().clone(), args, kwargs)
        _sync()
        t0 = time.perf_counter()
        out = self.original(hidden, weight, *args, **kwargs)
        _sync()
        self.ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def close(self):
        self.module.grpo_loss = self.original


def standalone_head_ms(timer: HeadTimer, reps: int) -> float:
    """grpo_loss forward + backward on the first head call's tensors (a copy of the unsharded
    head weight), outside the engine."""
    hidden, weight, args, kwargs = timer.inputs
    weight = weight.requires_grad_()
    times = []
    for _ in range(reps + 1):
        h = hidden.clone().requires_grad_()
        weight.grad = None
        _sync()
        t0 = time.perf_counter()
        timer.original(h, weight, *args, **kwargs).loss.backward()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def run_engine(kind, path, batch, micro, reps, cpu):
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.config import ActorConfig
    from transformers import Qwen3ForCausalLM
    forward = Qwen3ForCausalLM.forward   # verl's fused-kernel backends patch the class
    timer = HeadTimer() if kind == "compiled_grpo" else None
    row = {"engine": kind}
    try:
        eng = build(kind, path, cpu)
        actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=batch.batch_size[0], rollout_n=1,
                            ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=False, **ACTOR)
        loss_fn = functools.partial(ppo_loss, config=actor)
        fused = kind.startswith("verl_fused") or kind == "backend"
        times, base = [], None
        for step in range(reps + 1):
            td = with_keys(batch.clone(), micro, fused)
            if step == 1:   # Adam's state exists after the first step
                _sync()
                if torch.cuda.is_available():
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
            _sync()
            t0 = time.perf_counter()
            with eng.train_mode():
                out = eng.train_batch(td, loss_function=loss_fn)
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if step == 0:
                m = out["metrics"]
                row["grad_norm"] = float(m["grad_norm"])
                row["pg_loss"] = float(m["actor/pg_loss"].aggregate())
                row["entropy"] = float(m["actor/entropy_loss"].aggregate())
        row["update_ms"] = round(statistics.median(times[1:]), 2)
        if base is not None:
            row["peak_beyond_state_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        if timer is not None:   # the first micro-batch's head, in the timed updates
            calls = len(timer.ms) // (reps + 1)
            row["head_ms_in_engine"] = round(statistics.median(timer.ms[calls::calls]), 2)
        del eng
    except Exception as e:   # noqa: BLE001: a peer engine failing is a row of the result
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        Qwen3ForCausalLM.forward = forward
        if timer is not None:
            timer.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row, timer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_size_per_gpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=None, help="a folder for verl_engine.json")
    args = ap.parse_args()
    vocab = 512 if args.model == "cpu-tiny" else 151936
    if args.cpu:
        from verl.plugin.platform.platform_manager import set_platform
        from bench.verl_cpu import PlatformCPU
        set_platform(PlatformCPU())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    path = tempfile.mkdtemp(prefix="verl_engine_model_")
    save_model(path, args.model, vocab)
    batch = rollout(args.seqs, args.prompt, args.response, vocab)
    n = int(batch["input_ids"].offsets()[-1])
    valid = int(batch["response_mask"].sum())
    print(f"model {args.model}, {args.seqs} sequences, {n} packed tokens, {valid} response tokens, "
          f"micro-batches of {args.micro}", flush=True)
    rows = []
    for kind in args.engines:
        row, timer = run_engine(kind, path, batch, args.micro, args.reps, args.cpu)
        if timer is not None and timer.inputs is not None and "error" not in row:
            row["head_ms_standalone"] = round(standalone_head_ms(timer, args.reps), 2)
            row["head_vs_standalone"] = round(row["head_ms_in_engine"] / row["head_ms_standalone"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    ours = next((r for r in rows if r["engine"] == "compiled_grpo" and "error" not in r), None)
    for r in rows:
        if ours and "error" not in r and r is not ours:
            print(f"CHECK {r['engine']}: grad_norm rel {abs(ours['grad_norm'] - r['grad_norm']) / r['grad_norm']:.2e}, "
                  f"pg_loss {ours['pg_loss']:.6f} / {r['pg_loss']:.6f}, update {r['update_ms'] / ours['update_ms']:.2f}x ours")
    if args.out:
        with open(os.path.join(args.out, "verl_engine.json"), "w") as f:
            json.dump({"args": vars(args), "tokens": n, "response_tokens": valid, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
