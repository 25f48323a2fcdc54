"""Run under torchrun (2+ processes, gloo on CPU or NCCL on GPUs): stock trl.GRPOTrainer and
compiled_grpo's drop-in each train the test model for 3 steps on the same seed, every process
taking its share of each batch (accelerate's multi-process data parallel); rank 0 compares every
logged metric step by step (tests/trl_harness.py's assert_same_logs) and prints
"TRL MULTIPROCESS: PASS". Used by test_trl_integration.py::test_two_processes_parity_with_trl.

    OUTDIR=<dir> torchrun --standalone --nproc_per_node 2 tests/trl_multiprocess.py [--bf16] [--cuda]
        [--lr LR] [--temperature T] [--trl-vs-trl]

--cuda: one GPU a process (accelerate's NCCL process group, use_cpu=False), the drop-in on its CUDA
kernels against TRL's own head on cuBLAS (bf16 too: within 2e-4, as on CPU; 1.7e-7 measured on
2 x H200, bench/results/trl_dropin_2gpu_h200x4_4ff4024.txt).
--lr, --temperature: another learning rate (default: the test's 3e-2) or sampling temperature (1.0). --trl-vs-trl: stock TRL against stock TRL
whose logits products are summed in another order (_addmm_ieee), in place of the drop-in.
"""
import os
import pathlib
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import pytest  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402

import trl_harness as t  # noqa: E402
from trl.kernels import chunked_logprob  # noqa: E402
from compiled_grpo.integrations.trl import GRPOTrainer  # noqa: E402



def _addmm_ieee(acc, a, b):
    """TRL's logits tile product in IEEE fp32 (cuBLAS SGEMM, TF32 off) instead of its bf16 tensor
    core GEMM: every product of two bf16 values is exact in fp32, so only the summation order over
    H differs. --trl-vs-trl runs stock TRL against itself with this: the spread the bf16 recipe has
    with no other change (the floor under the drop-in's difference)."""
    assert not torch.backends.cuda.matmul.allow_tf32
    acc.addmm_(a.float(), b.float())


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = pathlib.Path(os.environ["OUTDIR"])
    model = out / "model"
    if rank == 0:   # one saved random model, read by every process
        t.save_model(model)
        (out / "ready").touch()
    while not (out / "ready").exists():
        time.sleep(0.1)
    overrides = dict(per_device_train_batch_size=8 // world, bf16="--bf16" in sys.argv,
                     use_cpu="--cuda" not in sys.argv)
    for flag, key in (("--lr", "learning_rate"), ("--temperature", "temperature")):
        if flag in sys.argv:
            overrides[key] = float(sys.argv[sys.argv.index(flag) + 1])
    ref = t.train(trl.GRPOTrainer, str(model), out / "trl", **overrides)
    if "--trl-vs-trl" in sys.argv:   # the noise floor: stock TRL against itself, another summation order
        mp = pytest.MonkeyPatch()
        mp.setattr(chunked_logprob, "_addmm_fp32", _addmm_ieee)
        ours = t.train(trl.GRPOTrainer, str(model), out / "trl_ieee", **overrides)
        mp.undo()
    else:
        ours = t.train(GRPOTrainer, str(model), out / "ours", pytest.MonkeyPatch(), **overrides)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == world
    if rank == 0:
        for step, (a, b) in enumerate(zip(ref, ours)):   # every logged value, before the assertion
            diffs = {k: (a[k], b.get(k)) for k in (*t.SAME_BATCH, *t.LOSS_METRICS) if k in a}
            print(f"step {step}: " + ", ".join(
                f"{k} {x:.6g}/{y:.6g} ({abs(x - y) / max(abs(x), 1e-3):.1e})" for k, (x, y) in diffs.items()),
                flush=True)
        worst = t.assert_same_logs(ref, ours)
        where = torch.cuda.get_device_name() if "--cuda" in sys.argv else "CPU"
        print(f"{world} processes ({where}), bf16={overrides['bf16']}: worst relative difference {worst:.1e}")
        print("TRL MULTIPROCESS: PASS", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # no interpreter teardown (see bench/fsdp.py: a joinable gloo thread)


if __name__ == "__main__":
    main()
