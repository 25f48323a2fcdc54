"""TRL's log-prob / entropy Triton kernel as a consumer of the logits (match._match_consumers):
its autograd.Function call recognized in a Dynamo graph, so the pass replaces it like any other
log-prob spelling."""
from typing import Optional

import torch
from torch.fx import Node

from lowerings.naive_fusion.nodes import _number


# TRL >= 1.16 on CUDA: selective_log_softmax / entropy_from_logits / selective_log_softmax_and_entropy
# run trl.kernels.logprob_entropy's autograd.Function, which Dynamo records as one
# autograd_function_apply whose forward body launches its Triton _forward_kernel: (logprobs,
# entropy) [...] fp32 of logits / TEMPERATURE, the same quantities as the op's.
_TRL_KERNEL = ("trl.kernels.logprob_entropy", "_forward_kernel")


def trl_kernel_call(u: Node) -> Optional[dict]:
    """{logits, ids, temperature} of TRL's logprob / entropy kernel call `u` (an
    autograd_function_apply node), or None: another function, a row mask, or a layout the
    rewrite does not know."""
    if not (u.op == "call_function" and u.target is torch.ops.higher_order.autograd_function_apply):
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    body = u.args[0]
    gm = getattr(body.graph.owning_module, body.target, None) if body.op == "get_attr" else None
    if gm is None:
        return None
    launches = [n for n in gm.graph.nodes
                if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation]
    if len(launches) != 1:
        return None
    kernel = kernel_side_table.get_kernel(launches[0].kwargs["kernel_idx"])
    fn = getattr(kernel, "fn", None)
    if (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) != _TRL_KERNEL:
        return None
    const = kernel_side_table.get_constant_args(launches[0].kwargs["constant_args_idx"])
    temperature = const.get("TEMPERATURE")
    if const.get("HAS_MASK", True) or not _number(temperature) or not temperature > 0:
        return None
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    operands = dict(zip(places, u.args[2:]))      # the body's inputs: the apply's operands
    kw = launches[0].kwargs["kwargs"]
    logits, ids = operands.get(kw.get("logits_ptr")), operands.get(kw.get("index_ptr"))
    if logits is None or ids is None:
        return None
    return dict(logits=logits, ids=ids, temperature=float(temperature))
