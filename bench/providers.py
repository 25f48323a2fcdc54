"""Every way of computing one GRPO (DAPO, beta>0) loss forward+backward that the bench compares.

Legend: B sequences, T tokens, H hidden, V vocab, N = B*T.

A provider is a name, a `check(device) -> reason or None` (None: it can run here) and a
`build(inputs, params)` context manager that yields `step() -> loss or None`. `step` runs forward
and backward, leaving dX in `inputs.hidden.grad` and dW in `inputs.weight.grad`; the caller clears
them between steps. Setup (compiling, enabling a pass) happens in the first call or in `build`,
teardown in its `finally`, so one provider never leaks configuration into the next.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, ContextManager, Iterator, Optional

import torch

from bench.shapes import StepInputs


@dataclasses.dataclass(frozen=True)
class Params:
    """The loss configuration every provider is given: DAPO with a k3 KL term to the reference."""
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0


Step = Callable[[], Optional[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    check: Callable[[torch.device], Optional[str]]
    build: Callable[[StepInputs, Params], ContextManager[Step]]
    pass_provider: bool = False  # expects compiled_grpo counters to move (the Inductor pass fired)


# ---- the "TRL-style user code" being compared: deliberately not compiled_grpo's code ----------

def naive_logprobs(hidden, weight, token_ids, temperature: float):
    """Per-token log-probs the way RL trainers write it: full logits, log_softmax, gather.

    Holds [B, T, V] bf16 logits, their fp32 copy and the fp32 log_softmax (and as many again in
    backward): 10 bytes per logit forward, the memory the fused providers avoid.
    """
    logits = hidden @ weight.T  # [B, T, V] bf16
    logits = logits.float() / temperature  # [B, T, V] fp32 (verl/TRL upcast before the softmax)
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B, T]


def dapo_per_token(logp, old_logp, ref_logp, advantages, p: Params):
    """TRL 1.16 `_compute_loss`, loss_type="dapo", token-level IS, k3 KL; no clamps.

    coef = exp(logp - old); loss_t = -min(coef*A, clip(coef, 1-eps_low, 1+eps_high)*A)
                                     + beta * (exp(ref - logp) - (ref - logp) - 1)
    """
    coef_1 = torch.exp(logp - old_logp)  # [B, T]
    coef_2 = torch.clamp(coef_1, 1 - p.epsilon_low, 1 + p.epsilon_high)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)  # [B, T]
    if p.beta != 0.0:
        d = ref_logp - logp  # [B, T]
        per_token = per_token + p.beta * (torch.exp(d) - d - 1)
    return per_token


def dapo_loss(logp, old_logp, ref_logp, advantages, mask, p: Params):
    """DAPO normalizer: sum over all completion tokens / their count (one process)."""
    per_token = dapo_per_token(logp, old_logp, ref_logp, advantages, p)  # [B, T]
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def naive_loss(hidden, weight, token_ids, advantages, mask, old_logp, ref_logp, p: Params):
    logp = naive_logprobs(hidden, weight, token_ids, p.temperature)  # [B, T] fp32
    return dapo_loss(logp, old_logp, ref_logp, advantages, mask, p)


# ---- availability checks --------------------------------------------------------------------

def _import(name: str):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # ImportError, or a package that fails at import on this machine
        return None, f"{name} not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def _always(device):
    return None


def _need_cg(attr: str):
    def check(device):
        cg, why = _import("compiled_grpo")
        if cg is None:
            return why
        return None if hasattr(cg, attr) else f"compiled_grpo.{attr} not built yet"
    return check


def _need(mod: str, cuda_only: bool = False):
    def check(device):
        if cuda_only and device.type != "cuda":
            return f"{mod} needs CUDA (Triton kernels, no CPU path)"
        return _import(mod)[1]
    return check


def _resetting() -> contextlib.AbstractContextManager:
    """Fresh Dynamo state around a provider: each compiles its own static-shape graph, as a fresh
    process would, and no recompile-limit or dynamic-shape decision leaks across shapes."""
    @contextlib.contextmanager
    def cm():
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()
    return cm()


@contextlib.contextmanager
def _no_compile_caches():
    """A cache hit skips a pre-grad pass (and its counter): compile from scratch so the `note`
    column can say whether the pass fired. Only compile time changes, which is not timed."""
    import torch._functorch.config as fconf
    import torch._inductor.config as iconf
    with contextlib.ExitStack() as st:
        if hasattr(iconf, "fx_graph_cache"):
            st.enter_context(iconf.patch(fx_graph_cache=False))
        if hasattr(fconf, "enable_autograd_cache"):
            st.enter_context(fconf.patch(enable_autograd_cache=False))
        yield


def _args(x: StepInputs):
    return (x.hidden, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs)


# ---- providers --------------------------------------------------------------------------------

FLOOR_ROWS = 16384  # [16384, V] bf16 tile = 4.6 GiB at V=152k; M=16k keeps each GEMM compute-bound


@contextlib.contextmanager
def _floor(x: StepInputs, p: Params) -> Iterator[Step]:
    """Three bf16 GEMMs of N*H*V (logits, dX = dZ@W, dW = dZ.T@h): the compute floor.

    dZ is the logits tile itself (same FLOPs, no extra buffer, random-looking data, not zeros).
    Rows are tiled at FLOOR_ROWS so the floor runs at every N; below that it is three plain GEMMs.
    """
    h = x.hidden.detach().reshape(-1, x.hidden.shape[-1])  # [N, H]
    w = x.weight.detach()  # [V, H]

    def step():
        dx = torch.empty_like(h)  # [N, H]
        dw = None
        for i in range(0, h.shape[0], FLOOR_ROWS):
            hc = h[i:i + FLOOR_ROWS]
            z = hc @ w.T  # [rows, V]
            torch.mm(z, w, out=dx[i:i + FLOOR_ROWS])  # [rows, H]
            dw = z.T @ hc if dw is None else dw.addmm_(z.T, hc)  # [V, H]
            del z
        return None
    yield step


@contextlib.contextmanager
def _naive_eager(x, p):
    def step():
        loss = naive_loss(*_args(x), p)
        loss.backward()
        return loss.detach()
    yield step


def _compiled_naive(enable_pass: bool):
    @contextlib.contextmanager
    def build(x, p):
        with _resetting(), (_no_compile_caches() if enable_pass else contextlib.nullcontext()):
            cg = importlib.import_module("compiled_grpo") if enable_pass else None
            if enable_pass:
                cg.enable_naive_logprob_fusion()
            try:
                # dynamic=False: one static graph per shape, the best case for the naive code.
                fn = torch.compile(naive_loss, dynamic=False)

                def step():
                    loss = fn(*_args(x), p)
                    loss.backward()
                    return loss.detach()
                yield step
            finally:
                if enable_pass:
                    cg.disable_naive_logprob_fusion()
    return build


def _cg_config(cg, p: Params):
    return cg.GRPOConfig(loss_type="dapo", beta=p.beta, epsilon_low=p.epsilon_low,
                         epsilon_high=p.epsilon_high, temperature=p.temperature)


def _compiled_grpo(compile_it: bool):
    @contextlib.contextmanager
    def build(x, p):
        import compiled_grpo as cg
        cfg = _cg_config(cg, p)

        def loss_fn(*a):
            return cg.grpo_loss(*a, config=cfg).loss

        with _resetting():
            fn = torch.compile(loss_fn, fullgraph=True, dynamic=False) if compile_it else loss_fn

            def step():
                loss = fn(*_args(x))
                loss.backward()
                return loss.detach()
            yield step
    return build


@contextlib.contextmanager
def _liger(x, p):
    """Liger-Kernel 0.8.5 chunked_loss GRPO: sequence chunks x 4096-wide vocab tiles, the whole
    backward (8*N*H*V) runs inside forward. compiled=True is its default (torch.compile of the loss
    math); on CPU we pass False, because compiling per chunk on CPU costs more than the bench."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    mod = LigerFusedLinearGRPOLoss(
        beta=p.beta, compiled=x.hidden.device.type == "cuda", use_ref_model=True, chunk_size=1,
        epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high, loss_type="dapo",
        temperature=p.temperature)
    with _resetting():
        def step():
            loss, _metrics = mod(x.hidden, x.weight, x.token_ids, x.mask, x.advantages,
                                 ref_per_token_logps=x.ref_logprobs,
                                 old_per_token_logps=x.old_logprobs)
            loss.backward()
            return loss.detach()
        yield step


