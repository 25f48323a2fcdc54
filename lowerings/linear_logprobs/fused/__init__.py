"""The fused-gradient path (grpo_loss's default on CUDA): the logits once, the loss's per-token
gradient applied in place. schedule.py runs the row blocks, order.py picks each block's rows,
steps.py holds the two block steps as mutable custom ops, blocks.py their CUDA bodies."""
