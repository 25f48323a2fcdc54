"""What a Triton kernel writes, read from its TTIR: the CPU guard of tests/test_cuda_trace.py.

torch's own analysis (torch/_higher_order_ops/triton_kernel_wrap.py) lists a fixed set of write
ops and reads anything else as no write: a bulk reduce-add (`tt.descriptor_reduce`) went unseen
and Inductor dropped the dW launches that held it (lowerings/linear_logprobs/launching/traced.py). This scan
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
    parameter by name: fake or real tensors, ints / SymInts, constexprs); a Gluon kernel's
    through gluon_written_params."""
    from triton.experimental.gluon._runtime import GluonJITFunction
    if isinstance(kernel, GluonJITFunction):
        return gluon_written_params(kernel, kwargs)
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

    from lowerings.linear_logprobs.launching.traced import writes
    from lowerings.linear_logprobs.launching.triton_compat import tma_load, tma_store

    @writes()
    @triton.jit
    def reduce_only_kernel(out_ptr, src_ptr, n):
        dst = tl.make_tensor_descriptor(out_ptr, shape=[n, 64], strides=[64, 1], block_shape=[16, 64])
        src = tl.make_tensor_descriptor(src_ptr, shape=[n, 64], strides=[64, 1], block_shape=[16, 64])
        dst.atomic_add([0, 0], src.load([0, 0]))
    return reduce_only_kernel


# --- Gluon kernels -------------------------------------------------------------------------------
# torch's TTIR reader cannot read a Gluon kernel (its warp_specialize partitions are regions it
# does not know), so the guard follows the values itself over the kernel's TTGIR (the IR Gluon
# kernels start from): every value back from the destination operand of each global write to the
# kernel parameters it comes from, across calls, loops and the warp_specialize captures.
# ops that write global memory through their first operand (a descriptor or a pointer)
GLUON_WRITE_OPS = {"ttng.async_tma_copy_local_to_global", "ttng.async_tma_reduce",
                   "ttng.async_tma_scatter", "tt.store", "tt.atomic_rmw", "tt.atomic_cas",
                   "tt.descriptor_store", "tt.descriptor_reduce", "tt.descriptor_scatter"}
# write-like ops that only touch shared memory, barriers or registers
GLUON_LOCAL_OPS = {"ttg.local_store", "ttng.async_tma_store_wait", "ttng.async_tma_copy_global_to_local",
                   "tt.reduce", "tt.reduce.return"}
# values read from memory come from no parameter
GLUON_LOADS = {"tt.load", "ttg.local_load", "tt.descriptor_load"}


