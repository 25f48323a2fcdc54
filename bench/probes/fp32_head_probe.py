"""lm_head_dtype on CUDA (values against the bf16-cast call, grads against the reference), and the
fp32 head's dot precision: IEEE against 3xTF32, recompute mode. python -m bench.probes.fp32_head_probe"""
import time

import torch

import compiled_grpo as cg
import lowerings.linear_logprobs.recompute.dense as tk
from compiled_grpo.reference import reference_token_logprobs


def main():
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 6, 16, 37
    h, w = torch.randn(B, T, H, generator=g).cuda() * 2, torch.randn(V, H, generator=g).cuda() / 4 * 3
    ids, mask = torch.randint(0, V, (B, T), generator=g).cuda(), (torch.rand(B, T, generator=g) > 0.3).cuda()
    for rl in (False, True):
        for mode in ("token_logprobs", "recompute", "fused"):
            def run(hh, ww, **kw):
                hh, ww = hh.clone().requires_grad_(), ww.clone().requires_grad_()
                if mode == "token_logprobs":
                    o = cg.token_logprobs(hh, ww, ids, mask=mask, with_entropy=True, round_logits=rl, **kw)
                    v = o.logprobs.sum()
                else:
                    o = cg.grpo_loss(hh, ww, ids, torch.ones(B, device="cuda"), mask, config=cg.GRPOConfig(
                        gradient_mode=mode, metrics="with_entropy", round_logits=rl, **kw))
                    v = o.loss
                v.backward()
                return o.logprobs.detach(), o.entropy.detach(), hh.grad, ww.grad
            a = run(h, w, lm_head_dtype=torch.bfloat16)
            b = run(h.bfloat16(), w.bfloat16())
            print(f"round={rl} {mode}: lp diff {(a[0]-b[0]).abs().max().item():.2e} ent diff "
                  f"{(a[1]-b[1]).abs().max().item():.2e} grads {a[2].dtype} {a[3].dtype}")
    n, hd, v = 8192, 4096, 32000
    x = torch.randn(n, hd, device="cuda")
    wt = torch.randn(v, hd, device="cuda") / 64
    y = torch.randint(0, v, (n,), device="cuda")
    orig = tk._prepare
    for prec in ("ieee", "tf32x3"):
        tk._prepare = lambda *a, _p=prec: orig(*a)[:2] + ((_p if orig(*a)[2] == "ieee" else orig(*a)[2]),)
        xx, ww = x.clone().requires_grad_(), wt.clone().requires_grad_()
        for i in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            o = cg.token_logprobs(xx, ww, y)
            o.logprobs.sum().backward()
            torch.cuda.synchronize(); t = time.perf_counter() - t0
        ref = torch.log_softmax(x.double() @ wt.double().T, -1).gather(1, y[:, None])[:, 0]
        print(f"fp32 {prec}: {t * 1e3:.1f} ms fwd+bwd N={n} H={hd} V={v}, lp err {(o.logprobs.double()-ref).abs().max().item():.2e}")
    tk._prepare = orig


if __name__ == "__main__":
    main()
