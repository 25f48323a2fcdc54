"""verl 0.9.1 with compiled_grpo's engine: a few actor updates of a tiny Qwen3 through verl's own
FSDP2 engine on CPU, selected as verl's config selects it.

    pip install -e ".[verl]"             # verl 0.9.1 (transformers < 5.11): a venv of its own
    python examples/verl_engine_tiny.py [--steps 3]

``actor_rollout_ref.actor.strategy=compiled_grpo`` is the one config line (docs/verl.md): verl's
``FSDPActorConfig`` carries the strategy into its engine config, and its training worker builds the
engine with ``EngineRegistry.new(backend=strategy)``, which finds compiled_grpo's engine (registered
when verl loads compiled_grpo's plugin; imported here). Each step does what verl's trainer asks of
the actor: ``infer_batch`` for the old log-probs (verl's compute_log_prob), then ``train_batch`` with
verl's own ``ppo_loss``, whose gradient this engine forms in grpo_loss's fused mode. The metrics are
verl's; on-policy its ppo_kl is exactly 0 (the old log-probs are the fused loss's bits).

verl's full trainer needs Ray and a rollout engine (vLLM / SGLang) on GPUs; this runs the level
below, the engine, in one process (gloo, verl's platform interface set for CPU: bench/verl_cpu.py).
"""
import argparse
import functools
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/ of the checkout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)

    from verl.plugin.platform.platform_manager import set_platform
    from bench.verl_cpu import PlatformCPU
    set_platform(PlatformCPU())          # a CPU process: verl would fall back to CUDA
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)

    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    import compiled_grpo.integrations.verl  # noqa: F401  (what verl's plugin loading does)
    from bench.verl_engine import rollout, save_model, with_keys

    path = tempfile.mkdtemp()
    save_model(path, "cpu-tiny", 512)
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    actor = FSDPActorConfig(
        strategy="compiled_grpo",                                   # the config line
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, use_dynamic_bsz=False,
        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.001,
        use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl",
        optim=FSDPOptimizerConfig(lr=1e-3, total_training_steps=args.steps),
        fsdp_config=FSDPEngineConfig(model_dtype="fp32", mixed_precision=fp32, use_torch_compile=False))
    model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                          enable_gradient_checkpointing=False, override_config={"attn_implementation": "sdpa"})
    engine = EngineRegistry.new(model_type="language_model", backend=actor.engine.strategy, model_config=model,
                                engine_config=actor.engine, optimizer_config=actor.optim,
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    print(f"engine: {type(engine).__name__} (strategy={actor.engine.strategy!r})")
    loss_fn = functools.partial(ppo_loss, config=actor)   # what verl's worker sets

    for step in range(args.steps):
        batch = with_keys(rollout(4, 8, 16, 512, seed=step), micro=2, fused=False)
        with engine.eval_mode():                              # verl's compute_log_prob
            logprobs = engine.infer_batch(batch)["model_output"]["log_probs"]
        old = no_padding_2_padding(logprobs, batch)
        batch = with_keys(rollout(4, 8, 16, 512, old=old, seed=step), micro=2, fused=False)
        with engine.train_mode():
            out = engine.train_batch(batch, loss_function=loss_fn)
        m = {k: (v.aggregate() if hasattr(v, "aggregate") else v) for k, v in out["metrics"].items()}
        print(f"step {step}: pg_loss {m['actor/pg_loss']:+.6f} entropy {m['actor/entropy_loss']:.4f} "
              f"kl_loss {m['kl_loss']:.3e} ppo_kl {m['actor/ppo_kl']:.1e} grad_norm {m['grad_norm']:.4f}")
        assert m["actor/ppo_kl"] == 0.0, "on-policy: the old log-probs are the fused loss's own bits"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
