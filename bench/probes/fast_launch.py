"""fast_launch on and off (lowerings/linear_logprobs/launching/fast.py): the fused path's gradients
bitwise the same, and the eager step's time where the host is the limit.

    python -m bench.probes.fast_launch [--shape qwen2.5-0.5b] [--rounds 2]

First grpo_loss's fused grads (tests/test_fused_gpu.py's inputs at H = 896 and 4096, a 100 MiB
workspace: 3 row blocks, two calls each so that every launch of the second takes the launcher
when on) with fast_launch.ENABLED on, off, on: bitwise equal. Then `bench.kernels.fused --shape
SHAPE --targets sampled` with it on and off, alternating, `--rounds` times
(bench/results/fast_launch_h100_a7362fa.txt). CUDA only.
"""
import argparse
import os
import sys

import torch

import lowerings.linear_logprobs.launching.fast as fl


def grads_equal() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from test_fused_gpu import _fused_grads, _gpu_inputs
    for hd in (896, 4096):
        inp = _gpu_inputs(Hd=hd)
        grads = [_fused_grads(inp, on) for on in (True, False, True)]
        same = [all(torch.equal(a, b) for a, b in zip(grads[i], grads[1])) for i in (0, 2)]
        print(f"H {hd} launches cached: {sum(len(x.compiled) for x in fl._LAUNCHERS.values())} "
              f"bitwise on == off: {same[0]} {same[1]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    grads_equal()
    import bench.kernels.fused as bf
    for _ in range(a.rounds):
        for on in (True, False):
            fl.ENABLED = on
            print(f"=== fast_launch.ENABLED={on}", flush=True)
            sys.argv = ["bench.kernels.fused", "--shape", a.shape, "--targets", "sampled"]
            bf.main()
    fl.ENABLED = True


if __name__ == "__main__":
    main()
