"""Drop-in integrations with RL trainers. Each submodule imports its trainer library on import.

``compiled_grpo.integrations.trl.GRPOTrainer``: TRL 1.16's ``trl.GRPOTrainer`` with the log-probs
and the loss computed by compiled_grpo (``pip install -e ".[trl]"``).
"""
