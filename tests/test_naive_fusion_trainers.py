"""The naive-fusion pass on the log-prob / entropy code RL trainers ship (issue 65), CPU:
TRL 1.16's own `selective_log_softmax` (its per-row loops, both dtype branches) and
`entropy_from_logits` (its chunk loop), together on one logits as TRL's trainer calls them, an HF
causal LM's `.logits` sliced the way trainers slice them, einsum heads, take_along_dim, verl's
remove-padding spelling (`.squeeze(0)`, a per-token temperature tensor), a 0-dim tensor
temperature, and autocast regions (more spellings: tests/test_naive_fusion_spellings.py). Each:
the pass's counters, no [N, V] buffer in Inductor's code, and outputs and gradients equal to the same code run unfused (fp32 cases to 1e-5; bf16 and
autocast cases within the logits' bf16 rounding, which the op does not make: it keeps the GEMM's
fp32 accumulation). verl's own functions run in tests/test_verl.py (its venv). The harness (the
pass on, tiny shapes, `check`) is naive_fusion_harness.py's.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from naive_fusion_harness import B, H, T, V, check, fired, fusion_on, make, nv_buffers, pass_on_graph  # noqa: F401
from test_naive_fusion_spellings import (categorical, chunked_entropy_written, class_dim_second_cross_entropy,
                                         complement_softplus_vocab_chunks, sequence_slices_beside_entropy,
                                         hf_causal_lm_loss, nemo_rl_logprobs, nll_of_log_softmax,
                                         verl_inplace_temperature, weighted_cross_entropy)


def selective_log_softmax(*args, **kwargs):   # TRL's own, imported where called (the GPU
    from trl.trainer.utils import selective_log_softmax as f   # machines have no TRL)
    return f(*args, **kwargs)


def entropy_from_logits(*args, **kwargs):
    from trl.trainer.utils import entropy_from_logits as f
    return f(*args, **kwargs)


def trl_selective(h, w, b, ids):
    return (selective_log_softmax(h @ w.T + b, ids),)


def trl_selective_temperature(h, w, b, ids):
    return (selective_log_softmax(F.linear(h, w, b), ids, temperature=0.7),)


def trl_entropy_chunked(h, w, b, ids):
    return (entropy_from_logits(h @ w.T, chunk_size=4),)


def trl_trainer_head(h, w, b, ids):
    """TRL's _get_per_token_logps_and_entropies: slice, temperature, both functions."""
    logits = F.linear(h, w)[:, :-1, :] / 0.9
    return selective_log_softmax(logits, ids[:, 1:]), entropy_from_logits(logits, chunk_size=5)


