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
import inspect
from typing import Callable, ContextManager, Iterator, Optional

import torch

from bench.shapes import StepInputs, cap_logits


def _any_inputs(x: StepInputs) -> Optional[str]:
    return None


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
    accepts: Callable[[StepInputs], Optional[str]] = _any_inputs  # reason it cannot take these inputs


# ---- the "TRL-style user code" being compared: deliberately not compiled_grpo's code ----------

def naive_logprobs(hidden, weight, token_ids, temperature: float, softcap: Optional[float] = None):
    """Per-token log-probs the way RL trainers write it: full logits, log_softmax, gather.

    Holds [B, T, V] bf16 logits, their fp32 copy and the fp32 log_softmax (and as many again in
    backward): 10 bytes per logit forward, the memory the fused providers avoid.
    """
    logits = hidden @ weight.T  # [B, T, V] bf16
    logits = cap_logits(logits.float(), softcap) / temperature  # [B, T, V] fp32 (HF: cap, then T)
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B, T]


def dapo_per_token(logp, old_logp, ref_logp, advantages, p: Params):
    """TRL 1.16 `_compute_loss`, loss_type="dapo", token-level IS, k3 KL; no clamps.

    coef = exp(logp - old); loss_t = -min(coef*A, clip(coef, 1-eps_low, 1+eps_high)*A)
                                     + beta * (exp(ref - logp) - (ref - logp) - 1)
    """
    coef_1 = torch.exp(logp - old_logp)  # [B, T]
    coef_2 = torch.clamp(coef_1, 1 - p.epsilon_low, 1 + p.epsilon_high)  # [B, T]
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [B, 1] or per token [B, T]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)  # [B, T]
    if p.beta != 0.0:
        d = ref_logp - logp  # [B, T]
        per_token = per_token + p.beta * (torch.exp(d) - d - 1)
    return per_token


def dapo_loss(logp, old_logp, ref_logp, advantages, mask, p: Params):
    """DAPO normalizer: sum over all completion tokens / their count (one process)."""
    per_token = dapo_per_token(logp, old_logp, ref_logp, advantages, p)  # [B, T]
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def naive_loss(hidden, weight, token_ids, advantages, mask, old_logp, ref_logp, p: Params,
               softcap: Optional[float] = None):
    logp = naive_logprobs(hidden, weight, token_ids, p.temperature, softcap)  # [B, T] fp32
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
    """The padded [B, T] argument list. A packed batch is one sequence [1, N] of its tokens with
    per-token advantages: the same DAPO loss (per-token terms, one normalizer over all tokens), so
    the per-token providers (naive, CCE) run on exactly the packed tokens."""
    if not x.packed:
        return (x.hidden, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs)
    return (x.hidden.unsqueeze(0), x.weight, x.token_ids[None], x.token_advantages[None], x.mask[None],
            x.old_logprobs[None], x.ref_logprobs[None])


def _no_softcap(x: StepInputs) -> Optional[str]:
    """Peers without a final_logit_softcapping option would compute another model's loss."""
    return "no final_logit_softcapping option" if x.softcap is not None else None


def _padded_only_no_softcap(x: StepInputs) -> Optional[str]:
    return _no_softcap(x) or _padded_only(x)


def _padded_only(x: StepInputs) -> Optional[str]:
    return "packed input: takes per-sequence advantages [B] over padded [B, T] rows" if x.packed else None


@dataclasses.dataclass
class _Valid:
    """The valid tokens, compacted outside the op: rows (None: all rows are valid, packed input)
    indexes the flattened [B*T] positions; the per-token tensors are already compacted [N_valid]
    (no grad flows to them). hidden(x) gathers the differentiable rows inside the step, so the
    backward's scatter of dX into [B, T, H] is part of the timed work."""
    rows: Optional[torch.Tensor]  # [N_valid] int64
    token_ids: torch.Tensor  # [N_valid]
    advantages: torch.Tensor  # [N_valid] fp32
    old_logprobs: torch.Tensor  # [N_valid]
    ref_logprobs: torch.Tensor  # [N_valid]
    ones: torch.Tensor  # [N_valid] fp32, the all-valid mask

    def hidden(self, x: StepInputs) -> torch.Tensor:  # [N_valid, H]
        h = x.hidden.view(-1, x.hidden.shape[-1])
        return h if self.rows is None else h.index_select(0, self.rows)


def compact(x: StepInputs) -> _Valid:
    """hidden[mask], ids[mask], ... with the index computed once here (one host sync, outside the
    timed step: how TRL's trainer and padding-free pipelines hand tokens to a fused head)."""
    if x.packed:
        return _Valid(None, x.token_ids, x.token_advantages, x.old_logprobs, x.ref_logprobs, x.mask)
    rows = x.mask.reshape(-1).nonzero().squeeze(1)  # [N_valid]
    adv = x.advantages[:, None].expand_as(x.mask).reshape(-1)
    return _Valid(rows, x.token_ids.reshape(-1)[rows], adv[rows], x.old_logprobs.reshape(-1)[rows],
                  x.ref_logprobs.reshape(-1)[rows], torch.ones_like(rows, dtype=torch.float32))


