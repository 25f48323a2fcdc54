"""Data-parallel training steps with grpo_loss equal to one process: DDP and FSDP2 (fully_shard) on
a small HF causal LM, untied and tied lm_head, gradient accumulation over micro-batches.

    torchrun --standalone --nproc_per_node 2 -m bench.fsdp [--device cuda] [--steps 2]

Every rank builds the same model (Qwen2 architecture from a config, seeded init, float32) and the
same global batch of B sequences (prompt + completion, completions of different lengths,
advantages, old log-probs from a perturbed policy, ref log-probs). The reference runs on every
rank alone: all B sequences in micro-batches, loss.backward() each, one SGD step (momentum 0.9), per step.
Then each parallel wrapper runs the same steps with rank r taking its share of the micro-batches
(accumulating without gradient sync but on the last), and after each step every rank compares:

  loss       the global loss (sum of the ranks' micro-batch losses) against the reference's
  grads      every parameter's gradient (FSDP2: the DTensor's full_tensor()) against the
             reference's, before the optimizer step
  params     every parameter after the step

How the loss is normalized across ranks (the part peers get wrong): dapo divides by
num_items_in_batch, here the global count of completion tokens of the whole step (every rank's,
every micro-batch's), so the ranks' losses add up to the global loss; DDP and FSDP2 average
gradients over ranks, so each rank backpropagates world_size * its loss (what HF's Trainer does
for losses that take num_items_in_batch). The lm_head weight must be used inside the wrapped
module's forward for FSDP2 (PolicyLoss below: its parameters are unsharded there, and the tied
embedding is the same parameter), never a sharded DTensor read outside it.

Exit 1 if any check is off by more than float32 summation order (loss 1e-5 relative, grads and
params 1e-4 relative norm). Prints "FSDP CHECK: PASS" otherwise.
"""
import argparse
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist

import compiled_grpo as cg

CFG = cg.GRPOConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28, temperature=0.8)


class PolicyLoss(torch.nn.Module):
    """The model's decoder and grpo_loss on its last hidden states, in one forward: under FSDP2
    the root's parameters (embeddings, final norm, lm_head) are unsharded for all of it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, targets, adv, mask, old, ref, n_items):
        hidden = self.model.model(input_ids=input_ids).last_hidden_state[:, :-1]   # [B, T - 1, H]
        return cg.grpo_loss(hidden, self.model.lm_head.weight, targets, adv, mask, old, ref,
                            num_items_in_batch=n_items, config=CFG).loss


def build_model(tied: bool, device, vocab: int = 512, hidden: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.float32)
    if not tied:   # an untied head that differs from the embedding
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.05)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def make_steps(model, steps: int, micro: int, device, seed: int = 1):
    """[steps] of [micro] micro-batches, each a dict of the loss inputs; n_items per step."""
    g = torch.Generator().manual_seed(seed)
    b, t, prompt = 2, 24, 6                      # 2 sequences a micro-batch, 24 positions
    v = model.config.vocab_size
    out = []
    for _ in range(steps):
        batches = []
        for _ in range(micro):
            ids = torch.randint(0, v, (b, t), generator=g)
            comp = torch.randint(1, t - prompt, (b,), generator=g)       # completion lengths
            pos = torch.arange(t - 1)[None, :]
            mask = (pos >= prompt - 1) & (pos < prompt - 1 + comp[:, None])   # [B, T - 1]
            batches.append(dict(input_ids=ids, targets=ids[:, 1:], mask=mask,
                                adv=torch.randn(b, generator=g),
                                noise=torch.randn(2, b, t - 1, generator=g)))
        n_items = int(sum(int(m["mask"].sum()) for m in batches))
        for m in batches:
            for k, x in m.items():
                m[k] = x.to(device)
        with torch.no_grad():   # old: this policy, a little off (num_iterations > 1); ref: further
            for m in batches:
                h = model.model(input_ids=m["input_ids"]).last_hidden_state[:, :-1]
                lp = cg.token_logprobs(h, model.lm_head.weight, m["targets"], mask=m["mask"],
                                       temperature=CFG.temperature).logprobs
                m["old"] = lp + 0.05 * m["noise"][0]
                m["ref"] = lp + 0.2 * m["noise"][1]
        out.append((batches, n_items))
    return out


def _optimizer(params):
    """SGD with momentum: its step is linear in the gradients, so the parameters after it differ
    from the reference's by no more than the gradients do (Adam's normalization turns the
    rounding noise of a near-zero gradient into a full-size step of either sign)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _args(m, n_items):
    return (m["input_ids"], m["targets"], m["adv"], m["mask"], m["old"], m["ref"], n_items)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def reference(model, steps):
    """[(loss, {name: grad}, {name: param after}) a step] on one process, the whole batch."""
    pl = PolicyLoss(copy.deepcopy(model))
    opt = _optimizer(pl.parameters())
    res = []
    for batches, n_items in steps:
        opt.zero_grad()
        total = 0.0
        for m in batches:
            loss = pl(*_args(m, n_items))
            loss.backward()
            total += float(loss.detach())
        grads = {n: p.grad.detach().clone() for n, p in pl.named_parameters()}
        opt.step()
        res.append((total, grads, {n: p.detach().clone() for n, p in pl.named_parameters()}))
    return res


