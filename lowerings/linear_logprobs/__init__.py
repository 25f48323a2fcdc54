"""`compiled_grpo::linear_logprobs`: per-token log-probs, entropy and lse of a linear head without
the [N, V] logits.

    op.py      the triton_op pair, its autograd and the public `linear_logprobs` (start here)
    cuda.py    CUDA launchers: the forward and the row-grouped backward loop
    split_plan.py  the forward's vocab splits and the fused blocks' rows, fixed by the head
    kernels/   the @triton.jit and Gluon kernels, a module by what each computes (its __init__)
    gemms.py   the backward's GEMM steps as mutable custom ops (in-place under torch.compile)
    cpu.py     the chunked pure-PyTorch body of every other device
    cuda_rows.py  the row-masked CUDA path (padding skipped on the device)
    fused.py, fused_steps.py, fused_cuda.py  the fused-gradient schedule (grpo_loss's default
               on CUDA), its two block steps as custom ops, their Triton body: logits once, the
               caller's per-token gradient, dlogits in place, dX / dW
    launch.py  the recompute op's Triton launches with declared writes (custom ops when traced)
The per-kernel benchmarks and the sm_90 build check are in bench/kernels/.
"""
from lowerings.linear_logprobs.op import (LinearLogprobs, _linear_logprobs_backward_op,
                                          _linear_logprobs_op, linear_logprobs)

__all__ = ["LinearLogprobs", "linear_logprobs"]
