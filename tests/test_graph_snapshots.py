"""What `grpo_loss` lowers to, as op sequences (STYLE.md item 8): read these as documentation.

Regenerate after an intended change with
    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_graph_snapshots.py \
        tests/test_graph_snapshots_entropy.py

Three configurations on tiny fixed shapes (B=2, T=5, H=16, V=37): the default dapo loss; grpo with
a k3 KL penalty (beta) and sequence-level importance sampling (GSPO); dapo with the with_entropy
metrics (that one in test_graph_snapshots_entropy.py; the helpers are in graph_sequences.py).
For each: the Dynamo graph (`EagerAndRecordGraphs`), where the fused op is ONE node
`compiled_grpo.linear_logprobs`, and the AOTAutograd forward and backward graphs
(`AotEagerAndRecordGraphs().fw_graphs / .bw_graphs`).

In AOT graphs the triton_op is decomposed, which is device dependent (torch ops of the chunked body
on CPU, Triton-kernel higher-order ops on CUDA). `op_sequence` collapses those nodes back into one
`[compiled_grpo.linear_logprobs]` / `[compiled_grpo.linear_logprobs_backward]` token, so the
snapshots show the loss math around the op and read the same on every device; the CUDA test below
checks that the CPU and CUDA sequences agree. The configs pin gradient_mode="recompute" (the
composable op these graphs document); the default fused-gradient mode is tested in test_fused.py.
"""
import unittest

import pytest
import torch

from graph_sequences import CONFIGS, SnapshotCase, aot_sequences, dynamo_sequence

expecttest = pytest.importorskip("expecttest")  # a test extra; absent from the GPU images unless carried


class GraphSnapshots(SnapshotCase, expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_dapo_dynamo(self):
        self.assertExpectedInline(dynamo_sequence(CONFIGS["dapo"]), """\
torch.where
torch.where
.sum
.sum
.clamp
truediv
torch.where
.amax
torch.where
.amin
ge
lt
and_
invert
or_
.all
torch._assert_async
torch.where
.clamp
compiled_grpo.linear_logprobs
torch.where
sub
torch.where
.clamp
torch.exp
mul
.clamp
mul
torch.min
neg
lt
lt
and_
gt
gt
and_
torch.where
torch.where
.sum
torch.ones
.sum
.clamp
truediv""")

    def test_dapo_aot(self):
        fw, bw = aot_sequences(CONFIGS["dapo"])
        self.assertExpectedInline(fw, """\
aten.where
aten.ge
aten.lt
aten.bitwise_and
aten.bitwise_not
aten.bitwise_or
aten.all
aten._assert_async
[compiled_grpo.linear_logprobs]
aten.where
aten.sub
aten.where
aten.clamp
aten.exp
aten.mul
aten.clamp
aten.mul
aten.minimum
aten.neg
aten.where
aten.where
aten.sum
aten.sum
aten.clamp
aten.div
aten.ge
aten.le
aten.logical_and""")
        self.assertExpectedInline(bw, """\
aten.sum
aten.clamp
aten.div
aten.where
aten.add
aten.where
aten.neg
aten.div
aten.where
aten.mul
aten.clamp
aten.mul
aten.eq
aten.where
aten.lt
aten.masked_fill
aten.gt
aten.masked_fill
aten.mul
aten.ge
aten.le
aten.logical_and
aten.where
aten.mul
aten.add
aten.mul
aten.where
aten.where
aten.where
[compiled_grpo.linear_logprobs_backward]""")

    def test_grpo_beta_sequence_dynamo(self):
        self.assertExpectedInline(dynamo_sequence(CONFIGS["grpo_beta_sequence"]), """\
torch.where
torch.where
.sum
.sum
.clamp
truediv
torch.where
.amax
torch.where
.amin
ge
lt
and_
invert
or_
.all
torch._assert_async
torch.where
.clamp
compiled_grpo.linear_logprobs
torch.where
sub
torch.where
.sum
.clamp
.sum
truediv
.clamp
.clamp
torch.exp
mul
.clamp
mul
torch.min
neg
lt
lt
and_
gt
gt
and_
sub
torch.where
.clamp
torch.exp
sub
sub
.clamp
mul
add
torch.where
torch.where
.sum
.clamp
.sum
truediv
.sum
torch.ones
mul
truediv""")

    def test_grpo_beta_sequence_aot(self):
        fw, bw = aot_sequences(CONFIGS["grpo_beta_sequence"])
        self.assertExpectedInline(fw, """\
aten.where
aten.ge
aten.lt
aten.bitwise_and
aten.bitwise_not
aten.bitwise_or
aten.all
aten._assert_async
[compiled_grpo.linear_logprobs]
aten.where
aten.sub
aten.where
aten.sum
aten.clamp
aten.sum
aten.div
aten.clamp
aten.exp
aten.mul
aten.clamp
aten.mul
aten.minimum
aten.neg
aten.sub
aten.where
aten.clamp
aten.exp
aten.sub
aten.sub
aten.clamp
aten.mul
aten.add
aten.where
aten.where
aten.sum
aten.clamp
aten.sum
aten.div
aten.sum
aten.ones
aten.mul
aten.div
aten.ge
aten.le
aten.logical_and
aten.ge
aten.le
aten.logical_and
aten.ge
aten.le
aten.logical_and""")
        self.assertExpectedInline(bw, """\
aten.ones
aten.mul
aten.div
aten.sum
aten.clamp
aten.div
aten.where
aten.add
aten.where
aten.mul
aten.where
aten.neg
aten.mul
aten.add
aten.where
aten.where
aten.neg
aten.neg
aten.div
aten.where
aten.mul
aten.clamp
aten.mul
aten.eq
aten.where
aten.lt
aten.masked_fill
aten.gt
aten.masked_fill
aten.mul
aten.sum
aten.ge
aten.le
aten.logical_and
aten.where
aten.mul
aten.sum
aten.add
aten.mul
aten.where
aten.sum
aten.clamp
aten.div
aten.where
aten.add
aten.where
[compiled_grpo.linear_logprobs_backward]""")

    @pytest.mark.gpu
    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA: compares the CUDA sequences with CPU")
    def test_sequences_are_device_independent(self):
        for name, cfg in CONFIGS.items():
            self.maxDiff = None
            self.assertEqual(dynamo_sequence(cfg, "cuda"), dynamo_sequence(cfg, "cpu"), name)
            cuda_fw, cuda_bw = aot_sequences(cfg, "cuda")
            cpu_fw, cpu_bw = aot_sequences(cfg, "cpu")
            self.assertEqual(cuda_fw, cpu_fw, f"{name} forward")
            self.assertEqual(cuda_bw, cpu_bw, f"{name} backward")
