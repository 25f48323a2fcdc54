"""What a Triton kernel writes, read from its TTIR: the CPU guard of tests/test_cuda_trace.py.

torch's own analysis (torch/_higher_order_ops/triton_kernel_wrap.py) lists a fixed set of write
ops and reads anything else as no write: a bulk reduce-add (`tt.descriptor_reduce`) went unseen
and Inductor dropped the dW launches that held it (lowerings/linear_logprobs/launch.py). This scan
uses torch's TTIR parser (generate_ttir, ttir_to_functions) but fails on any op that looks like a
memory write it does not know, so a new write op breaks the test instead of passing silently.
"""
import re

from torch._higher_order_ops.triton_kernel_wrap import (Intermediate, Param, generate_ttir,
                                                        ttir_to_functions)

# ops whose first operand is the pointer / descriptor they write through (Triton's MemWrite ops)
WRITE_OPS = {"tt.store", "tt.atomic_cas", "tt.atomic_rmw", "tt.descriptor_store",
             "tt.descriptor_reduce", "tt.descriptor_scatter", "tt.experimental_descriptor_store"}
# any other op named like a write is unknown: fail rather than read it as none
WRITE_LIKE = re.compile(r"store|atomic|scatter|descriptor_reduce|tensormap|inline_asm")


def _result_index(ops: dict, res: Intermediate, op) -> int:
    """Which result of its tt.call `res` is: a call's results have consecutive ids, each listed
    with an Op of the same callee and arguments (ttir_to_functions)."""
    i = 0
    while any(o.name == op.name and o.fn_call_name == op.fn_call_name and o.args == op.args
              for o in ops.get(Intermediate(res.idx - i - 1), ())):
        i += 1
    return i


def _returned(functions: dict, fn_name: str, index: int, memo: dict) -> set[int]:
    """Parameter positions of `fn_name` whose values flow (not through a load) into its
    `index`-th return value."""
    key = (fn_name, index)
    if key not in memo:
        memo[key] = set()       # a recursive call adds nothing new
        rets = [op.args[index] for op_list in functions[fn_name].values() for op in op_list
                if op.name == "tt.return" and len(op.args) > index]
        memo[key] = _sources(functions, fn_name, rets, memo)
    return memo[key]


def _sources(functions: dict, fn_name: str, values: list, memo: dict) -> set[int]:
    """Parameter positions of `fn_name` whose values flow into `values` (not through a load: a
    pointer read from memory is no parameter's); a call's result follows only what its callee
    returns there, so a descriptor built from one pointer does not implicate the others."""
    ops = functions[fn_name]
    out: set[int] = set()
    seen = set()
    stack = list(values)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if isinstance(v, Param):
            out.add(v.idx)
            continue
        if v.fake():
            continue
        for op in ops.get(v, ()):
            if op.name == "tt.load":
                continue
            if op.name == "tt.call":
                idx = _result_index(ops, v, op)
                stack.extend(op.args[p] for p in _returned(functions, op.fn_call_name, idx, memo))
            else:
                stack.extend(op.args)
    return out


def _written_positions(functions: dict, fn_name: str, seen: dict, memo: dict) -> set[int]:
    """Parameter positions of `fn_name` that some write op writes through."""
    if fn_name in seen:
        return seen[fn_name]
    seen[fn_name] = set()
    targets = []
    for op_list in functions[fn_name].values():
        for op in op_list:
            if op.name == "tt.call":
                callee = _written_positions(functions, op.fn_call_name, seen, memo)
                targets.extend(op.args[i] for i in callee)
            elif op.name in WRITE_OPS:
                targets.append(op.args[0])
            elif WRITE_LIKE.search(op.name) and not op.is_pure:
                raise AssertionError(f"{fn_name}: unknown write-like op {op.name}: add it to WRITE_OPS")
    seen[fn_name] = _sources(functions, fn_name, targets, memo)
    return seen[fn_name]


def ttir_written_params(kernel, kwargs: dict) -> set[str]:
    """The tensor parameters of `kernel` that its TTIR writes at a launch with `kwargs` (every
    parameter by name: fake or real tensors, ints / SymInts, constexprs)."""
    module, names = generate_ttir(kernel, dict(kwargs), {})
    functions = ttir_to_functions(module)
    kernel_fn = next(iter(functions))
    positions = _written_positions(functions, kernel_fn, {}, {})
    return {names[i] for i in positions
            if i < len(names) and hasattr(kwargs.get(names[i]), "data_ptr")}


def _toy_kernel():
    """A kernel whose only write is a bulk reduce-add through a tensor descriptor, declaring no
    write: what the guard must fail (test_cuda_trace.test_guard_sees_descriptor_writes)."""
    import triton
    import triton.language as tl

    from lowerings.linear_logprobs.launch import writes

    @writes()
    @triton.jit
    def reduce_only_kernel(out_ptr, src_ptr, n):
        dst = tl.make_tensor_descriptor(out_ptr, shape=[n, 64], strides=[64, 1], block_shape=[16, 64])
        src = tl.make_tensor_descriptor(src_ptr, shape=[n, 64], strides=[64, 1], block_shape=[16, 64])
        dst.atomic_add([0, 0], src.load([0, 0]))
    return reduce_only_kernel
