"""The per-block gradient of grpo_loss's fused-gradient mode (fused.py): (dL/dlogp, dL/dentropy)
of one row block's tokens, ``torch.func.grad`` of the loss functions themselves (objective.py's
per_token_loss and the normalizer weights), so no second, hand-written derivative exists.

Legend: N tokens, R' rows of a block (in the block's order), S sequences, G blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.dialect.common.cse_pass import CSEPass

from compiled_grpo.config import GRPOConfig
from compiled_grpo.objective import per_token_loss
from compiled_grpo.segments import segments_from_ids
from lowerings.linear_logprobs.device import static_value


def block_loss(lp, ent, idx, r0, per_tok, cfg, grouped=None):
    """The loss terms of one block's rows, sum(w * l) + sum(e * H), a scalar: lp / ent [R'] in the
    block's order, idx [R'] their original rows, per_tok the [N] inputs and weights (flat:
    padded [B, T] inputs as B sequences of T tokens). idx None: per_tok (and grouped's seg_ids)
    are already in the blocks' order, [G R] (gathered once for all blocks: fused.py in a trace),
    and the block's rows are [r0, r0 + R'). ``grouped`` (whole sequences: seg_ids [N],
    S, counts [G], R): block b = r0 // R holds whole sequences (lowerings' fused/order.py), its
    counts[b] valid tokens in the first slots in row order (order_rows_grouped); the slots past
    them are no token of the block: masked. Their sums run over all S sequences' ids (those of
    other blocks are empty here)."""
    def take(t):   # the block's rows of an [N] input (or of a [G R] one in the blocks' order)
        if t is None:
            return None
        return t.index_select(0, idx) if idx is not None else t.narrow(0, r0, lp.shape[0])

    segs = live = None
    if grouped is not None:
        seg_ids, s_num, counts, rows = grouped
        live = torch.arange(lp.shape[0], device=lp.device) < counts[r0 // rows]   # [R] valid tokens
        # the slots past them go to the last sequence, masked like any token: the ids stay
        # non-decreasing (the valid slots are in row order), as Segments' sums need
        segs = segments_from_ids(torch.where(live, take(seg_ids), s_num - 1), s_num)
    valid = take(per_tok["valid"]) if live is None else take(per_tok["valid"]) & live
    ent_term = 0.0 if per_tok["ent_w"] is None else (take(per_tok["ent_w"]) * ent).sum()
    # per_token is 0 where not valid, so slots past a block's rows add nothing to the sum
    terms = per_token_loss(lp, take(per_tok["old"]), valid, take(per_tok["adv"]), take(per_tok["sr"]),
                           take(per_tok["ref"]), cfg, segs, sampling_logprobs=take(per_tok["samp"]))
    return (take(per_tok["agg_w"]) * terms.per_token).sum() + ent_term


def block_grads(lp, ent, idx, r0, per_tok, cfg, grouped=None):
    """(dL/dlp, dL/dent) [R'] of one block: autograd of the loss functions (torch.func.grad)."""
    return torch.func.grad(block_loss, argnums=(0, 1))(lp, ent, idx, r0, per_tok, cfg, grouped)


# Inside a user's torch.compile, G token-level blocks' gradients inlined are G copies of
# torch.func.grad(block_loss) whose kernels Inductor generates one by one (~1.5-2 s a block on an
# H100 host: bench/results/compile_blocks_h100.txt). In a trace their inputs are [R] slices of
# the per-token inputs gathered once (fused.py's on_order) and R is static, so every block is the
# same function of the same shapes: traced_block_grads traces it ONCE to an aten graph (make_fx,
# when Dynamo computes the graph's key) and each block runs that graph through the custom op
# compiled_grpo::block_grads, opaque to Dynamo and Inductor. The op runs aten ops only: a
# compiled graph runs custom ops inside AOTAutograd's autograd.Function forward, where
# torch.func.grad itself cannot run, and Dynamo's nested_compile_region fails on torch 2.11
# ("Expected FakeTensor": it collects the region's functorch-wrapped intermediates).
PER_TOKEN = ("old", "valid", "adv", "sr", "ref", "agg_w", "ent_w", "samp")   # fused.py's per_tok
_FIELDS = tuple(f.name for f in dataclasses.fields(GRPOConfig))


def _dtype(name: str) -> torch.dtype:
    """torch.dtype from its str() ("torch.float32"), as _graph_key's json holds dtypes."""
    return getattr(torch, name.split(".")[-1])


def _config(values: list) -> GRPOConfig:
    """A GRPOConfig back from _graph_key's json of its field values."""
    kw = dict(zip(_FIELDS, values))
    if kw["lm_head_dtype"] is not None:
        kw["lm_head_dtype"] = _dtype(kw["lm_head_dtype"])
    return GRPOConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


@functools.lru_cache(maxsize=None)
def _block_graph(key: str) -> torch.fx.GraphModule:
    """The aten graph of (dL/dlp, dL/dent) of one token-level block: make_fx of block_grads on
    zero example tensors (the loss has no branch on tensor values, so any values trace it),
    functionalized, then its dead and repeated ops removed (each op is a kernel launch a block
    on CUDA: 87 -> 69 ops at bench.e2e's DAPO + k3 KL config; the same ops on the same values,
    so the same bits: tested). Functional first, so common-subexpression elimination cannot
    merge two tensors that an in-place op (masked_fill_) then writes."""
    values, rows, dtype, dtypes, device = json.loads(key)
    cfg, dev = _config(values), torch.device(device)
    present = [d != "" for d in dtypes]

    def grads(lp, ent, *inputs):
        it = iter(inputs)
        per_tok = {k: next(it) if p else None for k, p in zip(PER_TOKEN, present)}
        return block_grads(lp, ent, None, 0, per_tok, cfg)

    gm = make_fx(torch.func.functionalize(grads, remove="mutations"))(
        *_zero_inputs(rows, dtype, dtypes, dev))
    gm.graph.eliminate_dead_code()
    gm = CSEPass()(gm).graph_module
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@torch.compiler.assume_constant_result
def _graph_key(values: tuple, rows: int, dtype: str, dtypes: tuple, device: str) -> str:
    """The key of the block graph (traced here, once per key): json of the config's field values
    (torch 2.11's Dynamo cannot take the frozen config itself as a constant), R, the log-probs'
    dtype, each PER_TOKEN input's dtype ('' where None) and the device. A constant to Dynamo."""
    key = json.dumps([[str(v) if isinstance(v, torch.dtype) else v for v in values], rows, dtype,
                      list(dtypes), device])
    _block_graph(key)
    return key


# Where the op runs the block graph through Inductor rather than op by op. Run op by op, the
# graph's ~69 aten ops are ~70 kernel launches and ~1.4 ms of host a block on CUDA (qwen3-8b:
# 11 ms of a 49.6 ms compiled step against 42.5 eager: bench/results/compile_gap_h200_2026-11-29.txt);
# compiled, they are one or two fused kernels, as in an eager call (compiled_block_grads). Not on
# CPU: a C++ build per key for a few hundred tokens' elementwise work the graph does anyway.
COMPILE_BLOCK_GRAPH_ON = ("cuda",)


@functools.lru_cache(maxsize=None)
def _block_fn(key: str):
    """The block graph of ``key`` as the op runs it: Inductor-compiled on COMPILE_BLOCK_GRAPH_ON's
    devices (once per key, at the op's first run: at run time, outside the user's trace, so the
    user's compile holds one opaque op a block and its compile time grows by one small graph,
    not by G), else the fx graph itself."""
    gm = _block_graph(key)
    _, rows, dtype, dtypes, device = json.loads(key)
    if torch.device(device).type not in COMPILE_BLOCK_GRAPH_ON:
        return gm
    return _compile_block(gm, _zero_inputs(rows, dtype, dtypes, device))


def _zero_inputs(rows: int, dtype: str, dtypes: list, device) -> list:
    """Zero [R] example inputs of the block graph: lp, ent (dtype), then each present PER_TOKEN
    input (dtypes, '' where absent)."""
    return [torch.zeros(rows, dtype=_dtype(d), device=device) for d in (dtype, dtype, *dtypes) if d]


def _compile_block(gm: torch.fx.GraphModule, example: list):
    """Inductor's compile of one block graph (bench.probes.first_call times it)."""
    return torch._inductor.compile(gm, example)


@torch.library.custom_op("compiled_grpo::block_grads", mutates_args=())
def _block_grads_op(lp: Tensor, ent: Tensor, inputs: list[Tensor], key: str) -> tuple[Tensor, Tensor]:
    outs = _block_fn(key)(lp, ent, *inputs)
    # a custom op's outputs may not alias its inputs, and the graph may return one (dL/dent is
    # the entropy weights' slice): a host-side pointer test, no copy of the others
    ptrs = {t.untyped_storage().data_ptr() for t in (lp, ent, *inputs)}
    g_lp, g_ent = (t.clone() if t.untyped_storage().data_ptr() in ptrs else t for t in outs)
    return g_lp, g_ent


@_block_grads_op.register_fake
def _(lp, ent, inputs, key):
    return torch.empty_like(lp), torch.empty_like(ent)


def traced_block_grads(lp, ent, r0, ordered, cfg):
    """block_grads of the token-level block [r0, r0 + R) of the inputs in the blocks' order
    (``ordered``, fused.py's on_order) inside a trace, through the block graph traced once.
    R must be static (fused.py's compiled blocks); a symbolic R takes the inlined gradient."""
    rows = lp.shape[0]
    if not isinstance(rows, int):
        return block_grads(lp, ent, None, r0, ordered, cfg)
    fields = tuple(static_value(getattr(cfg, n)) for n in _FIELDS)   # constants for the key
    dtypes = tuple("" if ordered[k] is None else str(ordered[k].dtype) for k in PER_TOKEN)
    inputs = [ordered[k].narrow(0, r0, rows) for k in PER_TOKEN if ordered[k] is not None]
    key = _graph_key(fields, rows, str(lp.dtype), dtypes,
                     str(lp.device))
    return _block_grads_op(lp, ent, inputs, key)


# Eager CUDA calls run the per-block gradient as one compiled graph (dynamic shapes: one compile
# per config, every block and N): otherwise its ~60 small kernels a block cost ~0.5 ms of launches
# each (H200: qwen3-8b eager 46.7 vs compiled 43.6 ms; long, 32 blocks, 232 vs 200 ms; H100 GSPO
# on whole-sequence blocks: host-bound, 58 ms of launches for a 48 ms step). Inside a user's
# torch.compile the function is traced inline instead. BLOCK_GRADS_COMPILED = False turns
# it off (eager launches; no compile on the first call).
BLOCK_GRADS_COMPILED = True


@functools.lru_cache(maxsize=None)
def compiled_block_grads():
    return torch.compile(block_grads, dynamic=True, fullgraph=True)


def eager_call_block_grads(*args):
    """The compiled per-block gradient of an eager call, or the eager torch.func one once
    Dynamo's recompile limit for it is reached. Each GRPOConfig (its values guard the graph) and
    dtype is a graph of its own, so a process that runs more of them than
    ``torch._dynamo.config.recompile_limit`` (8; a sweep over configs, a beta schedule) meets the
    limit, which fullgraph=True turns into FailOnRecompileLimitHit (raised before anything runs)
    instead of Dynamo's eager run. From then on the calls run under the "eager_on_recompile"
    stance: the graphs already compiled keep serving their configs, the others run the same
    gradient eagerly (more kernel launches), with one warning."""
    global AT_LIMIT
    if AT_LIMIT:
        with torch.compiler.set_stance("eager_on_recompile"):
            return compiled_block_grads()(*args)
    try:
        return compiled_block_grads()(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        AT_LIMIT = True
        warnings.warn("compiled_grpo: the compiled per-block gradient of eager fused calls reached "
                      "torch._dynamo.config.recompile_limit (one graph per GRPOConfig and dtype); "
                      "new configs run it eagerly from now on (same values, more kernel launches)",
                      stacklevel=3)
        return block_grads(*args)


AT_LIMIT = False   # set once the compiled block gradient met Dynamo's recompile limit
