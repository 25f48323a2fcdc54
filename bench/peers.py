"""The peers' providers: TRL 1.16's chunked log-prob function, Liger 0.8.5 (chunked GRPO loss and
the CuTe-DSL fused linear cross-entropy) and Apple's Cut Cross-Entropy, each as its users call it,
followed by the bench's DAPO math (bench/dapo.py). Registered in bench/providers.py."""
from __future__ import annotations

import contextlib

import torch

from bench.dapo import _args, _import, _resetting, _valid_dapo, compact, dapo_loss


TRL_CHUNK_SIZE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16 (vocab tile width)


@contextlib.contextmanager
def _trl_chunked(x, p, fp32_head: bool = False):
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
        h, w = v.hidden(x), x.weight
        if fp32_head:   # TRL's cast_lm_head_to_fp32: fp32 hidden states and head, no autocast
            h, w = h.float(), w.float()
        logp = ChunkedLogProbFunction.apply(h, w, None, v.token_ids, p.temperature, chunk,
                                            x.softcap, 1.0, ())[0]  # [N_valid] fp32
        loss = _valid_dapo(logp, v, p)
        loss.backward()
        return loss.detach()
    step.note = note
    yield step


def _trl_chunked_fp32(x, p):
    """_trl_chunked with TRL's cast_lm_head_to_fp32 (fp32 GEMMs; the casts inside the step)."""
    return _trl_chunked(x, p, fp32_head=True)


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
    log-probs, then the bench's DAPO math (with `--gspo` its per-sequence sums over the compacted
    tokens' sequence ids, as for TRL)."""
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
def _quack(x, p):
    """QuACK's `chunked_linear_cross_entropy` (quack-kernels 0.6.5: CuTe-DSL GEMMs whose epilogue
    forms the logits' gradient in the forward; its scaled-exp pipeline where it says it is
    eligible) on the valid tokens, reduction "sum". A speed anchor only: it takes no per-token
    weights (reduction "none" materializes the logits), so the loss is the summed cross-entropy,
    not the bench's DAPO loss, and its error columns do not apply. Temperature 1: it has no
    temperature option (logits / T would be a scaled weight, an extra [V, H] copy)."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    v = compact(x)
    n = v.token_ids.shape[0]
    # its GEMMs take N % 8 == 0: ignored rows (target -100, a copy of row 0 whose gradient is 0)
    # pad the valid ones, gathered in the same one copy as the other valid-token peers' rows
    pad = -n % 8
    ids = torch.cat([v.token_ids, v.token_ids.new_full((pad,), -100)])
    rows = v.rows if v.rows is not None else torch.arange(n, device=ids.device)
    rows = torch.cat([rows, rows[:1].expand(pad)])

    def step():
        h = x.hidden.view(-1, x.hidden.shape[-1])
        h = h.index_select(0, rows) if pad or v.rows is not None else h
        loss = chunked_linear_cross_entropy(h, x.weight, ids, chunk_size=4096, reduction="sum")
        loss.backward()
        return loss.detach()
    step.note = "CE sum (not the DAPO loss): speed anchor, errors n/a"
    yield step


@contextlib.contextmanager
def _liger(x, p):
    """Liger-Kernel 0.8.5 chunked_loss GRPO: sequence chunks x 4096-wide vocab tiles, the whole
    backward (8*N*H*V) runs inside forward; `--gspo` passes its importance_sampling_level
    ("sequence": GSPO over each padded row, chunk_size=1 keeps a row whole). compiled=True is its default (torch.compile of the loss
    math); on CPU we pass False, because compiling per chunk on CPU costs more than the bench."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    mod = LigerFusedLinearGRPOLoss(
        beta=p.beta, compiled=x.hidden.device.type == "cuda", use_ref_model=True, chunk_size=1,
        epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high, loss_type="dapo",
        temperature=p.temperature, importance_sampling_level=p.importance_sampling_level)
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


@contextlib.contextmanager
def _verl(x, p, backend: str):
    """verl 0.9.1's fused log-prob backends as its patched model forward calls them
    (verl/models/transformers/dense_common.py), on the valid tokens (verl's remove-padding [nnz]
    rows), then the bench's DAPO math. "torch": `FusedLinearForPPO` (512-row chunks of a
    [rows, V] fp32 softmax, the backward recomputes: 8*N*H*V); "triton":
    `verl.utils.kernel.linear_cross_entropy` (verl's Triton kernels; CUDA). Both return the
    entropy too, which verl's forward computes whether or not the loss uses it."""
    v = compact(x)
    if backend == "torch":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
        fused = FusedLinearForPPO(impl_backend="torch")

        def head(h, w, ids):
            return fused(h, w, ids, temperature=p.temperature)
    else:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        def head(h, w, ids):
            return linear_cross_entropy(h, w, ids, p.temperature, "none")

    def step():
        logp, _entropy = head(v.hidden(x), x.weight, v.token_ids)      # [N_valid] each
        loss = _valid_dapo(logp.float(), v, p)
        loss.backward()
        return loss.detach()
    yield step


def _verl_torch(x, p):
    return _verl(x, p, "torch")


def _verl_triton(x, p):
    return _verl(x, p, "triton")