def _valid_dapo(logp: torch.Tensor, v: _Valid, p: Params) -> torch.Tensor:
    """The bench's DAPO math (dapo_loss) on compacted per-token log-probs [N_valid]."""
    return dapo_loss(logp[None], v.old_logprobs[None], v.ref_logprobs[None], v.advantages[None], v.ones[None], p)


# ---- providers --------------------------------------------------------------------------------

FLOOR_ROWS = 16384  # [16384, V] bf16 tile = 4.6 GiB at V=152k; M=16k keeps each GEMM compute-bound


def _floor(valid_only: bool):
    @contextlib.contextmanager
    def build(x: StepInputs, p: Params) -> Iterator[Step]:
        h = x.hidden.detach().reshape(-1, x.hidden.shape[-1])  # [N, H]
        if valid_only:
            v = compact(x)
            h = h if v.rows is None else h.index_select(0, v.rows).contiguous()  # [N_valid, H]
        with _gemm_floor(h, x.weight.detach()) as step:
            yield step
    return build


@contextlib.contextmanager
def _gemm_floor(h: torch.Tensor, w: torch.Tensor) -> Iterator[Step]:
    """Three bf16 GEMMs of M*H*V (logits, dX = dZ@W, dW = dZ.T@h): the compute floor, over all N
    rows (`floor`) or the N_valid valid ones, compacted beforehand (`floor_valid`).

    dZ is the logits tile itself (same FLOPs, no extra buffer, random-looking data, not zeros).
    Rows are tiled at FLOOR_ROWS so the floor runs at every N; below that it is three plain GEMMs.
    """

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
        loss = naive_loss(*_args(x), p, x.softcap)
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
                    loss = fn(*_args(x), p, x.softcap)
                    loss.backward()
                    return loss.detach()
                yield step
            finally:
                if enable_pass:
                    cg.disable_naive_logprob_fusion()
    return build


def _cg_config(cg, p: Params, mode: str = "auto", softcap: Optional[float] = None):
    fields = {f.name for f in dataclasses.fields(cg.GRPOConfig)}
    kw = {} if "gradient_mode" not in fields else dict(gradient_mode=mode)
    if softcap is not None:
        kw["final_logit_softcapping"] = softcap
    return cg.GRPOConfig(loss_type="dapo", beta=p.beta, epsilon_low=p.epsilon_low,
                         epsilon_high=p.epsilon_high, temperature=p.temperature, **kw)


def _cg_packed(x: StepInputs) -> Optional[str]:
    if not x.packed:
        return None
    cg, why = _import("compiled_grpo")
    if cg is None:
        return why
    return None if "cu_seqlens" in inspect.signature(cg.grpo_loss).parameters else "grpo_loss has no cu_seqlens"


def _compiled_grpo(compile_it: bool, mode: str = "auto"):
    """cg.grpo_loss on the inputs as they are: padded [B, T] with the mask, or packed [N] with
    cu_seqlens= (per-sequence advantages [S]). mode: GRPOConfig.gradient_mode ("auto" is the
    fused-gradient path for this loss)."""
    @contextlib.contextmanager
    def build(x, p):
        import compiled_grpo as cg
        cfg = _cg_config(cg, p, mode, x.softcap)
        kw = dict(cu_seqlens=x.cu_seqlens) if x.packed else {}

        def loss_fn(*a):
            return cg.grpo_loss(*a, config=cfg, **kw).loss

        args = (x.hidden, x.weight, x.token_ids, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs)
        with _resetting():
            fn = torch.compile(loss_fn, fullgraph=True, dynamic=False) if compile_it else loss_fn

            def step():
                loss = fn(*args)
                loss.backward()
                return loss.detach()
            yield step
    return build


@contextlib.contextmanager
def _compiled_grpo_valid(x, p):
    """The reference point "the op on the valid tokens, compacted outside": cg.grpo_loss (eager call)
    on hidden[mask][None], ids[mask][None], per-token advantages [1, N_valid], an all-true mask."""
    import compiled_grpo as cg
    cfg = _cg_config(cg, p, softcap=x.softcap)
    v = compact(x)

    def step():
        loss = cg.grpo_loss(v.hidden(x)[None], x.weight, v.token_ids[None], v.advantages[None], v.ones[None],
                            v.old_logprobs[None], v.ref_logprobs[None], config=cfg).loss
        loss.backward()
        return loss.detach()
    yield step


TRL_CHUNK_SIZE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16 (vocab tile width)


