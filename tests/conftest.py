"""Test-session setup shared by every module.

Triton reads TRITON_INTERPRET once, when it is first imported (importing compiled_grpo imports
it). On a machine without CUDA, set it before any test module imports triton so the kernel tests
(test_linear_logprobs_interpret.py, test_fused_interpret.py; their setting: interpret.py) run in
the interpreter whatever the collection order. It does not affect the CPU branch of the op or
Inductor's CPU code, which never launch Triton.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The slowest tests of a cold 2-core CI run (`--durations`, 2026-11-27: 30-160 s each), longest
# first, run before the rest. pytest-xdist's load scheduling hands the first quarter of the
# collection out round-robin, so these start at once on both workers and the short tests fill
# in behind them; in collection order one of them could start last and run alone while the other
# worker sat idle (a long tail of up to its whole time). Node ids without the parameters.
RUN_FIRST = (
    "tests/test_distributed_scripts.py::test_gloo_tp_bench_cpu_tiny",
    "tests/test_batch_invariance.py::test_rows_bitwise_independent_of_the_batch",
    "tests/test_fused_modes.py::test_compiled_block_counts_step_so_dynamic_sizes_rarely_recompile",
    "tests/test_distributed.py::test_gloo_tp",
    "tests/test_fused_packed.py::test_packed_sequence_losses_fused_compile",
    "tests/test_fused.py::test_compile_fullgraph_dynamic",
    "tests/test_inductor_code.py::test_no_tokens_by_vocab_buffer_forward_or_backward",
    "tests/test_memory_cpu.py::test_peak_beyond_inputs_and_grads_within_the_documented_bound",
    "tests/test_cpu_row_groups.py::test_compile_dynamic_n_smaller_and_larger_than_traced",
    "tests/test_memory_cpu.py::test_fused_workspace_budget_is_what_the_fused_mode_holds",
    "tests/test_bench.py::test_valid_token_peers_and_packed_twin",
    "tests/test_packed.py::test_compile_once_for_many_packings_whole_sequence_blocks",
    "tests/test_aot_hopper.py::test_kernels_compile_for_sm90",
    "tests/test_bench_e2e.py::test_e2e_pass_providers_fuse_on_cpu",
    "tests/test_naive_fusion_trainers.py::test_trl_trainer_head_dynamic_shapes",
    "tests/test_cuda_trace.py::test_cuda_rows_backward_trace_in_place_and_symbolic_n",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(rank)))   # stable
