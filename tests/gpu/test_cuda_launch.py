"""CUDA/NCCL paths of the launcher. They need GPUs; where there are none they are skipped, and the
skip says so (a skip is never counted as a pass)."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit import devices

GPUS = len(devices.cuda_gpus())
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL, this machine has {GPUS}")
needs_one = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU, this machine has none")


def where(ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    current = torch.cuda.current_device() if ctx.device.type == "cuda" else None
    return str(ctx.device), ctx.backend, t.item(), current


def cpu_collectives(ctx):
    """What the README's first example and notebook 01 do, plus a barrier and an object
    collective, with every warning kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = torch.ones(1) * (ctx.rank + 1)
        dist.all_reduce(t)  # a CPU tensor: gloo's, also in an NCCL run
        dist.barrier()
        box = [{"rank": ctx.rank}] if ctx.is_main else [None]
        dist.broadcast_object_list(box, src=0)
    return t.item(), box[0], [str(w.message) for w in caught]


@needs_two
def test_backend_none_picks_nccl_one_process_per_gpu():
    res = ddpkit.launch(where, world_size=2)
    assert res.backend == "nccl"
    assert res.returns == [("cuda:0", "nccl", 2.0, 0), ("cuda:1", "nccl", 2.0, 1)]


@needs_two
def test_cpu_collectives_and_barrier_work_under_nccl_without_warnings():
    res = ddpkit.launch(cpu_collectives, world_size=2)
    assert res.backend == "nccl"
    for total, obj, caught in res.returns:
        assert (total, obj) == (3.0, {"rank": 0})
        assert not [w for w in caught if "barrier" in w], caught  # device_id was passed


def bound_device(ctx):
    return str(dist.group.WORLD.bound_device_id)


@needs_two
def test_nccl_ranks_bind_their_gpu_at_init():
    assert ddpkit.launch(bound_device, world_size=2).returns == ["cuda:0", "cuda:1"]


@needs_two
def test_launch_works_after_the_kernel_initialised_cuda():
    torch.zeros(1, device="cuda")  # CUDA is now initialised here: fork would break, spawn must not
    assert torch.cuda.is_initialized()
    assert ddpkit.launch(where, world_size=2).returns[1][0] == "cuda:1"


@needs_one
def test_forkserver_ranks_use_cuda_after_the_kernel_initialised_it(monkeypatch):
    """The opt-in forkserver's CUDA-safety argument, on a GPU: the kernel has a CUDA context,
    the ranks are forked from a server that never made one, and they use their GPU."""
    torch.zeros(1, device="cuda")
    assert torch.cuda.is_initialized()
    monkeypatch.setenv("DDPKIT_START_METHOD", "forkserver")
    for _ in range(2):  # the server's first ranks, then ranks forked from a server that has served
        assert [r[0].split(":")[0] for r in ddpkit.launch(where, world_size=2).returns] == \
            ["cuda", "cuda"]


@needs_one
def test_gloo_on_cpu_can_be_forced_on_a_gpu_machine():
    res = ddpkit.launch(where, world_size=2, backend="gloo", device="cpu")
    assert res.backend == "gloo" and res.returns[0][0] == "cpu"


@needs_one
def test_more_ranks_than_gpus_share_them_over_gloo_and_say_so(capsys):
    n = GPUS + 1
    res = ddpkit.launch(where, world_size=n)
    assert (res.backend, res.device) == ("gloo", "cuda")
    assert [r[0] for r in res.returns] == [f"cuda:{r % GPUS}" for r in range(n)]
    assert {r[2] for r in res.returns} == {float(n)}  # a CUDA all-reduce over gloo
    # the note itself, once per run (it says "share" twice: counting the word would fail)
    assert capsys.readouterr().out.count(devices.shared_note(n, "gloo", "cuda")) == 1
    with pytest.raises(ValueError, match=r"NCCL runs one process per GPU.*share the GPU"):
        ddpkit.launch(where, world_size=n, backend="nccl")


def cuda_values(ctx):
    t = torch.arange(4.0, device=ctx.device)
    ctx.log(step=0, vec=t, parts=[t, t * 2])
    return {"t": t, "p": torch.nn.Parameter(t.clone()), "scalar": t.sum()}


@needs_one
def test_records_and_returns_reach_the_kernel_as_cpu_tensors():
    res = ddpkit.launch(cuda_values, world_size=1, device="cuda")
    rec, ret = res.metrics[0], res.returns[0]
    assert rec["vec"].device.type == "cpu" and rec["parts"][1].device.type == "cpu"
    assert ret["t"].device.type == "cpu" and ret["scalar"].device.type == "cpu"
    assert isinstance(ret["p"], torch.nn.Parameter) and ret["p"].device.type == "cpu"
    assert ret["t"].tolist() == [0.0, 1.0, 2.0, 3.0]


def group_timeout(ctx):
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    return backend.options._timeout.total_seconds()


@needs_two
def test_a_pool_sets_nccl_timeout_per_job():
    with ddpkit.Pool(world_size=2) as pool:
        assert pool.launch(group_timeout, stall_timeout_s=1000).returns[0] >= 2000
        assert pool.launch(group_timeout, stall_timeout_s=10).returns[0] < 1000


def leave_gpu_garbage(ctx):
    import gc

    gc.disable()  # only ddpkit's collection between jobs may free the cycle
    cycle = [torch.empty(64 << 20, dtype=torch.uint8, device=ctx.device)]
    cycle.append(cycle)
    return torch.cuda.memory_allocated()


def gpu_bytes_now(ctx):
    import gc

    gc.enable()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


@needs_one
def test_a_pool_job_starts_without_the_last_jobs_gpu_memory():
    with ddpkit.Pool(world_size=1, device="cuda") as pool:
        held = pool.launch(leave_gpu_garbage).returns[0]
        allocated, reserved = pool.launch(gpu_bytes_now).returns[0]
    assert held >= 64 << 20
    assert allocated < 64 << 20 and reserved < 64 << 20


def deterministic_matmul(ctx):
    a = torch.randn(64, 64, device=ctx.device)
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG"), (a @ a).sum().item()


@needs_one
def test_deterministic_cuda_ranks_get_a_cublas_workspace_config():
    torch.use_deterministic_algorithms(True)
    try:
        res = ddpkit.launch(deterministic_matmul, world_size=1, device="cuda")
    finally:
        torch.use_deterministic_algorithms(False)
    assert res.returns[0][0] == ":4096:8"


@needs_one
def test_config_checks_leave_cuda_uninitialised_in_the_kernel():
    # a fresh interpreter: other tests here initialise CUDA in this one
    code = textwrap.dedent("""
        import torch, ddpkit
        ddpkit.TrainConfig(world_size=1, device="cuda", precision="fp16")
        try:
            ddpkit.TrainConfig(world_size=1, device="cuda", precision="bf16")
        except ValueError as exc:
            assert "no native bf16" in str(exc)
        print("INITIALISED", torch.cuda.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "INITIALISED False" in out.stdout
