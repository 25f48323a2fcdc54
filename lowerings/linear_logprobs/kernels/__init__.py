"""Triton and Gluon kernels of `compiled_grpo::linear_logprobs`, by what each computes:

- logits.py       the logits tile (GEMM + scale / cap), the forward's online statistics, the
                  recompute dlogits pass
- rows.py         the row-masked paths' row gather and the recompute backward's dX step
- combine.py      the merge of the forward's vocab splits (every path's: batch invariance)
- dw.py           the dW steps (dW (+)= dlogits.T @ X): per tile and persistent
- dw_gluon.py     the dW step as a warp-specialized Gluon kernel (sm_90)
- fused_block.py  the fused-gradient block steps: in-place dlogits, dX split, exp-scaling, ...
- splits.py       the dX steps' split over V (both paths'): its count, the partials' ordered sum
- tiles.py        the shared tile addressing, and the arguments no kernel specializes on
- writes.py       the `writes` declaration of each kernel's written pointers (launching/traced.py)

The launchers (recompute/dense.py, recompute/rows.py, fused/blocks.py) import from here; no kernel imports a
launcher.
"""
