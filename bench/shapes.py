"""Shape registry and the inputs of one GRPO step.

Legend: B sequences, T completion tokens per sequence, H hidden size, V vocabulary, N = B*T
(padded) or the number of packed tokens, N_valid = tokens under the mask. Every number the bench
reports is relative to the GEMM work of one shape: N*H*V (all positions) or N_valid*H*V.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    H: int
    V: int
    packed: bool = False  # the valid tokens of the padded shape of the same B, T: [N_valid] + cu_seqlens
    # The model's final_logit_softcapping (Gemma 2: 30.0), GRPOConfig / token_logprobs' argument of that
    # name. Recorded here; the providers do not apply it yet (each peer would need its own cap).
    softcap: Optional[float] = None
    # The lm_head is the input embedding (tie_word_embeddings): the head's dW is then part of
    # the embedding's gradient. The head's work is the same; bench.e2e / bench.fsdp build the
    # model tied where this is set.
    tied: bool = False

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def useful_flops(self) -> int:
        # Three GEMMs of 2*N*H*V each (logits, dX, dW): what any provider must do at least.
        # Recompute-style providers do 8*N*H*V; we still count 6 so TFLOP/s compare across them.
        return 6 * self.N * self.H * self.V


_QWEN = dict(H=4096, V=151936)
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in [
        Shape("qwen3-8b", B=8, T=2048, **_QWEN),
        Shape("llama3-8b", B=8, T=2048, H=4096, V=128256),
        Shape("gemma2-2b", B=8, T=2048, H=2304, V=256000, softcap=30.0),
        Shape("long", B=32, T=2048, **_QWEN),  # N = 65536
        # the small policies of much GRPO work: little GEMM time per row block, so the per-block
        # host and small-kernel costs weigh more
        Shape("qwen2.5-0.5b", B=8, T=2048, H=896, V=151936, tied=True),
        Shape("qwen2.5-1.5b", B=8, T=2048, H=1536, V=151936, tied=True),
        Shape("qwen3-0.6b", B=8, T=2048, H=1024, V=151936, tied=True),
        Shape("qwen3-1.7b", B=8, T=2048, H=2048, V=151936, tied=True),
        Shape("qwen3-4b", B=8, T=2048, H=2560, V=151936, tied=True),
        Shape("cpu-small", B=2, T=64, H=64, V=1000),  # default without a GPU; seconds on 2 cores
        Shape("cpu-tiny", B=2, T=16, H=32, V=128),  # for tests/test_bench.py
    ]
}
# Packed (padding-free) twins: the same sequences (same seed: same lengths, hidden, targets) as the
# padded shape's valid tokens, concatenated into [N_valid] rows with cu_seqlens [B + 1].
SHAPES.update({f"{n}-packed": dataclasses.replace(SHAPES[n], name=f"{n}-packed", packed=True)
               for n in ("qwen3-8b", "llama3-8b", "gemma2-2b", "long", "qwen2.5-0.5b", "cpu-small",
                         "cpu-tiny")})
# N from 4k to 128k at T=2048; the memory-vs-N curve of the plot. Large N is expected to OOM
# for the providers that hold [N, V] logits: that is recorded, not an error.
SWEEP = [Shape(f"sweep-n{b * 2048 // 1024}k", B=b, T=2048, **_QWEN) for b in (2, 4, 8, 16, 32, 64)]
# The small policies most RL research trains (Qwen3 0.6b / 1.7b / 4b and Qwen2.5 0.5b / 1.5b:
# tied embeddings), smallest H first.
SMALL = [SHAPES[n] for n in ("qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b", "qwen3-1.7b", "qwen3-4b")]
GROUPS: dict[str, list[Shape]] = {"sweep": SWEEP, "small": SMALL}
SHAPES.update({s.name: s for s in SWEEP})


def resolve(names: list[str]) -> list[Shape]:
    """Expand group names ("sweep") and check the rest against the registry."""
    out: list[Shape] = []
    for n in names:
        if n in GROUPS:
            out.extend(GROUPS[n])
        elif n in SHAPES:
            out.append(SHAPES[n])
        else:
            raise SystemExit(f"unknown shape {n!r}; known: {', '.join([*SHAPES, *GROUPS])}")
    return out


class StepInputs(NamedTuple):
    """Padded: hidden [B, T, H], per-token tensors [B, T]. Packed: hidden [N, H], per-token tensors
    [N] (mask all ones), cu_seqlens [B + 1] int32, token_advantages [N] (advantages broadcast to
    their sequence's tokens, for the per-token providers)."""
    hidden: torch.Tensor  # [B, T, H] or [N, H] dtype, leaf, requires_grad
    weight: torch.Tensor  # [V, H] dtype, leaf, requires_grad
    token_ids: torch.Tensor  # [B, T] or [N] int64
    advantages: torch.Tensor  # [B] fp32
    mask: torch.Tensor  # [B, T] fp32 0/1, or [N] ones
    old_logprobs: torch.Tensor  # [B, T] or [N] fp32
    ref_logprobs: torch.Tensor  # [B, T] or [N] fp32
    cu_seqlens: Optional[torch.Tensor] = None  # [B + 1] int32, packed only
    token_advantages: Optional[torch.Tensor] = None  # [N] fp32, packed only
    softcap: Optional[float] = None  # the shape's final_logit_softcapping (Gemma 2: 30), applied by every provider

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def n_valid(x: StepInputs) -> int:
    return int(x.mask.sum().item())


def pack(x: StepInputs) -> StepInputs:
    """The valid tokens of padded inputs, concatenated in sequence order (cu_seqlens [B + 1])."""
    keep = x.mask.view(-1) > 0  # [B*T]; valid tokens are a prefix of each row (lengths ~ U[1, T])
    H = x.hidden.shape[-1]
    lengths = x.mask.sum(1).to(torch.int32)  # [B]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    hidden = x.hidden.detach().reshape(-1, H)[keep].clone().requires_grad_()  # [N_valid, H]
    tok_adv = x.advantages[:, None].expand_as(x.mask).reshape(-1)[keep]  # [N_valid]
    return StepInputs(hidden, x.weight, x.token_ids.view(-1)[keep], x.advantages,
                      torch.ones(hidden.shape[0], dtype=x.mask.dtype, device=x.mask.device),
                      x.old_logprobs.view(-1)[keep], x.ref_logprobs.view(-1)[keep], cu, tok_adv, x.softcap)


def cap_logits(z: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """HF's final_logit_softcapping: softcap * tanh(z / softcap) (identity without a cap)."""
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@torch.no_grad()
def _chunked_logprobs(h2d: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, rows: int,
                      softcap: Optional[float] = None) -> torch.Tensor:
    """log_softmax(h @ W.T).gather(ids) in row chunks: one [rows, V] fp32 tile alive, not [N, V]."""
    out = torch.empty(h2d.shape[0], dtype=torch.float32, device=h2d.device)
    for i in range(0, h2d.shape[0], rows):
        z = cap_logits((h2d[i:i + rows] @ w.T).float(), softcap)  # [rows, V]
        out[i:i + rows] = z.gather(1, ids[i:i + rows, None]).squeeze(1) - z.logsumexp(1)
        del z
    return out


@torch.no_grad()
def _chunked_sample(h2d: torch.Tensor, w: torch.Tensor, rows: int, g: torch.Generator,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """One target id per row drawn from softmax(h @ W.T) (on-policy sampling at temperature 1), in
    row chunks: a [rows, V] fp32 tile and its softmax alive, never [N, V]."""
    out = torch.empty(h2d.shape[0], dtype=torch.int64, device=h2d.device)
    for i in range(0, h2d.shape[0], rows):
        p = torch.softmax(cap_logits((h2d[i:i + rows] @ w.T).float(), softcap), dim=1)  # [rows, V]
        out[i:i + rows] = torch.multinomial(p, 1, generator=g).squeeze(1)
        del p
    return out


@torch.no_grad()
def _chunked_argmin(h2d: torch.Tensor, w: torch.Tensor, rows: int,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """Each row's least likely token, argmin of h @ W.T, in row chunks (one [rows, V] tile)."""
    out = torch.empty(h2d.shape[0], dtype=torch.int64, device=h2d.device)
    for i in range(0, h2d.shape[0], rows):
        out[i:i + rows] = cap_logits((h2d[i:i + rows] @ w.T).float(), softcap).argmin(1)
    return out


TARGETS = ("random", "sampled", "least")


def make_inputs(shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16, *,
                seed: int = 0, logit_std: float = 3.0, old_noise: float = 0.1,
                ref_noise: float = 0.1, targets: str = "random") -> StepInputs:
    """Inputs that look like one step of GRPO training, not zeros or a degenerate on-policy batch.

    - hidden ~ N(0, 1), W ~ N(0, logit_std^2 / H): logits have std ~logit_std, so the softmax is
      peaked (a few tokens carry most mass), as for a trained LM head. Near-uniform softmax would
      flatter sparsity tricks (CCE's gradient filter) less than real models do, and vice versa.
    - old/ref log-probs: the current policy's own log-probs (no_grad) plus N(0, noise^2): the
      importance ratio is near 1 with a few percent clipped at eps=0.2, and KL(ref) is small.
    - advantages ~ N(0, 1) per sequence; mask: completion lengths ~ U[1, T] per sequence.
    - targets="random": token ids uniform over V (off-policy-looking, log-probs ~ -log V - few);
      "sampled": each id drawn from the policy's own softmax (on-policy rollouts: mostly the
      peaked head of the distribution, as in real RL batches); "least": each row's least likely
      token (a stress input: with logit_std ~8 its log-probs fall below -48, the rows the
      fused path's exp-scaled backward must re-reference, fused_cuda.E_HEADROOM).
    - a packed shape gets the padded shape's inputs (same seed, same draws), then `pack`.
    """
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, V = shape.B, shape.T, shape.H, shape.V

    def randn(*size, std=1.0, dt=dtype):
        # drawn on the device (CPU randn of a 1 GiB weight takes seconds) in chunks of 2^26, so the
        # fp32 staging tile stays at 256 MiB.
        flat = torch.empty(torch.Size(size).numel(), dtype=dt, device=device)
        for i in range(0, flat.numel(), 1 << 26):
            n = min(1 << 26, flat.numel() - i)
            flat[i:i + n] = torch.randn(n, generator=g, device=device).mul_(std)
        return flat.view(*size)

    hidden = randn(B, T, H).requires_grad_()
    weight = randn(V, H, std=logit_std / H ** 0.5).requires_grad_()
    token_ids = torch.randint(0, V, (B, T), generator=g, device=device)
    advantages = randn(B, dt=torch.float32)
    lengths = torch.randint(1, T + 1, (B, 1), generator=g, device=device)
    mask = (torch.arange(T, device=device)[None, :] < lengths).float()
    rows = max(1, (1 << 28) // (4 * V))  # 1 GiB fp32 tile
    if targets == "sampled":  # drawn after the random ones, so the other inputs stay the same
        token_ids = _chunked_sample(hidden.detach().view(-1, H), weight.detach(), rows, g, shape.softcap).view(B, T)
    elif targets == "least":
        token_ids = _chunked_argmin(hidden.detach().view(-1, H), weight.detach(), rows, shape.softcap).view(B, T)
    lp = _chunked_logprobs(hidden.detach().view(-1, H), weight.detach(), token_ids.view(-1), rows,
                           shape.softcap).view(B, T)
    old = lp + randn(B, T, std=old_noise, dt=torch.float32)
    ref = lp + randn(B, T, std=ref_noise, dt=torch.float32)
    x = StepInputs(hidden, weight, token_ids, advantages, mask, old, ref, softcap=shape.softcap)
    return pack(x) if shape.packed else x


def dapo_step(x: StepInputs, config=None):
    """(step, hidden, weight): one eager grpo_loss forward + backward on x (DAPO, beta 0.04 unless
    `config`), on leaves made once, their grads cleared each step (the host-time probes' step)."""
    import compiled_grpo as cg
    cfg = config or cg.GRPOConfig(loss_type="dapo", beta=0.04)
    hidden = x.hidden.detach().requires_grad_()
    weight = x.weight.detach().requires_grad_()

    def step():
        hidden.grad = weight.grad = None
        cg.grpo_loss(hidden, weight, x.token_ids, x.advantages, x.mask, x.old_logprobs,
                     x.ref_logprobs, config=cfg).loss.backward()

    return step, hidden, weight
