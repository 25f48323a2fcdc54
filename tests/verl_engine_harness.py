"""verl 0.9.1's own FSDP engine run for real on CPU gloo ranks (tests/test_verl_engine.py): a tiny
Qwen3 saved to disk, verl's configs, ``engine.initialize()`` and ``engine.train_batch`` /
``infer_batch`` on rollout-shaped batches (left-padded prompts, right-padded responses, through
verl's ``left_right_2_no_padding`` as its trainer does), three actor updates.

Each worker sets bench/verl_cpu.py's PlatformCPU (verl's platform interface for a CPU process)
before an engine is built.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from bench.verl_cpu import PlatformCPU
from bench.verl_engine import build, save_model, with_keys

V, B, P, R = 512, 4, 6, 8       # vocab, sequences in the global batch, prompt and response widths
STEPS = 3
ENGINES = ("torch", "backend", "compiled_grpo")   # bench.verl_engine's: verl's logits, our backend, ours


def rollout(step: int, old_log_probs=None, rows=slice(None), is_weights: bool = True):
    """A global batch as verl's trainer hands it to the actor (DataProto -> TensorDict ->
    left_right_2_no_padding): B sequences, one response token masked, per-token advantages;
    ``rows``: a data-parallel rank's share."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding
    g = torch.Generator().manual_seed(100 + step)
    prompt_len, resp_len = [6, 4, 5, 3], [8, 5, 7, 2]
    ids = torch.randint(0, V, (B, P + R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        attn[i, P - prompt_len[i]:P] = 1
        attn[i, P:P + resp_len[i]] = 1
    resp_mask = attn[:, P:].clone()
    resp_mask[0, 3] = 0
    fields = {"input_ids": ids, "prompts": ids[:, :P], "responses": ids[:, P:], "attention_mask": attn,
              "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": resp_mask,
              "old_log_probs": -torch.rand(B, R, generator=g) * 2 - 5.5 if old_log_probs is None else old_log_probs,
              "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous(),
              "ref_log_prob": -torch.rand(B, R, generator=g) * 2 - 5.5,
              "rollout_is_weights": 0.5 + torch.rand(B, R, generator=g)}
    if not is_weights:
        del fields["rollout_is_weights"]
    fields = {k: v[rows] for k, v in fields.items()}
    return left_right_2_no_padding(DataProto.from_single_dict(fields).to_tensordict())


def actor_config(**kw):
    from verl.workers.config import ActorConfig
    base = dict(strategy="fsdp2", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                use_dynamic_bsz=False, clip_ratio_low=0.2, clip_ratio_high=0.28)
    return ActorConfig(**{**base, **kw})


def updates(kind: str, model_path: str, actor_kw: dict, rank: int, world: int, micro: int,
            temperature: float = 0.7, lr: float = 1e-3, on_policy: bool = False,
            is_weights: bool = True) -> dict:
    """STEPS actor updates of `kind`'s engine with verl's ppo_loss: per step the grad norm and
    verl's metrics (aggregated as verl's worker does); the parameters after the last."""
    from transformers import Qwen3ForCausalLM
    forward = Qwen3ForCausalLM.forward   # verl's apply_monkey_patch (the backend) patches the class
    try:
        return _updates(kind, model_path, actor_kw, rank, world, micro, temperature, lr, on_policy, is_weights)
    finally:
        Qwen3ForCausalLM.forward = forward


def _updates(kind, model_path, actor_kw, rank, world, micro, temperature, lr, on_policy, is_weights):
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding
    eng = build(kind, model_path, cpu=True, lr=lr)
    loss_fn = functools.partial(ppo_loss, config=actor_config(**actor_kw))
    fused = kind in ("backend", "verl_fused_torch")
    out = {"grad_norm": [], "metrics": []}
    n = B // world
    rows = slice(rank * n, (rank + 1) * n)
    for step in range(STEPS):
        td = with_keys(rollout(step, rows=rows, is_weights=is_weights), micro, fused, temperature, B)
        if on_policy:   # verl's compute_log_prob: the old log-probs from this engine, then the update
            with eng.eval_mode():
                lp = eng.infer_batch(td)["model_output"]["log_probs"]
            old = torch.zeros(B, R)
            old[rows] = no_padding_2_padding(lp, td)
            td = with_keys(rollout(step, old_log_probs=old, rows=rows, is_weights=is_weights), micro, fused, temperature, B)
        with eng.train_mode():
            res = eng.train_batch(td, loss_function=loss_fn)
        m = res["metrics"]
        out["grad_norm"].append(float(m.pop("grad_norm")))
        out["metrics"].append({k: float(v.aggregate()) if hasattr(v, "aggregate") else v for k, v in m.items()})
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in eng.module.named_parameters()}
    return out


def worker(rank: int, world: int, init_file: str, model_path: str, out_dir: str, runs: list) -> None:
    """Each run (name, engine kind, actor settings, micro-batch size, extra) on this process group;
    rank 0 saves the results (and what the engine logged) as out_dir/name.pt."""
    from verl.plugin.platform.platform_manager import set_platform
    set_platform(PlatformCPU())
    torch.set_num_threads(1)
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("compiled_grpo.integrations.verl_engine").addHandler(handler)
    try:
        for name, kind, actor_kw, micro, extra in runs:
            records.clear()
            try:
                res = updates(kind, model_path, actor_kw, rank, world, micro, **extra)
            except Exception as e:   # noqa: BLE001: verl's own engine failing is a result here
                res = {"error": f"{type(e).__name__}: {e}"}
            res["log"] = list(records)
            if rank == 0:
                torch.save(res, os.path.join(out_dir, f"{name}.pt"))
    finally:
        dist.destroy_process_group()
