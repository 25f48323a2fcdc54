"""The recompute path on CUDA: the composable op's forward and backward, the logits recomputed in
the backward a (row group, vocab chunk) step at a time. dense.py launches for all rows, rows.py
for the valid rows of a row mask (padding skipped on the device), plan.py fixes the splits,
groups and chunks from the head and the device (never the batch), gemms.py and dw_steps.py are
the backward's GEMM steps (dw_steps is shared with the fused path)."""