@contextlib.contextmanager
def _cce(x, p):
    """Apple Cut Cross-Entropy per-token NLL (reduction="none"), negated into log-probs, then the
    same PyTorch DAPO math as the naive providers. CCE has no temperature argument: logits/T is
    computed as (h/T) @ W.T. Its default gradient filter (filter_eps="high") is left on, as users
    run it; the agreement columns show what it costs in accuracy."""
    from cut_cross_entropy import linear_cross_entropy

    def step():
        h = x.hidden if p.temperature == 1.0 else x.hidden / p.temperature
        logp = -linear_cross_entropy(h, x.weight, x.token_ids, reduction="none").float()  # [B, T]
        loss = dapo_loss(logp, x.old_logprobs, x.ref_logprobs, x.advantages, x.mask, p)
        loss.backward()
        return loss.detach()
    yield step


# Run order: the peers before compiled_grpo's own providers, so that a sticky CUDA error from a
# new kernel (illegal address: every later CUDA call fails) cannot cost the peers' numbers.
PROVIDERS: dict[str, Provider] = {
    pr.name: pr
    for pr in [
        Provider("floor", _always, _floor),
        Provider("naive_eager", _always, _naive_eager),
        Provider("naive_compile", _always, _compiled_naive(False)),
        Provider("liger", _need("liger_kernel.chunked_loss"), _liger),
        Provider("cce", _need("cut_cross_entropy", cuda_only=True), _cce),
        Provider("compiled_grpo", _need_cg("grpo_loss"), _compiled_grpo(False)),
        Provider("compiled_grpo+compile", _need_cg("grpo_loss"), _compiled_grpo(True)),
        Provider("naive_compile+pass", _need_cg("enable_naive_logprob_fusion"), _compiled_naive(True),
                 pass_provider=True),
    ]
}


def resolve(names: Optional[list[str]]) -> list[Provider]:
    """All providers by default; the floor always runs first, since every ratio divides by it."""
    names = list(PROVIDERS) if not names else names
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    return [pr for pr in PROVIDERS.values() if pr.name == "floor" or pr.name in names]  # run order