def einsum_head(h, w, b, ids):
    return (torch.einsum("bth,vh->btv", h, w).log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


def einsum_ellipsis(h, w, b, ids):
    return (torch.einsum("...h,vh->...v", h, w).log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


def take_along_dim(h, w, b, ids):
    return (torch.take_along_dim(torch.log_softmax(h @ w.T, -1), ids[..., None], dim=-1)[..., 0],)


def verl_remove_padding(h, w, b, ids):
    """verl's engine: packed [1, nnz] hidden, logits.squeeze(0), a per-token temperature tensor."""
    temperature = torch.full((B * T,), 0.8, device=h.device)
    logits = F.linear(h.reshape(1, B * T, H), w).squeeze(0)                   # [nnz, V]
    logits = logits / temperature.unsqueeze(-1).clamp(min=1e-8).to(logits.dtype)
    lp = logits.log_softmax(-1).gather(-1, ids.reshape(-1, 1)).squeeze(-1)
    ent = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)   # verl's entropy
    return lp, ent


def tensor_temperature(h, w, b, ids):
    t = torch.tensor(0.6, device=h.device)
    return (((h @ w.T) / t).log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


def trl_log_softmax_and_entropy(h, w, b, ids):
    """TRL 1.16's selective_log_softmax_and_entropy as its trainers call it (CPU: its loops): the
    entropy under torch.no_grad (entropy_requires_grad=False), a row mask, the default chunk of
    128 rows (here one chunk)."""
    from trl.trainer.utils import selective_log_softmax_and_entropy
    mask = torch.ones_like(ids[:, 1:])
    mask[0, -2:] = 0
    return selective_log_softmax_and_entropy(F.linear(h, w, b)[:, :-1, :], ids[:, 1:],
                                             entropy_requires_grad=False, row_mask=mask)


FP32 = [(trl_log_softmax_and_entropy, (1, 1)), (trl_selective, (1, 0)), (trl_selective_temperature, (1, 0)), (trl_entropy_chunked, (0, 1)),
        (trl_trainer_head, (1, 1)), (einsum_head, (1, 0)), (einsum_ellipsis, (1, 0)),
        (take_along_dim, (1, 0)), (verl_remove_padding, (1, 1)), (tensor_temperature, (1, 0))]


@pytest.mark.parametrize("fn,expect", FP32, ids=[f.__name__ for f, _ in FP32])
def test_trainer_spelling_fused(fn, expect):
    # the entropy's gradient sums V terms a row in another order than the naive graph: 1e-4
    tol = 1e-4 if expect[1] else 1e-5
    sources = check(fn, expect, rtol=tol, atol=tol)
    assert not nv_buffers(sources), nv_buffers(sources)
    assert not counters["compiled_grpo_unfused"], dict(counters["compiled_grpo_unfused"])


def test_row_loops_are_folded():
    """TRL's loops come back as one computation (the counter counts the folded stacks / cats)."""
    check(trl_trainer_head, (1, 1), rtol=1e-4, atol=1e-4)
    assert counters["compiled_grpo"]["naive_row_loop_fold"] == 2      # the logsumexp rows, the entropy chunks


def trl_selective_bf16(h, w, b, ids):
    return (selective_log_softmax(h @ w.T, ids),)   # bf16 logits: TRL's per-row log_softmax branch


def autocast_head(h, w, b, ids):
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        logits = F.linear(h, w)                      # bf16 GEMM of the fp32 parameters
    return (logits.float().log_softmax(-1).gather(-1, ids[..., None])[..., 0],)


def autocast_trl(h, w, b, ids):
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        logits = h @ w.T
        return selective_log_softmax(logits, ids), entropy_from_logits(logits, chunk_size=7)


def trl_selective_one_row(h, w, b, ids):
    """TRL's bf16 branch over a batch of one: its loop over rows runs once."""
    return (selective_log_softmax(F.linear(h[:1], w, b), ids[:1]),)


@pytest.mark.parametrize("fn,expect,dtype", [(trl_selective_bf16, (1, 0), torch.bfloat16),
                                             (trl_selective_one_row, (1, 0), torch.bfloat16),
                                             (autocast_head, (1, 0), torch.float32),
                                             (autocast_trl, (1, 1), torch.float32)],
                         ids=["trl_selective_bf16", "trl_selective_one_row", "autocast_head", "autocast_trl"])
def test_bf16_spelling_fused(fn, expect, dtype):
    """Within the logits' bf16 rounding (~0.02 at these logits, |z| ~ 3): the naive code rounds
    the GEMM's output to bf16, the op keeps its fp32 accumulation."""
    sources = check(fn, expect, make_kw={"dtype": dtype}, rtol=5e-2, atol=5e-2)
    assert not nv_buffers(sources), nv_buffers(sources)


def hf_model(tied=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("keep", [0, 5])
def test_hf_causal_lm_logits_sliced(keep):
    """model(...).logits[:, :-1] / T into TRL's functions, the whole forward compiled; with
    logits_to_keep the last K positions. Equal to the uncompiled model."""
    model = hf_model()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))

    def step(ids):
        logits = model(input_ids=ids, logits_to_keep=keep).logits[:, :-1, :] / 0.7
        tgt = ids[:, 1:] if keep == 0 else ids[:, -(keep - 1):]
        return selective_log_softmax(logits, tgt), entropy_from_logits(logits, chunk_size=4)

    want = step(ids)
    got = torch.compile(step, fullgraph=True)(ids)
    assert fired() == (1, 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    g_want = torch.autograd.grad(sum(t.sum() for t in want), [model.lm_head.weight])
    g_got = torch.autograd.grad(sum(t.sum() for t in got), [model.lm_head.weight])
    torch.testing.assert_close(g_got[0], g_want[0], rtol=1e-4, atol=1e-5)


def rows_differ(h, w, b, ids):
    """A per-row loop whose rows do different things: not one computation, left alone."""
    logits = h @ w.T
    return (torch.stack([torch.logsumexp(logits[0], -1), torch.logsumexp(logits[1] * 2, -1),
                         torch.logsumexp(logits[2], -1)]),)


def rows_missing(h, w, b, ids):
    """Rows 0 and 1 of 3: the stack does not cover the logits, left alone."""
    logits = h @ w.T
    return (torch.stack([torch.logsumexp(lg, -1) for lg in (logits[0], logits[1])]),)


def rows_shared_tensor(h, w, b, ids):
    """Each row times the same [T, V] tensor: a tensor from outside the row, left alone."""
    logits = h @ w.T
    s = torch.ones(T, V)
    return (torch.stack([torch.logsumexp(lg * s, -1) for lg in logits]),)


@pytest.mark.parametrize("fn", [rows_differ, rows_missing, rows_shared_tensor])
def test_loops_that_are_not_one_computation_are_left_alone(fn):
    check(fn, (0, 0))
    assert counters["compiled_grpo"]["naive_row_loop_fold"] == 0
    assert counters["compiled_grpo_unfused"]["logits_users"] >= 1


def rows_beside_the_logits(h, w, b, ids):
    """TRL's fp32 row loop beside a user that needs the logits themselves: unfused."""
    logits = h @ w.T
    return torch.stack([torch.logsumexp(lg, -1) for lg in logits]), logits


def chunks_written_beside_the_logits(h, w, b, ids):
    """A chunk loop writing into a buffer (verl's chunked entropy) beside a user that needs the
    logits themselves: unfused, the writes put back."""
    logits = (h @ w.T).reshape(B * T, V)
    out = torch.zeros(B * T)
    for i in range(0, B * T, 8):
        out[i:i + 8] = torch.logsumexp(logits[i:i + 8], dim=-1)
    return out, logits


def rows_of_no_logits(h, w, b, ids):
    """A foldable row loop over no logits at all (no GEMM feeds it)."""
    return (torch.stack([torch.logsumexp(r, -1) for r in h]),)


@pytest.mark.parametrize("fn", [rows_beside_the_logits, rows_of_no_logits, chunks_written_beside_the_logits])
def test_unused_fold_is_undone(fn):
    """A loop the pass folded but no rewrite then used is put back as the user wrote it (one
    logsumexp a row, then the stack: the loop's memory, not a batched [B, T, V] one), the
    results equal, and no fold is counted."""
    check(fn, (0, 0))
    assert counters["compiled_grpo"]["naive_row_loop_fold"] == 0
    _, after = pass_on_graph(fn)
    calls = [n.target for n in after.graph.nodes if n.op in ("call_function", "call_method")]
    if fn is chunks_written_beside_the_logits:     # three chunks, three writes, in order
        assert sum(t is torch.logsumexp for t in calls) == 3 and calls.count(operator.setitem) == 3, calls
        keys = [n.args[1] for n in after.graph.nodes if n.target is operator.setitem]
        assert keys == [slice(0, 8), slice(8, 16), slice(16, 24)], keys
        return
    assert sum(t in (torch.logsumexp, "logsumexp") for t in calls) == B, calls
    assert calls.count(torch.stack) == 1, calls


def test_trl_trainer_head_dynamic_shapes():
    """torch.compile(dynamic=True): TRL's loops are unrolled per B and chunk count (Dynamo
    specializes those; a new count is a new graph, TRL's code's nature), and every graph is
    fused, its logits.shape read from h's view (a size() user of the logits is no obstacle)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda h, w, ids: trl_trainer_head(h, w, None, ids), backend=cnt, dynamic=True)
    for b, t in ((2, 9), (2, 17)):
        g = torch.Generator().manual_seed(b * t)
        h = torch.randn(b, t, H, generator=g)
        w = torch.randn(V, H, generator=g)
        ids = torch.randint(0, V, (b, t), generator=g)
        for got, want in zip(fn(h, w, ids), trl_trainer_head(h, w, None, ids)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["compiled_grpo"]["naive_logprob_fusion"] == cnt.frame_count >= 2
    assert counters["compiled_grpo"]["naive_entropy_fusion"] == cnt.frame_count
    assert not counters["compiled_grpo_unfused"], dict(counters["compiled_grpo_unfused"])


# On CUDA the same rewrites launch the op's Triton kernels. TRL's functions are not here: on CUDA
# TRL 1.16 runs its own Triton kernel (_fused_logprob_entropy), not the loops, and the pass does
# not rewrite that kernel (docs/inductor-pass.md).
CUDA_CASES = [(einsum_head, (1, 0)), (take_along_dim, (1, 0)), (verl_remove_padding, (1, 1)),
              (tensor_temperature, (1, 0)), (autocast_head, (1, 0)), (verl_inplace_temperature, (1, 0)),
              (nemo_rl_logprobs, (1, 0)), (hf_causal_lm_loss, (1, 0)), (chunked_entropy_written, (1, 1)),
              (nll_of_log_softmax, (1, 0)), (class_dim_second_cross_entropy, (1, 0)),
              (categorical, (1, 1)), (weighted_cross_entropy, (1, 0)),
              (sequence_slices_beside_entropy, (1, 1)), (complement_softplus_vocab_chunks, (1, 0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fn,expect", CUDA_CASES, ids=[f.__name__ for f, _ in CUDA_CASES])
def test_trainer_spelling_fused_cuda(fn, expect):
    tol = 5e-2 if fn is autocast_head else 1e-4
    sources = check(fn, expect, make_kw={"device": "cuda"}, rtol=tol, atol=tol)
    assert not nv_buffers(sources), nv_buffers(sources)


# TRL 1.16 on CUDA runs its own Triton kernel (trl.kernels.logprob_entropy) for both functions,
# recorded by Dynamo as one autograd_function_apply launching _forward_kernel. Traced here on a
# CPU machine in a subprocess: Triton's driver names an sm_90 target, torch believes Triton can
# run, and TRL's kernel gate says yes for CPU tensors, so Dynamo records the CUDA branch's graph
# exactly; the pass must remove the kernel (Inductor could not build it for CPU) and equal TRL's
# own CPU loops run eagerly.
_TRL_KERNEL_SCRIPT = r'''
import torch, triton
import torch.nn.functional as F
from triton.backends.compiler import GPUTarget

class FakeDriver:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def is_active(self): return True
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0

import torch.utils._triton as torch_triton
import trl.trainer.utils as U
from torch._dynamo.utils import counters
from lowerings.naive_fusion import naive_logprob_fusion

def head(h, w, ids, T):
    """TRL's trainer head: the logits over the temperature into both functions (T = 1), or the
    temperature passed to the kernel, TRL's fused call giving the entropy (T != 1)."""
    logits = F.linear(h, w)[:, :-1, :] / 0.9
    if T == 1.0:
        return U.selective_log_softmax(logits, ids[:, 1:]), U.entropy_from_logits(logits)
    return (U.selective_log_softmax(logits, ids[:, 1:], temperature=T),
            U.selective_log_softmax_and_entropy(logits, ids[:, 1:], temperature=T)[1])

g = torch.Generator().manual_seed(0)
h = torch.randn(2, 7, 16, generator=g, dtype=torch.float64).float()
w = (torch.randn(40, 16, generator=g, dtype=torch.float64) * 0.3).float()
ids = torch.randint(0, 40, (2, 7), generator=g)
refs = {}
for T in (1.0, 0.7):                                      # TRL's CPU loops, eager
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    ref = head(*leaves, ids, T)
    sum(o.sum() for o in ref).backward()
    refs[T] = ref, [t.grad for t in leaves]
torch_triton.has_triton = lambda *a, **k: True    # torch 2.15 passes include_cpu=
U._supports_trl_loss_kernel = lambda *a, **k: True
U.is_triton_available = lambda: True
triton.runtime.driver.set_active(FakeDriver())
for T, (ref, ref_grads) in refs.items():
    counters.clear()
    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    with naive_logprob_fusion(), torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(head, fullgraph=True, backend="inductor")(*leaves, ids, T)
        sum(o.sum() for o in out).backward()
    fired = dict(counters["compiled_grpo"])
    assert fired.get("naive_logprob_fusion") == 1 and fired.get("naive_entropy_fusion") == 1, fired
    assert not counters["compiled_grpo_unfused"], dict(counters["compiled_grpo_unfused"])
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip([t.grad for t in leaves], ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
print("OK")
'''


def test_trl_cuda_kernel_fused():
    """TRL's CUDA branch (its Triton kernel for selective_log_softmax, entropy_from_logits and
    selective_log_softmax_and_entropy, one logits, a temperature in the call and one in the
    user's code) is rewritten to one linear_logprobs call: both counters once, TRL's kernel
    gone, log-probs, entropy and gradients equal TRL's own loops."""
    import subprocess
    import sys
    import os
    pytest.importorskip("trl")
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _TRL_KERNEL_SCRIPT], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.stdout[-2000:], r.stderr[-4000:])
