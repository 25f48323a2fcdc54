"""The graph-to-op-sequence helpers of the snapshot tests (test_graph_snapshots.py,
test_graph_snapshots_entropy.py): the configurations, their Dynamo and AOTAutograd graphs on tiny
fixed shapes (B=2, T=5, H=16, V=37), and `op_sequence`, which prints a graph as one op a line with
the fused op's decomposition collapsed back into one token (see test_graph_snapshots.py)."""
import operator
import os

import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, EagerAndRecordGraphs

import compiled_grpo as cg
import lowerings.linear_logprobs.cpu as _cpu_module
import lowerings.linear_logprobs.recompute.dense as _cuda_module
import lowerings.linear_logprobs.op as _op_module
from helpers import make_inputs
from lowerings.linear_logprobs.launching.triton_compat import release   # 'major.minor' of any version

# Layout, aliasing, dtype-cast and constant bookkeeping: dropped so the sequences show the math and
# read the same on torch 2.11 and 2.13 (which differ in view vs reshape, alias nodes, where the
# scalar of torch.where(m, x, 0) lives, and sym_size nodes).
DROPPED = frozenset({
    "view", "reshape", "_unsafe_view", "alias", "detach", "permute", "t", "transpose", "expand", "clone",
    "contiguous", "unsqueeze", "squeeze", "getitem", "slice", "select", "as_strided", "_to_copy", "to",
    "long", "float", "double", "type_as", "convert_element_type", "lift_fresh_copy", "scalar_tensor",
    "sym_size", "sym_numel", "sym_stride", "size", "dim",
})
# The op's own code (its triton_op bodies and autograd in lowerings/) collapses into one token:
# the files of the modules that hold it, from the imported modules themselves, so a file move
# (with its imports updated) keeps the snapshots.
OP_FILES = tuple(os.path.abspath(m.__file__) for m in (_op_module, _cpu_module, _cuda_module))


def _token(node) -> str:
    """One token per FX node: OpOverload/OpOverloadPacket -> `ns.op` (no overload); call_method ->
    `.name`; a torch function -> `torch.name`; a Python builtin (operator.mul) -> its __name__;
    a higher-order op -> `hop.<name>`."""
    target = node.target
    if node.op == "call_method":
        return "." + target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.name()}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ns, name = target.name().split("::")
        return f"{ns}.{name.split('.')[0]}"
    name = getattr(target, "__name__", str(target))
    if getattr(operator, name, None) is target:
        return name
    return f"torch.{name}"


def _bare(token: str) -> str:
    return token.rsplit(".", 1)[-1]


def _in_op(node) -> bool:
    """The innermost user frame of the node's stack trace lies in the op's files. AOTAutograd copies
    the stack trace of the Dynamo node being traced, so every node of the op's decomposition (forward
    and backward) carries the `_linear_logprobs_op(...)` call site."""
    files = [line for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip().startswith("File ")]
    return bool(files) and any(f in files[-1] for f in OP_FILES)


def _op_region(gm: torch.fx.GraphModule) -> set:
    """The op's nodes (by stack trace, `_in_op`) plus the forward values computed only for it (the
    masked ids): a node joins when every user but the graph output is in the region and it does
    not depend on a tangent. The partitioner saves those values on one device and recomputes them
    in the backward on another, so without this the backward sequences would differ by device."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    tangent = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in tangent for a in n.all_input_nodes):
            tangent.add(n)
    region = {n for n in nodes if _in_op(n)}
    for n in reversed(nodes):
        users = [u for u in n.users if u.op != "output"]
        if n not in region and n not in tangent and users and all(u in region for u in users):
            region.add(n)
    return region


def op_sequence(gm: torch.fx.GraphModule, collapse_as: str = None) -> str:
    """The graph's compute nodes, one token a line, layout/bookkeeping ops (DROPPED) left out.

    With `collapse_as`, the op's region (`_op_region`) becomes one `[collapse_as]` line at the
    first of its nodes that is not dropped (AOT graphs)."""
    region = _op_region(gm) if collapse_as is not None else set()
    out, collapsed = [], False
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        token = _token(node)
        if _bare(token) in DROPPED:
            continue
        if node in region:
            if not collapsed:
                out.append(f"[{collapse_as}]")
                collapsed = True
            continue
        out.append(token)
    return "\n".join(out)


def _inputs(device="cpu"):
    out = make_inputs(B=2, T=5, H=16, V=37, device=device)
    return out


CONFIGS = {
    "dapo": cg.GRPOConfig(gradient_mode="recompute"),
    "grpo_beta_sequence": cg.GRPOConfig(loss_type="grpo", beta=0.04, importance_sampling_level="sequence",
                                        gradient_mode="recompute"),
    "with_entropy": cg.GRPOConfig(metrics="with_entropy", gradient_mode="recompute"),
}


def dynamo_sequence(cfg, device="cpu"):
    torch._dynamo.reset()
    rec = EagerAndRecordGraphs()
    torch.compile(cg.grpo_loss, backend=rec, fullgraph=True)(**_inputs(device), config=cfg)
    assert len(rec.graphs) == 1
    return op_sequence(rec.graphs[0])


def aot_sequences(cfg, device="cpu"):
    torch._dynamo.reset()
    rec = AotEagerAndRecordGraphs()
    out = torch.compile(cg.grpo_loss, backend=rec, fullgraph=True)(**_inputs(device), config=cfg)
    out.loss.backward()
    assert len(rec.fw_graphs) == 1 and len(rec.bw_graphs) == 1
    return (op_sequence(rec.fw_graphs[0], "compiled_grpo.linear_logprobs"),
            op_sequence(rec.bw_graphs[0], "compiled_grpo.linear_logprobs_backward"))


# The snapshots are written by the torch of CI's first leg (the README's test command). torch 2.15's
# AOT graphs differ in ways that are torch's, not the project's: clamp's backward masks its input
# with gt / lt where 2.13 has ge / le, the min-cut partitioner moves that mask (and recomputes a
# sum and an exp) between the forward and the backward graph, and the backward's scheduler orders
# a div and a lt differently. On another torch a sequence passes when it holds no op kind beyond
# its snapshot's and those moved ones: a new kind of op (a GEMM, a log_softmax: the [N, V] logits
# back) still fails on every torch; the Dynamo sequences compare exactly.
SNAPSHOT_TORCH = "2.13"
MOVED_BY_PARTITIONER = {"aten.ge", "aten.le", "aten.gt", "aten.lt", "aten.logical_and", "aten.sum",
                        "aten.exp"}



class SnapshotCase:
    """A mixin for expecttest.TestCase: assertExpectedInline as written on SNAPSHOT_TORCH (where
    EXPECTTEST_ACCEPT=1 rewrites the literals), no new op kind on any other torch."""

    def assertExpectedInline(self, actual, expect, *args, **kwargs):
        if release(torch.__version__) == SNAPSHOT_TORCH or os.environ.get("EXPECTTEST_ACCEPT") \
                or not actual.startswith("aten."):
            return super().assertExpectedInline(actual, expect, *args, **kwargs)
        new = set(actual.splitlines()) - set(expect.splitlines()) - MOVED_BY_PARTITIONER
        self.assertEqual(new, set(), f"op kinds not in the torch {SNAPSHOT_TORCH} snapshot")
