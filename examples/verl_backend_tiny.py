"""verl 0.9.1 with compiled_grpo: a few actor updates of a tiny Qwen3 on CPU, the level below verl's
engine (docs/verl.md says why: its actor update runs in FSDP engine workers under Ray).

    pip install -e ".[verl]"             # verl 0.9.1 (transformers < 5.11): a venv of its own
    python examples/verl_backend_tiny.py [--steps 3]

What verl's engine does with `use_fused_kernels=True` and
`fused_kernel_options.impl_backend=compiled_grpo`, by hand: verl's own `apply_monkey_patch` puts
compiled_grpo's backend into the model class; each step packs a micro-batch the remove-padding
way ([1, nnz] input_ids, positions restarting per sequence, the rolled labels as shift_labels),
runs the patched forward with the rollout temperature (log-probs and entropy, no [nnz, V]
logits), takes the old log-probs from the same forward under no_grad (on-policy: the ratio is
exactly 1), and applies verl's own loss (core_algos' policy loss, agg_loss and kl_penalty as
verl/workers/utils/losses.py composes them). The same loss from compiled_grpo's mapping
(integrations.verl_config.grpo_config on the same ActorConfig, with cg.grpo_loss on the hidden
states) is printed beside it each step.
"""
import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig

import compiled_grpo as cg
from compiled_grpo.integrations.verl import BACKEND
from compiled_grpo.integrations.verl_config import grpo_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    V = 512
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg)
    reference = Qwen3ForCausalLM(cfg)
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):   # what verl's engine calls for the actor and the reference
        apply_monkey_patch(model=m, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=BACKEND)
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                            loss_agg_mode="token-mean", policy_loss=PolicyLossConfig(loss_mode="vanilla"),
                            use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.01)
    temperature = 0.9
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        lens = torch.randint(8, 24, (4,), generator=g)                   # 4 sequences, packed
        ids = torch.randint(0, V, (1, int(lens.sum())), generator=g)
        pos = torch.cat([torch.arange(int(n)) for n in lens])[None]
        labels = ids.roll(-1, -1)                                       # verl's input_ids_rmpad_rolled
        batch = dict(input_ids=ids, position_ids=pos, shift_labels=labels, use_cache=False,
                     return_dict=True, temperature=temperature)
        resp = torch.ones_like(ids, dtype=torch.float)                  # every token a response token
        ends = lens.cumsum(0) - 1
        resp[0, ends] = 0                                               # a sequence's last label wraps: masked
        adv = torch.randn(4, generator=g).repeat_interleave(lens)[None]  # one advantage a sequence
        with torch.no_grad():
            old = model(**batch).log_probs                              # on-policy old log-probs
            ref = reference(**batch).log_probs
        out = model(**batch)
        assert torch.equal(out.log_probs.detach(), old)                 # ratio exactly 1 on-policy
        pg, _ = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=out.log_probs, advantages=adv,
                                              response_mask=resp, loss_agg_mode="token-mean", config=actor)
        kl = agg_loss(loss_mat=kl_penalty(out.log_probs, ref, "low_var_kl"), loss_mask=resp,
                      loss_agg_mode="token-mean")
        loss = pg + actor.kl_loss_coef * kl
        # the same loss from compiled_grpo's mapping of the same settings, on the hidden states
        with torch.no_grad():
            # use_cache=False as verl passes it: HF then masks each packed sequence on its own
            hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            mapped = cg.grpo_loss(hidden, model.lm_head.weight, labels, adv, resp.bool(), old, ref,
                                  config=grpo_config(actor, temperature=temperature)).loss
        assert abs(mapped.item() - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (mapped, loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: verl's loss {loss.item():+.6f}, compiled_grpo's mapping {mapped.item():+.6f}, "
              f"entropy {out.entropy[resp.bool()].mean().item():.4f}")


if __name__ == "__main__":
    main()
