"""End-to-end GRPO step on a Qwen3-shaped HF model: backbone forward + loss + backward.

    python -m bench.e2e [--layers 4 --hidden 2048 --vocab 151936 --batch 8 --prompt 256
                         --completion 1536] [--providers NAME ...] [--out DIR]

Without a GPU the defaults shrink to a tiny model (2 layers, H=64, V=1000, B=2, 16 + 48 tokens):
a smoke test of the same code. A randomly initialised `Qwen3ForCausalLM` (bf16 on CUDA, fp32 on
CPU, SDPA attention) and one micro-batch: B sequences of P prompt + T completion tokens, completion
lengths ~ U[1, T] (about half the completion positions valid), advantages ~ N(0, 1), old/ref
log-probs = the model's own (no_grad) plus N(0, 0.1^2). The loss of every provider is the bench's
DAPO + k3 KL (beta 0.04, eps 0.2), over the completion positions' hidden states [B, T, H] (the
backbone's last hidden state at positions P-1 .. P+T-2) and the lm_head:

  naive            logits = lm_head(h) [B, T, V], log_softmax in fp32, gather (TRL-style user code)
  trl_chunked      TRL 1.16 ChunkedLogProbFunction on the valid tokens (index computed outside
                   the step, as bench/providers.py), then the DAPO math
  trl_selective    the lm_head's logits / T into TRL 1.16's selective_log_softmax (its trainer head)
  compiled_grpo    cg.grpo_loss(h, lm_head.weight, ...) (default config: fused gradient on CUDA)

each eager and `+compile` (the whole step function, backbone included, under torch.compile; the
loss-only compile of compiled_grpo is `fullgraph=True` inside it); naive and trl_selective also
`+compile+pass`, with cg.naive_logprob_fusion() on (the row's note: the pass's counters). Reported per provider: the
first call's time (the compile, for +compile), the median step time after it, and the peak
memory of a step above the model, its grads and the inputs (activations + loss workspace). One
row per provider is appended to DIR/e2e.csv and the run is printed as a Markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import time

import torch

from bench.dapo import Params, dapo_loss, naive_logprobs
from bench.peers import TRL_CHUNK_SIZE
from bench.providers import _cg_config
from bench.report import run_header


def build_model(layers: int, hidden: int, vocab: int, seq: int, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    heads = max(1, hidden // 128)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      max_position_embeddings=seq, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype)


def make_batch(model, B: int, P: int, T: int, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (B, P + T), generator=g).to(device)
    lengths = torch.randint(1, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T)[None, :] < lengths).float().to(device)        # [B, T]
    adv = torch.randn(B, generator=g).to(device)
    with torch.no_grad():
        h = completion_hidden(model, ids, P)
        lp = naive_logprobs(h, model.lm_head.weight, ids[:, P:], 1.0)      # [B, T] fp32
    old = lp + 0.1 * torch.randn(B, T, generator=g).to(device)
    ref = lp + 0.1 * torch.randn(B, T, generator=g).to(device)
    return ids, mask, adv, old, ref


def completion_hidden(model, ids, P: int):
    """[B, T, H]: the last hidden state at the positions whose next token is a completion token."""
    h = model.model(input_ids=ids).last_hidden_state                      # [B, P + T, H]
    return h[:, P - 1:-1]


def _loss_naive(model, ids, mask, adv, old, ref, P, p, keep):
    h = completion_hidden(model, ids, P)
    logp = naive_logprobs(h, model.lm_head.weight, ids[:, P:], p.temperature)
    return dapo_loss(logp, old, ref, adv, mask, p)


def _loss_trl(model, ids, mask, adv, old, ref, P, p, keep):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    h = completion_hidden(model, ids, P)
    H = h.shape[-1]
    hv = h.reshape(-1, H).index_select(0, keep)                           # [N_valid, H]
    tv = ids[:, P:].reshape(-1).index_select(0, keep)
    logp = ChunkedLogProbFunction.apply(hv, model.lm_head.weight, None, tv, p.temperature, TRL_CHUNK_SIZE,
                                        None, 1.0, ())[0]                 # [N_valid] fp32
    flat = lambda t: t.reshape(-1).index_select(0, keep)[None]  # noqa: E731   [1, N_valid]
    adv_t = adv[:, None].expand_as(mask)                                  # per token
    return dapo_loss(logp[None], flat(old), flat(ref), flat(adv_t), torch.ones_like(logp)[None], p)


def _loss_trl_selective(model, ids, mask, adv, old, ref, P, p, keep):
    """TRL 1.16's trainer head: the lm_head's logits of the completion positions over the
    temperature, trl.trainer.utils.selective_log_softmax (on CPU its per-row loops; on CUDA TRL's
    own Triton kernel), then the DAPO math."""
    from trl.trainer.utils import selective_log_softmax
    logits = model.lm_head(completion_hidden(model, ids, P)) / p.temperature   # [B, T, V]
    logp = selective_log_softmax(logits, ids[:, P:])
    return dapo_loss(logp, old, ref, adv, mask, p)


def _loss_cg(model, ids, mask, adv, old, ref, P, p, keep, *, config):
    import compiled_grpo as cg
    h = completion_hidden(model, ids, P)
    return cg.grpo_loss(h, model.lm_head.weight, ids[:, P:], adv, mask > 0, old, ref,
                        config=config).loss


LOSSES = {"naive": _loss_naive, "trl_chunked": _loss_trl, "trl_selective": _loss_trl_selective,
          "compiled_grpo": _loss_cg}
# "+compile+pass": the step compiled with compiled_grpo's Inductor pass on (Inductor's caches off,
# so that the pass runs; its counters in the row's note)
PROVIDERS = ([n + s for n in LOSSES for s in ("", "+compile")]
             + ["naive+compile+pass", "trl_selective+compile+pass"])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_loss(base_name: str, p: Params):
    """The provider's loss function of the step. compiled_grpo's GRPOConfig is made here, once,
    outside the step, as a trainer does: made inside the compiled step, its dataclasses.fields
    broke the graph, so Dynamo traced the backbone twice (a restart: 6.8-10.9 s of the H100
    runs' first call) and the step ran as two graphs. A closure, not functools.partial: Dynamo
    looks a partial's function up again by its module's name, which fails when this file runs
    under another module's name (runpy, as bench.probes.first_call runs it)."""
    fn = LOSSES[base_name]
    if base_name != "compiled_grpo":
        return fn
    import compiled_grpo as cg
    config = _cg_config(cg, p)

    def loss(*args):
        return fn(*args, config=config)
    return loss


def run_one(name, model, batch, P, p, device, reps):
    base_name = name.split("+")[0]
    if name.endswith("+pass"):
        import compiled_grpo as cg
        from torch._dynamo.utils import counters
        from torch._inductor import config as inductor_config
        counters.clear()
        with inductor_config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), cg.naive_logprob_fusion():
            row = run_one(name[:-len("+pass")], model, batch, P, p, device, reps)
        row["note"] = " ".join(f"{k}={v}" for c in ("compiled_grpo", "compiled_grpo_unfused", "compiled_grpo_gradient",
                                                   "compiled_grpo_rows", "compiled_grpo_block_gradient")
                               for k, v in sorted(counters[c].items())) or "the pass did not fire"
        return row
    if base_name in ("trl_chunked", "trl_selective"):
        try:
            import trl.kernels.chunked_logprob  # noqa: F401
        except Exception as e:  # absent or failing import: recorded, not fatal
            return dict(status=f"skip: trl not importable ({type(e).__name__})")
    ids, mask, adv, old, ref = batch
    keep = torch.nonzero(mask.reshape(-1) > 0)[:, 0]                       # outside the step (host sync)
    fn = step_loss(base_name, p)
    if name.endswith("+compile"):
        torch._dynamo.reset()
        fn = torch.compile(fn)

    def step():
        model.zero_grad(set_to_none=True)
        loss = fn(model, ids, mask, adv, old, ref, P, p, keep)
        loss.backward()
        return loss.detach()

    _sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    loss = step()
    _sync(device)
    first = time.perf_counter() - t0
    step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)   # grads of the previous step are set_to_none
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    grads = sum(q.numel() * q.element_size() for q in model.parameters())
    peak = ((torch.cuda.max_memory_allocated(device) - base - grads) / 2**30
            if device.type == "cuda" else float("nan"))
    return dict(status="ok", ms=sorted(times)[len(times) // 2], first_s=first, peak_gib=peak,
                loss=float(loss))


def main(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4 if cuda else 2)
    ap.add_argument("--hidden", type=int, default=2048 if cuda else 64)
    ap.add_argument("--vocab", type=int, default=151936 if cuda else 1000)
    ap.add_argument("--batch", type=int, default=8 if cuda else 2)
    ap.add_argument("--prompt", type=int, default=256 if cuda else 16)
    ap.add_argument("--completion", type=int, default=1536 if cuda else 48)
    ap.add_argument("--providers", nargs="*", default=PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--reps", type=int, default=10 if cuda else 3)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--compile-times", action="store_true",
                    help="print Dynamo/Inductor's time per phase after each compiled provider")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model(a.layers, a.hidden, a.vocab, a.prompt + a.completion, device,
                        torch.bfloat16 if cuda else torch.float32)
    batch = make_batch(model, a.batch, a.prompt, a.completion, device)
    valid = float(batch[1].mean())
    p = Params()
    header = run_header(device)
    shape = (f"Qwen3-shaped, {a.layers} layers, H={a.hidden}, V={a.vocab}, B={a.batch}, "
             f"{a.prompt} prompt + {a.completion} completion tokens, {valid:.0%} of completion positions valid")
    rows = []
    for name in a.providers:
        try:
            r = run_one(name, model, batch, a.prompt, p, device, a.reps)
        except torch.cuda.OutOfMemoryError:
            r = dict(status="OOM")
        except Exception as e:  # recorded, the run goes on
            r = dict(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        rows.append(dict(provider=name, **r))
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        print(f"  {name}: {r}", flush=True)
        if a.compile_times and name.endswith("+compile"):   # where the first call's time went
            print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "e2e.csv")
    fields = ["run_id", "device", "torch", "commit", "shape", "provider", "status", "ms", "first_s",
              "peak_gib", "loss", "note"]
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(dict(header, shape=shape, **r))
    print(f"\n{header['device']}, torch {header['torch']}, commit {header['commit']}, run {header['run_id']}\n")
    print(f"**e2e step** ({shape}; loss DAPO + k3 KL; peak: above model, grads and inputs)\n")
    print("| provider | step ms | first call s | peak GiB | loss | status |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        ok = r["status"] == "ok"
        status = r["status"] + (f" ({r['note']})" if r.get("note") else "")
        print(f"| {r['provider']} | {r['ms']:.1f} | {r['first_s']:.1f} | {r['peak_gib']:.2f} | {r['loss']:.4f} | {status} |"
              if ok else f"| {r['provider']} |  |  |  |  | {status} |")
    return rows


if __name__ == "__main__":
    main()
