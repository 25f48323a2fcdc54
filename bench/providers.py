"""Every way of computing one GRPO (DAPO, beta>0) loss forward+backward that the bench compares:
the registry (PROVIDERS), the GEMM floors, the naive user code and compiled_grpo's own providers.
The peers' providers live in bench/peers.py, the bench's DAPO math in bench/dapo.py.

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

from bench.dapo import Params, _args, _import, _resetting, compact, naive_loss, naive_loss_with_logit_metrics
from bench.peers import (_cce, _liger, _liger_cute, _liger_cute_check, _quack, _trl_chunked, _trl_chunked_fp32,
                         _verl_torch, _verl_triton)
from bench.shapes import StepInputs


def _any_inputs(x: StepInputs) -> Optional[str]:
    return None


def _no_sequences(x: StepInputs) -> Optional[str]:
    return "no per-sequence importance ratio here (GSPO)"


def _padded_sequences(x: StepInputs) -> Optional[str]:
    return "packed input as one [1, N] row: no per-sequence ratio (GSPO)" if x.packed else None


Step = Callable[[], Optional[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    check: Callable[[torch.device], Optional[str]]
    build: Callable[[StepInputs, Params], ContextManager[Step]]
    pass_provider: bool = False  # expects compiled_grpo counters to move (the Inductor pass fired)
    accepts: Callable[[StepInputs], Optional[str]] = _any_inputs  # reason it cannot take these inputs
    # the same for the sequence-level loss (`--gspo`): providers that never sum per sequence
    # (one [1, N] row of compacted tokens) would compute another loss
    sequence_level: Callable[[StepInputs], Optional[str]] = _no_sequences


# ---- availability checks --------------------------------------------------------------------

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


def _no_softcap(x: StepInputs) -> Optional[str]:
    """Peers without a final_logit_softcapping option would compute another model's loss."""
    return "no final_logit_softcapping option" if x.softcap is not None else None


def _padded_only_no_softcap(x: StepInputs) -> Optional[str]:
    return _no_softcap(x) or _padded_only(x)


def _padded_only(x: StepInputs) -> Optional[str]:
    return "packed input: takes per-sequence advantages [B] over padded [B, T] rows" if x.packed else None


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


def _compiled_naive(enable_pass: bool, metrics: bool = False):
    """naive_loss under torch.compile, with the pass or not; metrics: the logits' min / max
    logged beside it (naive_loss_with_logit_metrics: the pass's extrema op, one GEMM more)."""
    user_fn = naive_loss_with_logit_metrics if metrics else naive_loss

    @contextlib.contextmanager
    def build(x, p):
        with _resetting(), (_no_compile_caches() if enable_pass else contextlib.nullcontext()):
            cg = importlib.import_module("compiled_grpo") if enable_pass else None
            if enable_pass:
                cg.enable_naive_logprob_fusion()
            try:
                # dynamic=False: one static graph per shape, the best case for the naive code.
                fn = torch.compile(user_fn, dynamic=False)

                def step():
                    loss = fn(*_args(x), p, x.softcap)
                    loss = loss[0] if metrics else loss
                    loss.backward()
                    return loss.detach()
                yield step
            finally:
                if enable_pass:
                    cg.disable_naive_logprob_fusion()
    return build


def _cg_config(cg, p: Params, mode: str = "auto", softcap: Optional[float] = None, **extra):
    fields = {f.name for f in dataclasses.fields(cg.GRPOConfig)}
    kw = {} if "gradient_mode" not in fields else dict(gradient_mode=mode)
    kw.update({k: v for k, v in extra.items() if k in fields})
    if softcap is not None:
        kw["final_logit_softcapping"] = softcap
    return cg.GRPOConfig(loss_type="dapo", beta=p.beta, epsilon_low=p.epsilon_low,
                         epsilon_high=p.epsilon_high, temperature=p.temperature,
                         importance_sampling_level=p.importance_sampling_level, **kw)


def _cg_packed(x: StepInputs) -> Optional[str]:
    if not x.packed:
        return None
    cg, why = _import("compiled_grpo")
    if cg is None:
        return why
    return None if "cu_seqlens" in inspect.signature(cg.grpo_loss).parameters else "grpo_loss has no cu_seqlens"


