"""A long compiled training run: does the compiled step stay steady?

    python -m bench.long_run [--steps 1000] [--layers 2 --hidden 256 --vocab 32768] [--out DIR]

Trains two copies of one tiny Qwen3 (fp32, SDPA; bench.e2e.build_model) side by side, one with
the loss step eager and one with it under torch.compile (the backbone's forward, the slicing and
cg.grpo_loss in one compiled function; the backward and the SGD step outside), on the same
batches: B sequences of P prompt + T completion tokens where every step draws T from TS and the
completion lengths from U[1, T] (padding), and every other step hands the loss the valid tokens
packed (an index and cu_seqlens made outside the step, as a trainer's collator would). Reported
and checked:

  recompiles   the compiled step's frames (a CompileCounter backend around Inductor): after the
               warm-up steps no new frame (a new T, or padded / packed, is a dynamic size, not a
               new graph, past the first of each: DYNAMIC_FRAMES);
  memory       torch.cuda.memory_allocated() after every step: no growth past the warm-up
               beyond MEM_SLACK_KIB, with the steps where it rose (mem_new_highs);
  losses       compiled against eager at steps 1, 10, 100 and the last: |a - b| <= ATOL + RTOL |b|
               (fp32 everywhere: the two runs differ by the compiled backbone's fp32 rounding,
               which the SGD steps carry forward).

Without a GPU: 20 steps on CPU, a smoke test of the same code (gradient_mode "auto": recompute
on CPU, fused on CUDA).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

WARMUP = 20
DYNAMIC_FRAMES = 4     # padded and packed, each once static and once dynamic
ATOL, RTOL = 1e-4, 1e-3
TS = (64, 96, 128, 160)
# allocated-memory growth allowed after the warm-up: one-off small buffers (a first call at a
# new size), not a per-step leak, which 1000 steps would show as MiB
MEM_SLACK_KIB = 16


def batches(steps: int, B: int, P: int, V: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        T = TS[int(torch.randint(0, len(TS), (1,), generator=g))]
        ids = torch.randint(0, V, (B, P + T), generator=g)
        lens = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T)[None, :] < lens[:, None]                      # [B, T]
        adv = torch.randn(B, generator=g)
        batch = dict(ids=ids.to(device), mask=mask.to(device), adv=adv.to(device), P=P)
        if i % 2:   # packed: the valid tokens' flat index and cu_seqlens, made on the host
            batch["keep"] = mask.reshape(-1).nonzero()[:, 0].to(device)
            batch["cu"] = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device)
        yield batch


def loss_step(model, config):
    import compiled_grpo as cg

    def step(ids, mask, adv, P, keep=None, cu=None):
        h = model.model(input_ids=ids).last_hidden_state[:, P - 1:-1]         # [B, T, H]
        y = ids[:, P:]
        w = model.lm_head.weight
        if keep is None:
            return cg.grpo_loss(h, w, y, adv, mask, config=config).loss
        hv = h.reshape(-1, h.shape[-1]).index_select(0, keep)               # [N_valid, H]
        yv = y.reshape(-1).index_select(0, keep)
        return cg.grpo_loss(hv, w, yv, adv, torch.ones_like(yv, dtype=torch.bool),
                            cu_seqlens=cu, config=config).loss
    return step


def run(steps: int, layers: int, hidden: int, vocab: int, B: int, P: int, device) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    import compiled_grpo as cg
    from bench.e2e import build_model
    torch._dynamo.reset()
    eager_model = build_model(layers, hidden, vocab, P + max(TS), device, torch.float32)
    comp_model = copy.deepcopy(eager_model)
    config = cg.GRPOConfig(loss_type="dapo", beta=0.0)
    cnt = CompileCounterWithBackend("inductor")
    runs = {"eager": (eager_model, loss_step(eager_model, config)),
            "compiled": (comp_model, torch.compile(loss_step(comp_model, config), backend=cnt))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, (m, _) in runs.items()}
    checks = sorted({1, 10, 100, steps} & set(range(1, steps + 1)))
    losses = {k: {} for k in runs}
    mem, frames, t0 = [], {}, time.perf_counter()
    for i, batch in enumerate(batches(steps, B, P, vocab, device), start=1):
        for k, (model, fn) in runs.items():
            loss = fn(**batch)
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if i in checks:
                losses[k][i] = float(loss.detach())
        if device.type == "cuda":
            mem.append(torch.cuda.memory_allocated(device))
        frames[i] = cnt.frame_count
    out = dict(steps=steps, device=str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
               torch=torch.__version__, seconds=round(time.perf_counter() - t0, 1),
               frames=cnt.frame_count, frames_at_warmup=frames[min(WARMUP, steps)],
               losses={i: (losses["eager"][i], losses["compiled"][i]) for i in checks})
    if mem:
        w = min(WARMUP, steps)
        after = mem[w - 1:]
        out.update(mem_after_warmup_mib=round(after[0] / 2**20, 3),
                   mem_growth_kib=round((max(after) - after[0]) / 2**10, 1),
                   # the steps after the warm-up whose allocated memory rose past every earlier one's
                   mem_new_highs={i + w: mem[i + w - 1] - after[0] for i in range(1, len(after))
                                  if after[i] > max(after[:i])})
    out["ok"] = bool(out["frames"] == out["frames_at_warmup"] <= DYNAMIC_FRAMES
                     and out.get("mem_growth_kib", 0) <= MEM_SLACK_KIB
                     and all(abs(a - b) <= ATOL + RTOL * abs(a) for a, b in out["losses"].values()))
    return out


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000 if cuda else 20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256 if cuda else 64)
    p.add_argument("--vocab", type=int, default=32768 if cuda else 1000)
    p.add_argument("--batch", type=int, default=8 if cuda else 2)
    p.add_argument("--prompt", type=int, default=32 if cuda else 8)
    p.add_argument("--out", default=None, help="also write the result as DIR/long_run.json")
    a = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    res = run(a.steps, a.layers, a.hidden, a.vocab, a.batch, a.prompt, device)
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "long_run.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