@contextlib.contextmanager
def _trl_chunked(x, p):
    """TRL 1.16 `trl.kernels.ChunkedLogProbFunction` (cuBLAS projection tiles of 4096 tokens x
    32768 vocab, a Triton online-logsumexp fold, backward recomputes: 8*N*H*V, fp32 grad
    accumulators) on the valid tokens, as TRL's fused LM head calls it; then the bench's DAPO math.
    Its backward imports trl.trainer.utils (DeepSpeed ZeRO-3 gather context), which pulls in
    `datasets`; where that import fails, a stub with the same no-op context (what it is outside
    ZeRO-3) stands in, and the note says so."""
    import sys
    import types
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    note = ""
    try:
        from trl.trainer import utils as trl_utils
        chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", TRL_CHUNK_SIZE)
        note = getattr(trl_utils, "bench_stub_note", "")
    except Exception as e:
        while e.__cause__ is not None:  # the lazy module wraps the real ImportError
            e = e.__cause__
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        chunk = TRL_CHUNK_SIZE
        note = stub.bench_stub_note = (f"trl.trainer.utils stubbed ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:80] if str(e) else ''})")
        sys.modules["trl.trainer.utils"] = stub
    v = compact(x)

    def step():
        logp = ChunkedLogProbFunction.apply(v.hidden(x), x.weight, None, v.token_ids, p.temperature, chunk,
                                            x.softcap, 1.0, ())[0]  # [N_valid] fp32
        loss = _valid_dapo(logp, v, p)
        loss.backward()
        return loss.detach()
    step.note = note
    yield step


def _liger_cute_check(device):
    why = _import("liger_kernel.ops.fused_linear_scaled_cross_entropy")[1]
    if why is None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        # sm_90 dispatches to the CuTe-DSL kernels unconditionally: without nvidia-cutlass-dsl it raises
        why = _import("liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90")[1]
    return why


@contextlib.contextmanager
def _liger_cute(x, p):
    """Liger 0.8.5 `LigerFusedLinearScaledCrossEntropyFunction` (per-token fp32 NLL, no reduction
    inside; CuTe-DSL WGMMA kernels on sm_90, one persistent backward kernel, recompute: 8*N*H*V;
    elsewhere a 512-token torch fallback, named in the note) on the valid tokens, negated into
    log-probs, then the bench's DAPO math."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as fsce
    v = compact(x)
    impl = fsce._resolve_implementation(x.hidden.device) if hasattr(fsce, "_resolve_implementation") else None

    def step():
        nll = fsce.LigerFusedLinearScaledCrossEntropyFunction.apply(v.hidden(x), x.weight, v.token_ids,
                                                                    p.temperature)
        loss = _valid_dapo(-nll.float(), v, p)
        loss.backward()
        return loss.detach()
    step.note = f"impl {getattr(impl, '__name__', '?')}"
    yield step


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
        hidden, weight, ids, adv, mask, old, ref = _args(x)
        h = hidden if p.temperature == 1.0 else hidden / p.temperature
        logp = -linear_cross_entropy(h, weight, ids, reduction="none").float()  # [B, T]
        loss = dapo_loss(logp, old, ref, adv, mask, p)
        loss.backward()
        return loss.detach()
    yield step


# Run order: the peers before compiled_grpo's own providers, so that a sticky CUDA error from a
# new kernel (illegal address: every later CUDA call fails) cannot cost the peers' numbers.
PROVIDERS: dict[str, Provider] = {
    pr.name: pr
    for pr in [
        Provider("floor", _always, _floor(False)),
        Provider("floor_valid", _always, _floor(True)),
        Provider("naive_eager", _always, _naive_eager),
        Provider("naive_compile", _always, _compiled_naive(False)),
        Provider("liger", _need("liger_kernel.chunked_loss"), _liger, accepts=_padded_only_no_softcap),
        Provider("cce", _need("cut_cross_entropy", cuda_only=True), _cce, accepts=_no_softcap),
        Provider("trl_chunked", _need("trl.kernels.chunked_logprob"), _trl_chunked),
        Provider("liger_cute", _liger_cute_check, _liger_cute, accepts=_no_softcap),
        Provider("compiled_grpo_valid", _need_cg("grpo_loss"), _compiled_grpo_valid),
        Provider("compiled_grpo", _need_cg("grpo_loss"), _compiled_grpo(False), accepts=_cg_packed),
        Provider("compiled_grpo+compile", _need_cg("grpo_loss"), _compiled_grpo(True), accepts=_cg_packed),
        Provider("compiled_grpo_recompute", _need_cg("grpo_loss"), _compiled_grpo(False, "recompute"),
                 accepts=_cg_packed),
        Provider("naive_compile+pass", _need_cg("enable_naive_logprob_fusion"), _compiled_naive(True),
                 pass_provider=True),
    ]
}


def resolve(names: Optional[list[str]]) -> list[Provider]:
    """All providers by default; the two floors always run first, since every ratio divides by them."""
    names = list(PROVIDERS) if not names else names
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    return [pr for pr in PROVIDERS.values() if pr.name in FLOORS or pr.name in names]  # run order


FLOORS = ("floor", "floor_valid")
