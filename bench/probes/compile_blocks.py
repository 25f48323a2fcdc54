"""The first call of a compiled grpo_loss (the head alone, fused gradient mode) against its
number of row blocks G: what each block costs the compile (until 4c701af each block's loss
gradient was traced inline, G copies for Inductor; now token-level blocks share one traced
graph, fused_grads.traced_block_grads, and whole-sequence blocks are still inlined).
Run each setting in a fresh process with the caches off:

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TRITON_CACHE_DIR=$(mktemp -d) \\
        python -m bench.probes.compile_blocks --workspace-mib {640 | 4096} [--entropy-coef 0.01]

The default shape is bench.e2e's head (B = 8 sequences of 1792 tokens, H = 2048, V = 151936,
bf16; 640 MiB: 6 blocks of 2048 rows, 4096 MiB: one block). Prints the first call's seconds,
the compile phases' totals, and whether the compiled gradients equal an eager call's bitwise.
Results: bench/results/compile_blocks_h100.txt.
"""
import argparse
import time

import torch
import torch._dynamo.utils as dynamo_utils

from compiled_grpo import GRPOConfig, grpo_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace-mib", type=float, default=640.0)
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1792)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = GRPOConfig(fused_workspace_mib=a.workspace_mib, entropy_coef=a.entropy_coef,
                     gradient_mode="fused")
    b, t = a.batch, a.seq
    h = torch.randn(b, t, a.hidden, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(a.vocab, a.hidden, device=dev, dtype=dtype) * 0.02).requires_grad_()
    ids = torch.randint(0, a.vocab, (b, t), device=dev)
    adv = torch.randn(b, device=dev)
    mask = torch.rand(b, t, device=dev) > 0.3
    old = torch.randn(b, t, device=dev) * 0.1 - 5

    def loss(h, w):
        return grpo_loss(h, w, ids, adv, mask, old, config=cfg).loss

    step = torch.compile(loss, fullgraph=True)
    t0 = time.perf_counter()
    out = step(h, w)
    out.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    print(f"workspace {a.workspace_mib:g} MiB, entropy_coef {a.entropy_coef:g}: first call {first:.1f} s",
          flush=True)
    metrics = dynamo_utils.compilation_time_metrics
    for k in ("_compile.compile_inner", "create_aot_dispatcher_function",
              "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler"):
        if k in metrics:
            print(f"  {k:45s} {sum(metrics[k]):7.2f} s")
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = loss(h, w)
    ref.backward()
    print(f"  compiled vs eager: loss {(out - ref).abs().item():.3e}, d_hidden bitwise "
          f"{torch.equal(gh, h.grad)}, d_weight bitwise {torch.equal(gw, w.grad)}")


if __name__ == "__main__":
    main()
