"""CUDA/NCCL paths of the launcher. They need GPUs; where there are none they are skipped, and the
skip says so (a skip is never counted as a pass)."""
import pytest
import torch
import torch.distributed as dist

import ddpkit

GPUS = torch.cuda.device_count()
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL, this machine has {GPUS}")
needs_one = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU, this machine has none")


def where(ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    current = torch.cuda.current_device() if ctx.device.type == "cuda" else None
    return str(ctx.device), ctx.backend, t.item(), current


@needs_two
def test_backend_none_picks_nccl_one_process_per_gpu():
    res = ddpkit.launch(where, world_size=2)
    assert res.backend == "nccl"
    assert res.returns == [("cuda:0", "nccl", 2.0, 0), ("cuda:1", "nccl", 2.0, 1)]


@needs_two
def test_launch_works_after_the_kernel_initialised_cuda():
    torch.zeros(1, device="cuda")  # CUDA is now initialised here: fork would break, spawn must not
    assert torch.cuda.is_initialized()
    assert ddpkit.launch(where, world_size=2).returns[1][0] == "cuda:1"


@needs_one
def test_gloo_on_cpu_can_be_forced_on_a_gpu_machine():
    res = ddpkit.launch(where, world_size=2, backend="gloo", device="cpu")
    assert res.backend == "gloo" and res.returns[0][0] == "cpu"
