"""Shared test inputs and a literal float64 transcription of the GRPO formulas (the golden).

``golden_loss`` is written the way TRL 1.16 ``_compute_loss`` reads (multiply by the mask, then
aggregate), with the NeMo-RL/verl clamps spelled out; it shares no code with compiled_grpo.
"""
import math
import os
import subprocess
import sys

import pytest
import torch


def make_inputs(B=3, T=7, H=16, V=37, dtype=torch.float64, seed=0, adv_2d=False, p_mask=0.3, spread=0.3,
                device=None):
    """grpo_loss's positional inputs. With ``device``, everything moves there as float32 (the
    compile tests' setting), hidden and weight as fresh leaves requiring grad."""
    if device is not None:
        inp = make_inputs(B, T, H, V, torch.float32, seed, adv_2d, p_mask, spread)
        out = {k: x.detach().to(device, torch.float32 if x.is_floating_point() else x.dtype) for k, x in inp.items()}
        out["hidden"].requires_grad_()
        out["weight"].requires_grad_()
        return out
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / math.sqrt(H)).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > p_mask
    mask[0, 0] = True
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if adv_2d else torch.randn(B, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        p = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = (p + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).float().double()
    ref = (p + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).float().double()
    return dict(hidden=hidden, weight=weight, token_ids=ids, advantages=adv, mask=mask, old_logprobs=old,
                ref_logprobs=ref)


def _clamp(x, c):
    return x if c is None else torch.clamp(x, -c, c)


def golden_loss(hidden, weight, token_ids, advantages, mask, old_logprobs, ref_logprobs, cfg, bias=None,
                sampling_ratio=None, num_items_in_batch=None):
    """Returns (loss, per_token_loss [B, T] masked) in float64 from materialized logits."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logits = logits * cfg.logit_scale  # HF: scale, then softcap; TRL: then / temperature
    if cfg.final_logit_softcapping is not None:
        logits = cfg.final_logit_softcapping * torch.tanh(logits / cfg.final_logit_softcapping)
    logits = logits / cfg.temperature
    per_token_logps = logits.log_softmax(-1).gather(-1, token_ids[..., None]).squeeze(-1)
    m = mask.double()
    B, T = m.shape
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = per_token_logps.detach() if old_logprobs is None else old_logprobs

    log_ratio = per_token_logps - old
    if cfg.importance_sampling_level == "token":
        log_iw = _clamp(log_ratio, cfg.log_ratio_clamp)
    else:
        log_iw = _clamp((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0), cfg.log_ratio_clamp).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)

    if cfg.beta != 0.0:
        d = _clamp(ref_logprobs - per_token_logps, cfg.kl_input_clamp)
        kl = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
        kl = _clamp(kl, cfg.kl_output_clamp)
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1

    if cfg.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=cfg.epsilon_high).detach() * adv * per_token_logps
    elif cfg.loss_type == "sapo":
        pos, neg = (torch.tensor(t, dtype=torch.float64) for t in (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))
        tau = torch.where(adv > 0, pos, neg)  # float64 temperatures (TRL's scalar where would give float32)
        per_token_loss = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        c1 = coef_1 if cfg.delta is None else torch.clamp(coef_1, max=cfg.delta)
        per_token_loss = -torch.min(c1 * adv, coef_2 * adv)
    if sampling_ratio is not None:
        per_token_loss = per_token_loss * sampling_ratio
    if cfg.beta != 0.0:
        per_token_loss = per_token_loss + cfg.beta * kl

    lt = cfg.loss_type
    if lt in ("grpo", "sapo"):
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif lt == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif lt == "dr_grpo":
        loss = (per_token_loss * m).sum() / (B * cfg.max_completion_length)
    elif lt in ("dapo", "cispo"):
        n = m.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch), dtype=torch.float64)
        loss = (per_token_loss * m).sum() / n.clamp(min=1.0)
    else:  # luspo, TRL 1.16
        loss = (per_token_loss * m).sum(-1).mean()
    if cfg.entropy_coef > 0:
        logp_all = logits.log_softmax(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        loss = loss - cfg.entropy_coef * (ent * m).sum() / m.sum().clamp(min=1.0)
    return loss, (per_token_loss * m).expand(B, T)


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


# The devices a CPU-and-GPU test runs on: its CUDA case carries the gpu marker, so `pytest -m gpu`
# on a GPU machine selects it (and only the GPU cases).
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(world: int, args: list, timeout: int, env: dict = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node world *args` from the
    checkout's root (bench.tp, bench.fsdp, tests/trl_multiprocess.py), NVLink multicast off, its
    output captured."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(world), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)

