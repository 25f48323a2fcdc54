"""What Inductor generates for `grpo_loss`: no [N, V] buffer, forward or backward (STYLE.md item 9).

`run_and_get_code` captures one source per compiled graph: the forward, then the backward that
AOTAutograd compiles on the first `loss.backward()`. Shapes are picked so N*V is a number that
appears nowhere else: B=3, T=7 -> N=21, V=1009 (prime) -> N*V = 21189; H=16 keeps N*H=336 and
V*H=16144 distinct. The code is grepped for `21189` and for the shapes `(21, 1009)`,
`(1009, 21)` and `(3, 7, 1009)`.

CPU: the op's body loops over vocab chunks (CHUNK_V, lowered here to 128 so V=1009 takes 8
chunks: 7 x 128 + 113), so the chunk logits show up as bounded (21, 128) buffers instead.
CUDA: the op's Triton kernels (`_fwd_kernel`, `_dlogits_kernel`) appear in the generated code;
the backward's dlogits workspace is N x CHUNK_V (CHUNK_V lowered to 128 as well).

These checks pin gradient_mode="recompute" (the op whose kernels they name; "auto" picks the
fused-gradient mode on CUDA). The fused mode is checked too: its custom ops hold their [R, V]
workspace outside the Inductor code, which then holds no [N, V] buffer either.

The FX-graph and AOTAutograd caches are disabled here: the chunk width is a module global read
at trace time, which no cache key includes, and a cache hit would skip code generation.
"""
import dataclasses
import re
from contextlib import ExitStack

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import compiled_grpo as cg
import lowerings.linear_logprobs.tuning as tuning
import lowerings.linear_logprobs.cpu as torch_impl
from helpers import DEVICES, make_inputs

B, T, H, V = 3, 7, 16, 1009
N = B * T
CHUNK = 128
CFG = cg.GRPOConfig(loss_type="grpo", beta=0.04, metrics="with_entropy", entropy_coef=0.01,
                    gradient_mode="recompute")


def _no_caches():
    stack = ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


@pytest.fixture
def small_chunks(monkeypatch):
    # Both bodies read their chunk width at trace time. The Triton backward's workspace is
    # N x min(CHUNK_V, V rounded up to BLOCK_V): left at 2048 it would span all of V=1009.
    monkeypatch.setattr(torch_impl, "CHUNK_V", CHUNK)
    if torch.cuda.is_available():
        import lowerings.linear_logprobs.recompute.dense as triton_impl
        monkeypatch.setattr(tuning, "CHUNK_V", CHUNK)


def _inputs(device):
    out = make_inputs(B=B, T=T, H=H, V=V, device=device)
    out["bias"] = torch.zeros(V, device=device, requires_grad=True)
    return out


def _forward_and_backward_code(device, cfg=CFG):
    torch._dynamo.reset()
    inp = _inputs(device)
    compiled = torch.compile(cg.grpo_loss, backend="inductor", fullgraph=True)

    def step():
        out = compiled(**inp, config=cfg)
        out.loss.backward()
        return out

    with _no_caches():
        out, codes = run_and_get_code(step)
    ref = cg.grpo_loss(**{k: (v.detach().requires_grad_() if v.requires_grad else v) for k, v in inp.items()},
                       config=cfg)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)
    assert len(codes) == 2, f"expected a forward and a backward source, got {len(codes)}"
    return codes


def _saved_buffer_numel(code: str) -> int:
    """Total elements of the Inductor-allocated buffers the forward's `call` returns (its outputs
    plus the activations saved for the backward; graph inputs are not counted)."""
    shapes = {}
    for name, dims in re.findall(r"(buf\d+) = empty_strided_\w+\(\(([^)]*)\)", code):
        shapes[name] = [int(d) for d in dims.replace(" ", "").split(",") if d]
    for new, old in re.findall(r"(buf\d+) = (buf\d+); del \2  # reuse", code):
        shapes[new] = shapes.get(old, [])
    body = code[code.index("def call("):]
    ret = next(line for line in body.splitlines() if line.strip().startswith("return ("))
    total = 0
    for name in set(re.findall(r"\bbuf\d+\b", ret)):
        numel = 1
        for d in shapes.get(name, [0]):
            numel *= d
        total += numel
    return total


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens_by_vocab_buffer_forward_or_backward(device, small_chunks):
    fwd, bwd = _forward_and_backward_code(device)
    for which, code in (("forward", fwd), ("backward", bwd)):
        assert str(N * V) not in code, f"{which}: a buffer of N*V={N * V} elements"
        for shape in (f"({N}, {V})", f"({V}, {N})", f"({B}, {T}, {V})"):
            assert shape not in code, f"{which}: a {shape} buffer"
    if device == "cpu":
        # The vocab chunks, bounded: N x CHUNK logits per chunk in the backward's recompute.
        assert f"({N}, {CHUNK})" in bwd and f"({N}, {V - (V // CHUNK) * CHUNK})" in bwd
    else:
        assert "_fwd_kernel" in fwd, "the op's forward Triton kernel is not in the forward code"
        assert "_dlogits_kernel" in bwd, "the op's backward Triton kernel is not in the backward code"
        assert "_fwd_kernel" not in bwd


@pytest.mark.parametrize("device", DEVICES)
def test_fused_mode_has_no_tokens_by_vocab_buffer(device, small_chunks):
    fwd, bwd = _forward_and_backward_code(device, dataclasses.replace(CFG, gradient_mode="fused"))
    for which, code in (("forward", fwd), ("backward", bwd)):
        assert str(N * V) not in code, f"{which}: a buffer of N*V={N * V} elements"
        for shape in (f"({N}, {V})", f"({V}, {N})", f"({B}, {T}, {V})"):
            assert shape not in code, f"{which}: a {shape} buffer"
    assert "_fwd_kernel" not in bwd and "_dlogits_kernel" not in bwd   # the backward only scales


# Guards lowerings commit 853ab2f: when the CPU body is decomposed into the joint graph, CSE of the
# backward's recomputed chunk GEMMs with the forward's made the forward save every (N, CHUNK_V) logits
# chunk for the backward (N*V floats in all, no single N*V buffer, so the test above missed it).
@pytest.mark.parametrize("device", DEVICES)
def test_forward_saves_fewer_than_tokens_by_vocab_elements(device, small_chunks):
    fwd, _ = _forward_and_backward_code(device)
    saved = _saved_buffer_numel(fwd)
    assert saved < N * V, f"the forward returns/saves {saved} elements of buffers >= N*V = {N * V}"