def gluon_written_params(kernel, kwargs: dict) -> set[str]:
    """ttir_written_params for a Gluon kernel (gluon.jit): its IR built as torch's generate_ttir
    builds a Triton kernel's, through Gluon's AST source."""
    import triton.compiler.compiler as tcc
    from triton.experimental.gluon._runtime import GluonASTSource

    real = tcc.ASTSource
    tcc.ASTSource = GluonASTSource   # generate_ttir imports it from there at each call
    try:
        module, names = generate_ttir(kernel, dict(kwargs), {})
    finally:
        tcc.ASTSource = real
    ops, blocks, funcs = [], {}, {}

    def visit(op):
        name = op.get_name()
        if name == "builtin.module":
            return
        block = op.get_block()
        if block is not None and block.id() not in blocks:
            region = block.get_parent()
            blocks[block.id()] = ([block.get_argument(i).id() for i in range(block.get_num_arguments())],
                                  region.id() if region is not None else None)
        rec = dict(name=name, operands=[op.get_operand(i).id() for i in range(op.get_num_operands())],
                   results=[op.get_result(i).id() for i in range(op.get_num_results())],
                   regions=[op.get_region(i).id() for i in range(op.get_num_regions())],
                   block=block.id() if block is not None else None,
                   callee=op.get_flat_symbol_ref_attr("callee") if name == "tt.call" else None)
        if name == "tt.func":
            rec["sym"] = op.get_str_attr("sym_name")
        ops.append(rec)

    module.walk(visit)
    region_blocks: dict = {}
    for bid, (_, rid) in blocks.items():
        region_blocks.setdefault(rid, []).append(bid)
    owner = {rid: rec for rec in ops for rid in rec["regions"]}
    # where each value comes from: value id -> value ids (or ("param", i) of the kernel)
    sources: dict = {}
    calls: dict = {}
    for rec in ops:
        if rec["name"] == "tt.call":
            calls.setdefault(rec["callee"], []).append(rec)
    returns: dict = {}
    for rec in ops:
        for rid in rec["regions"]:
            for k, bid in enumerate(region_blocks.get(rid, ())):
                args = blocks[bid][0]
                name = rec["name"]
                if name == "tt.func" and k == 0:   # the entry block's arguments: the parameters
                    funcs[rec["sym"]] = args
                elif name == "scf.for":
                    for i, a in enumerate(args):   # (iv, iter args) <- (lb, ub, step, inits)
                        sources[a] = rec["operands"][:3] if i == 0 else [rec["operands"][i + 2]]
                elif name in ("scf.while",) or name == "ttg.warp_specialize.partitions":
                    pass   # resolved below (while: operands; partitions: the captures)
                elif args:
                    for a in args:
                        sources[a] = ["unknown"]
    for rec in ops:
        if rec["name"] == "ttg.warp_specialize":
            # the partitions op sits in one of its regions; its regions' arguments are the
            # captures: the warp_specialize op's operands through Triton 3.6, the partitions
            # op's own from 3.7 (the warp_specialize op has none there)
            for rid in rec["regions"]:
                for bid in region_blocks.get(rid, ()):
                    for inner in ops:
                        if inner["name"] == "ttg.warp_specialize.partitions" and inner["block"] == bid:
                            captures = rec["operands"] or inner["operands"]
                            for prid in inner["regions"]:
                                for pbid in region_blocks.get(prid, ()):
                                    for i, a in enumerate(blocks[pbid][0]):
                                        sources[a] = [captures[i]]
        if rec["name"] == "scf.while":
            for rid in rec["regions"]:
                for bid in region_blocks.get(rid, ()):
                    for i, a in enumerate(blocks[bid][0]):
                        sources[a] = [rec["operands"][i]] if i < len(rec["operands"]) else ["unknown"]
    kernel_fn = next(rec["sym"] for rec in ops if rec["name"] == "tt.func"
                     and rec["sym"] == kernel.fn.__name__)
    for sym, args in funcs.items():
        for i, a in enumerate(args):
            if sym == kernel_fn:
                sources[a] = [("param", i)]
            else:   # every call site's argument i
                sources[a] = [c["operands"][i] for c in calls.get(sym, ())]
    for rec in ops:   # what the scf ops' regions hand to their results
        if rec["name"] == "scf.yield":
            returns.setdefault(rec["block"], []).append(rec)
    fn_of_block = {}
    for rec in ops:
        if rec["name"] == "tt.func":
            for rid in rec["regions"]:
                for bid in region_blocks.get(rid, ()):
                    fn_of_block[bid] = rec["sym"]
    fn_returns: dict = {}
    for rec in ops:
        if rec["name"] == "tt.return":
            # the function whose body holds this return (walk up the blocks' owners)
            bid = rec["block"]
            while bid not in fn_of_block:
                bid = owner[blocks[bid][1]]["block"]
            fn_returns.setdefault(fn_of_block[bid], []).append(rec)
    for rec in ops:
        name = rec["name"]
        if name in GLUON_LOADS:
            for r in rec["results"]:
                sources[r] = []
        elif name == "tt.call":
            for j, r in enumerate(rec["results"]):
                sources[r] = [ret["operands"][j] for ret in fn_returns.get(rec["callee"], ())]
        elif rec["regions"] and rec["results"]:   # scf.for / scf.if / scf.while results
            ys = [y for rid in rec["regions"] for bid in region_blocks.get(rid, ())
                  for y in returns.get(bid, ())]
            for j, r in enumerate(rec["results"]):
                init = [rec["operands"][j + 3]] if name == "scf.for" else []
                sources[r] = init + [y["operands"][j] for y in ys if j < len(y["operands"])]
        else:
            for r in rec["results"]:
                sources[r] = list(rec["operands"])
    targets = []
    for rec in ops:
        if rec["name"] in GLUON_WRITE_OPS:
            targets.append(rec["operands"][0])
        elif WRITE_LIKE.search(rec["name"]) and rec["name"] not in GLUON_LOCAL_OPS:
            raise AssertionError(f"{kernel_fn}: unknown write-like op {rec['name']}: add it to "
                                 f"GLUON_WRITE_OPS or GLUON_LOCAL_OPS")
    params, seen, stack = set(), set(), list(targets)
    while stack:
        v = stack.pop()
        if isinstance(v, tuple):
            params.add(v[1])
            continue
        if v == "unknown":
            raise AssertionError(f"{kernel_fn}: a write's destination comes through a block "
                                 f"argument this scan does not follow")
        if v in seen:
            continue
        seen.add(v)
        stack.extend(sources.get(v, ()))
    return {names[i] for i in params
            if i < len(names) and hasattr(kwargs.get(names[i]), "data_ptr")}


def _gluon_toy_kernel():
    """A Gluon kernel whose only global write is a TMA store through a descriptor of out_ptr
    (src_ptr is only read), declaring no write: the guard must fail it."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from lowerings.linear_logprobs.launching.traced import writes
    from lowerings.linear_logprobs.launching.triton_compat import tma_load, tma_store

    @writes()
    @gluon.jit
    def copy_only_kernel(out_ptr, src_ptr, n):
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
        src = tma.make_tensor_descriptor(src_ptr, [n, 64], [64, 1], [16, 64], layout)
        dst = tma.make_tensor_descriptor(out_ptr, [n, 64], [64, 1], [16, 64], layout)
        buf = gl.allocate_shared_memory(gl.bfloat16, [16, 64], layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, src.block_type.nbytes)
        tma_load(src, [0, 0], bar, buf)
        mbarrier.wait(bar, 0)
        fence_async_shared()
        tma_store(dst, [0, 0], buf)
        tma.store_wait(0)
    return copy_only_kernel
