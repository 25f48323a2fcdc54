"""A design probe for the compiled step's first call (bench/results/compile_blocks_h100.txt): each
token-level block's loss gradient as ONE aten graph, traced once and run by a custom op, instead
of G inlined copies of torch.func.grad that Inductor compiles one by one.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TRITON_CACHE_DIR=$(mktemp -d) \\
        python -m bench.probes.block_grads_graph [--compile-graph] [compile_blocks' arguments]

runs bench.probes.compile_blocks with fused_grads.block_grads patched in this process (the package
is unchanged). How: in a trace, a block's inputs are [R] slices (the per-token inputs gathered
into the blocks' order, fused.py's on_order) and R is static, so ``graph_key`` (a constant to
Dynamo: torch.compiler.assume_constant_result, called with the config, R, dtypes, device and
which inputs are present) traces torch.func.grad(block_loss) once with make_fx on [R] example
tensors, keeps the graph in a registry and returns its key; ``probe::block_grads`` runs that
graph's aten ops (no functorch at run time: a compiled graph runs custom ops inside
AOTAutograd's autograd.Function forward, where torch.func.grad cannot). Whole-sequence blocks
keep the inlined gradient. Measured on torch 2.13 CPU only so far; whether Dynamo 2.11 accepts
make_fx inside an assume_constant_result call is what a GPU run of this probe shows first. The
graph's ops run eagerly (~60 small kernels a block) unless --compile-graph, where Inductor
compiles each traced graph once, at its first run inside the compiled step
(torch._inductor.compile on the op's real inputs).
"""
import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from bench.probes import compile_blocks
from compiled_grpo import fused_grads

PER_TOKEN = ("old", "valid", "adv", "sr", "ref", "agg_w", "ent_w", "samp")   # fused.py's per_tok
_GRAPHS: dict = {}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


@torch.compiler.assume_constant_result
def graph_key(cfg, rows: int, dtype: str, dtypes: str, device: str) -> str:
    """The registry key of the block gradient's aten graph for these static facts (traced on the
    first request): dtypes lists each PER_TOKEN input's dtype, '' where it is None."""
    key = f"{cfg!r}|{rows}|{dtype}|{dtypes}|{device}"
    if key not in _GRAPHS:
        dev, present = torch.device(device), [d != "" for d in dtypes.split(",")]

        def grads(lp, ent, *inputs):
            it = iter(inputs)
            per_tok = {k: (next(it) if p else None) for k, p in zip(PER_TOKEN, present)}
            return torch.func.grad(fused_grads.block_loss, argnums=(0, 1))(
                lp, ent, None, 0, per_tok, cfg, None)

        examples = [torch.zeros(rows, dtype=_dtype(d), device=dev) for d in dtypes.split(",") if d]
        lp = torch.zeros(rows, dtype=_dtype(dtype), device=dev)
        _GRAPHS[key] = make_fx(grads)(lp, lp.clone(), *examples)
    return key


COMPILE = False   # --compile-graph: Inductor compiles each traced graph at its first run (once)
_COMPILED: dict = {}


@torch.library.custom_op("probe::block_grads", mutates_args=())
def block_grads_op(lp: Tensor, ent: Tensor, inputs: list[Tensor], key: str) -> tuple[Tensor, Tensor]:
    fn = _GRAPHS[key]
    if COMPILE:
        if key not in _COMPILED:
            _COMPILED[key] = torch._inductor.compile(fn, [lp, ent, *inputs])
        fn = _COMPILED[key]
    g_lp, g_ent = fn(lp, ent, *inputs)
    return g_lp.clone(), g_ent.clone()


@block_grads_op.register_fake
def _(lp, ent, inputs, key):
    return torch.empty_like(lp), torch.empty_like(ent)


_inlined = fused_grads.block_grads


def block_grads(lp, ent, idx, r0, per_tok, cfg, grouped=None):
    """fused_grads.block_grads, with a trace's token-level blocks through the traced graph."""
    if not (torch.compiler.is_compiling() and grouped is None and idx is None):
        return _inlined(lp, ent, idx, r0, per_tok, cfg, grouped)
    rows = lp.shape[0]
    dtypes = ",".join("" if per_tok[k] is None else str(per_tok[k].dtype) for k in PER_TOKEN)
    inputs = [per_tok[k].narrow(0, r0, rows) for k in PER_TOKEN if per_tok[k] is not None]
    key = graph_key(cfg, rows, str(lp.dtype), dtypes, str(lp.device))
    return block_grads_op(lp, ent, inputs, key)


if __name__ == "__main__":
    import sys
    if "--compile-graph" in sys.argv:
        sys.argv.remove("--compile-graph")
        COMPILE = True
    fused_grads.block_grads = block_grads
    compile_blocks.main()
