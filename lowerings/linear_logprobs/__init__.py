"""`compiled_grpo::linear_logprobs`: per-token log-probs, entropy and lse of a linear head without
the [N, V] logits. Every module, by layer (start at op.py; each module's docstring says why):

  the op and its autograd
    op.py              the triton_op pair, its autograd and the public `linear_logprobs`
    extrema.py         `linear_logits_extrema`: each row's min / max logit (the pass's logits
                       metrics), one forward GEMM in vocab chunks, every device
  the CPU body (every non-CUDA device)
    cpu.py             the chunked pure-PyTorch forward and backward
  the recompute path on CUDA (the composable op: logits recomputed in the backward)
    recompute/dense.py the launchers: the forward, the row-grouped backward loop
    recompute/rows.py  the row-masked variant: padding skipped on the device, no host sync
    recompute/plan.py  the forward's vocab splits, the row groups and vocab chunks (fixed by the
                       head and the device, never by the batch: batch invariance)
    recompute/gemms.py the backward's cuBLAS GEMM steps as mutable custom ops
    recompute/dw_steps.py  the dW step's launcher, shared with the fused path (Gluon on sm_90)
  the fused-gradient path on CUDA (grpo_loss's default: logits once, the loss's gradient in place)
    fused/schedule.py  the schedule: row blocks, the caller's per-token gradient, dX / dW
    fused/plan.py      how many blocks of how many rows: the workspace budget, dX waves
    fused/order.py     which rows each block takes, valid rows first, as device tensors
    fused/steps.py     the two block steps as mutable custom ops, and the gradient scaling
    fused/blocks.py    the steps' CUDA bodies: the Triton launches of a block
  kernels
    kernels/           the @triton.jit and Gluon kernels, a module by what each computes
  the launch machinery
    launching/traced.py    traced launches with declared writes (custom ops under torch.compile)
    launching/fast.py      eager launches through the compiled launcher, past Triton's binding
    launching/precompile.py  the fused path's kernels compiled in worker processes while a
                           trace runs
    launching/precompile_worker.py  the worker script (triton alone, no torch)
    launching/triton_compat.py  the Triton releases checked and every Triton internal used
  shared
    tuning.py          the tile tables, workspace budgets and TMA switches both CUDA paths read
                       (at call time: tuning runs and the interpreter tests set them here)
    device.py          host integer helpers and device facts, no triton import
The per-kernel benchmarks and the sm_90 build check are in bench/kernels/. No module imports one
that imports it back (tests/test_layout.py).
"""
from lowerings.linear_logprobs.op import (LinearLogprobs, _linear_logprobs_backward_op,
                                          _linear_logprobs_op, linear_logprobs)

__all__ = ["LinearLogprobs", "linear_logprobs"]
