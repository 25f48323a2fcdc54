"""The multi-process scripts under torchrun: bench/tp.py (vocab-parallel TP against one process,
every rank's shards checked; gloo on CPU in CI, NCCL on GPUs) and bench/fsdp.py (DDP and FSDP2
training steps of a small HF model against one process). Each script exits 1 on a disagreement
and prints a PASS line the tests look for. The in-process gloo TP cases: test_distributed.py."""
import pytest
import torch
import torch.distributed as dist

from helpers import torchrun

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _run_tp_bench(world: int, args: list, timeout: int) -> str:
    run = torchrun(world, ["-m", "bench.tp", *args], timeout)
    assert run.returncode == 0 and "TP CHECK: PASS" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


# (ranks, bench.tp arguments): the qwen3-8b head timed, and every TP mode (recompute / fused,
# eager / compiled: each run's rows) at a smaller head, padded and packed, plain and with GSPO, a
# bias and a softcap together ("all": one compile per shape instead of three); 4 ranks where the
# machine has 4 GPUs
NCCL_RUNS = [(2, ["--shape", "qwen3-8b"]),
             (2, ["--shape", "qwen2.5-0.5b", "qwen2.5-0.5b-packed", "--variants", "base", "all",
                  "--no-time"]),
             (4, ["--shape", "qwen3-8b"])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA GPUs and NCCL")
@pytest.mark.parametrize("world,args", NCCL_RUNS, ids=["qwen3-8b-x2", "modes-x2", "qwen3-8b-x4"])
def test_nccl_tp(world, args):
    """bench/tp.py over NCCL (NVLink multicast off): recompute and fused TP, eager and compiled,
    against one GPU with the full weight, every rank's dX and dW (d_bias) shard; the script exits
    1 on a disagreement."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (the device tool's nvidia-h100-x{world})")
    _run_tp_bench(world, args, 900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (gloo) run of bench/tp.py; test_nccl_tp is its GPU twin")
def test_gloo_tp_bench_cpu_tiny(tmp_path):
    """bench/tp.py on 2 CPU processes over gloo at cpu-tiny-packed (cu_seqlens) with GSPO, a bias
    and a softcap together (the "all" variant): every rank's dW and d_bias shard, TP recompute
    and fused, eager and compiled, and the compiled TP=1 row agree with TP=1 recompute eager;
    --profile writes a profiler table and trace of the TP fused compiled rows. One shape: each
    (shape, variant) compiles its own programs in both ranks, 60-75 s a case on 2 cold cores;
    the padded TP layouts are test_distributed.py's (gloo) and test_nccl_tp's (bench/tp.py's
    padded shapes on GPUs)."""
    out = _run_tp_bench(2, ["--shape", "cpu-tiny-packed", "--variants", "all", "--profile",
                            str(tmp_path)], 900)
    assert out.count("| tp=2 fused compiled |") == 1 and "tp=1 recompute compiled" in out
    assert "dW shard rel, each rank" in out and "KiB sent a step" in out
    assert "**cpu-tiny-packed**, all " in out
    assert (tmp_path / "cpu-tiny-packed_all_tp2_fused_compiled.txt").exists()
    assert (tmp_path / "cpu-tiny-packed_all_tp2_fused_compiled.json").exists()


def _run_fsdp_bench(extra, timeout):
    run = torchrun(2, ["-m", "bench.fsdp", *extra], timeout)
    assert run.returncode == 0 and "FSDP CHECK: PASS" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count(" ok") == 8, run.stdout   # ddp / fsdp2 x untied / tied x 2 steps


def test_gloo_ddp_fsdp2_hf_steps():
    """bench/fsdp.py on 2 CPU processes (gloo): DDP and FSDP2 training steps of a small HF Qwen2
    (untied and tied lm_head) with grpo_loss and gradient accumulation equal one process on the
    whole batch: loss, every gradient, every parameter after the step (~15 s)."""
    pytest.importorskip("transformers")
    _run_fsdp_bench(["--device", "cpu"], 600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA GPUs and NCCL (the device tool's nvidia-h100-x2)")
def test_nccl_ddp_fsdp2_hf_steps():
    """The same on 2 GPUs over NCCL, a 32k vocabulary (the fused-gradient path, auto on CUDA)."""
    pytest.importorskip("transformers")
    _run_fsdp_bench(["--device", "cuda", "--vocab", "32000", "--hidden", "256"], 900)