def _compiled_grpo(compile_it: bool, mode: str = "auto", **extra):
    """cg.grpo_loss on the inputs as they are: padded [B, T] with the mask, or packed [N] with
    cu_seqlens= (per-sequence advantages [S]). mode: GRPOConfig.gradient_mode ("auto" is the
    fused-gradient path for this loss); extra: other GRPOConfig fields (the lm_head precision)."""
    @contextlib.contextmanager
    def build(x, p):
        import compiled_grpo as cg
        cfg = _cg_config(cg, p, mode, x.softcap, **extra)
        kw = dict(cu_seqlens=x.cu_seqlens) if x.packed else {}
        if x.packed and p.importance_sampling_level == "sequence":
            # the bound whole-sequence blocks need, from the batch on the host as a trainer
            # computes flash-attn's max_seqlen (once, outside the timed step)
            kw["max_seqlen"] = int((x.cu_seqlens[1:] - x.cu_seqlens[:-1]).max())

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


# Run order: the peers before compiled_grpo's own providers, so that a sticky CUDA error from a
# new kernel (illegal address: every later CUDA call fails) cannot cost the peers' numbers.
PROVIDERS: dict[str, Provider] = {
    pr.name: pr
    for pr in [
        Provider("floor", _always, _floor(False), sequence_level=_any_inputs),
        Provider("floor_valid", _always, _floor(True), sequence_level=_any_inputs),
        Provider("naive_eager", _always, _naive_eager, sequence_level=_padded_sequences),
        Provider("naive_compile", _always, _compiled_naive(False), sequence_level=_padded_sequences),
        Provider("liger", _need("liger_kernel.chunked_loss"), _liger, accepts=_padded_only_no_softcap,
                 sequence_level=_padded_sequences),
        Provider("cce", _need("cut_cross_entropy", cuda_only=True), _cce, accepts=_no_softcap),
        Provider("trl_chunked", _need("trl.kernels.chunked_logprob"), _trl_chunked,
                 sequence_level=_any_inputs),
        Provider("liger_cute", _liger_cute_check, _liger_cute, accepts=_no_softcap,
                 sequence_level=_any_inputs),
        Provider("quack", _need("quack.linear_cross_entropy", cuda_only=True), _quack, accepts=_no_softcap),
        # verl 0.9.1's two fused-kernel backends (`import verl` needs its own environment: ray,
        # tensordict, omegaconf, ...; bench/README.md); no softcap option in either
        Provider("verl_torch", _need("verl.utils.experimental.torch_functional"), _verl_torch,
                 accepts=_no_softcap, sequence_level=_any_inputs),
        Provider("verl_triton", _need("verl.utils.kernel.linear_cross_entropy", cuda_only=True), _verl_triton,
                 accepts=_no_softcap, sequence_level=_any_inputs),
        Provider("compiled_grpo_valid", _need_cg("grpo_loss"), _compiled_grpo_valid),
        Provider("compiled_grpo", _need_cg("grpo_loss"), _compiled_grpo(False), accepts=_cg_packed,
                 sequence_level=_any_inputs),
        Provider("compiled_grpo+compile", _need_cg("grpo_loss"), _compiled_grpo(True), accepts=_cg_packed,
                 sequence_level=_any_inputs),
        Provider("compiled_grpo_recompute", _need_cg("grpo_loss"), _compiled_grpo(False, "recompute"),
                 accepts=_cg_packed, sequence_level=_any_inputs),
        Provider("naive_compile+pass", _need_cg("enable_naive_logprob_fusion"), _compiled_naive(True),
                 pass_provider=True),
        Provider("naive_compile+pass+metrics", _need_cg("enable_naive_logprob_fusion"),
                 _compiled_naive(True, metrics=True), pass_provider=True),
        # the lm_head precision settings (docs/losses-and-metrics.md, "lm_head precision"): logits rounded to bf16 as
        # trl_chunked computes them, and fp32 operands against TRL's cast_lm_head_to_fp32
        Provider("compiled_grpo_round", _need_cg("grpo_loss"), _compiled_grpo(False, round_logits=True),
                 accepts=_cg_packed, sequence_level=_any_inputs),
        # the fp32-logits default with the dlogits backward that round_logits must take (the
        # exp-scaled backward rounds exp(z - R*) instead of the logits gradient): the same scheme
        Provider("compiled_grpo_dlogits", _need_cg("grpo_loss"), _compiled_grpo(False, fused_scaled_backward=False),
                 accepts=_cg_packed, sequence_level=_any_inputs),
        Provider("compiled_grpo_fp32_head", _need_cg("grpo_loss"), _compiled_grpo(False, fp32_lm_head=True),
                 accepts=_cg_packed, sequence_level=_any_inputs),
        Provider("trl_chunked_fp32_head", _need("trl.kernels.chunked_logprob"), _trl_chunked_fp32,
                 sequence_level=_any_inputs),
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