def parallel(model, steps, kind: str, rank: int, world: int, device):
    """The same steps under DDP or FSDP2, rank r taking micro-batches r, r + world, ..."""
    pl = PolicyLoss(copy.deepcopy(model))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(pl, device_ids=[device.index] if device.type == "cuda" else None)
        sync = lambda on: None                                                   # noqa: E731
        no_sync = wrapped.no_sync
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for layer in pl.model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(pl, mesh=mesh)
        sync = wrapped.set_requires_gradient_sync
        no_sync = None
    opt = _optimizer(wrapped.parameters())
    res = []
    for batches, n_items in steps:
        opt.zero_grad()
        mine = batches[rank::world]
        local = 0.0
        for i, m in enumerate(mine):
            last = i == len(mine) - 1
            sync(last)
            loss = wrapped(*_args(m, n_items))
            local += float(loss.detach())
            if no_sync is not None and not last:
                with no_sync():
                    (loss * world).backward()
            else:
                (loss * world).backward()    # DDP / FSDP2 average over ranks: undo it
        total = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        grads = {n: _full(p.grad).detach().clone() for n, p in pl.named_parameters()}
        opt.step()
        res.append((float(total), grads, {n: _full(p).detach().clone() for n, p in pl.named_parameters()}))
    return res


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per rank a step")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ok = True
    for tied in (False, True):
        model = build_model(tied, device, args.vocab, args.hidden)
        steps = make_steps(model, args.steps, args.micro * world, device)
        ref = reference(model, steps)
        for kind in ("ddp", "fsdp2"):
            got = parallel(model, steps, kind, rank, world, device)
            for s, ((l0, g0, p0), (l1, g1, p1)) in enumerate(zip(ref, got)):
                loss_err = abs(l1 - l0) / max(abs(l0), 1e-30)
                grad_err = max(_rel(g1[n], g0[n]) for n in g0)
                param_err = max(_rel(p1[n], p0[n]) for n in p0)
                head = "lm_head tied" if tied else "lm_head untied"
                good = loss_err < 1e-5 and grad_err < 1e-4 and param_err < 1e-4
                ok &= good
                errs = torch.tensor([loss_err, grad_err, param_err], dtype=torch.float64, device=device)
                dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                if rank == 0:
                    print(f"{kind:5s} {head:14s} step {s}: loss {l1:+.6f} (one process {l0:+.6f}), "
                          f"max over ranks: loss rel {errs[0]:.1e}, grads rel {errs[1]:.1e}, "
                          f"params rel {errs[2]:.1e} {'ok' if good else 'FAIL'}", flush=True)
    flag = torch.tensor(int(ok), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world} ranks, {args.device}, V = {args.vocab}, H = {args.hidden}, {args.steps} steps of "
              f"{args.micro * world} micro-batches")
        print("FSDP CHECK: " + ("PASS" if int(flag) else "FAIL"), flush=True)
    code = 0 if int(flag) else 1
    gc.collect()        # the DDP / FSDP2 wrappers' process-group users, before the group goes
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: a gloo worker thread still joinable at exit aborted one rank
    # ("terminate called without an active exception") after a passing run, now and then
    os._exit(code)


if __name__ == "__main__":
    main()
