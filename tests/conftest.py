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
