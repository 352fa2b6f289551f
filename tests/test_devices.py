"""The CUDA decisions that can be checked without a GPU (issue #11): the GPUs are handed in through
`ddpkit.devices.cuda_gpus`, the one function that asks torch.cuda; tensors off the CPU are played
by torch's lazy device, which a CPU build has. What needs a real GPU is in tests/gpu."""
import gc

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ddpkit
from ddpkit import devices
from ddpkit.rank.context import Context
from ddpkit.rank.output import plain
from ddpkit.rank.returns import dumps_for_kernel, loads_from_rank
from ddpkit.engine.step import train_step


def gpus(monkeypatch, n, capability=(8, 0)):
    monkeypatch.setattr(devices, "cuda_gpus", lambda: [capability] * n)


# --- backend and device for a given GPU count (faults 1, 8; the one-GPU mode)
@pytest.mark.parametrize("n_gpus, world_size, backend, device, want", [
    (0, 2, None, None, ("gloo", "cpu")),
    (2, 2, None, None, ("nccl", "cuda")),
    (8, 2, None, None, ("nccl", "cuda")),
    (1, 1, None, None, ("nccl", "cuda")),
    (1, 2, None, None, ("gloo", "cuda")),      # one GPU, two ranks: they share it over gloo
    (2, 4, None, "cuda", ("gloo", "cuda")),
    (2, 2, None, "cpu", ("gloo", "cpu")),
    (2, 2, "gloo", None, ("gloo", "cpu")),     # an explicit gloo means CPU ranks
    (1, 2, "gloo", "cuda", ("gloo", "cuda")),
    (2, 2, "nccl", None, ("nccl", "cuda")),
])
def test_backend_and_device_for_each_gpu_count(monkeypatch, n_gpus, world_size, backend, device, want):
    gpus(monkeypatch, n_gpus)
    assert devices.resolve_devices(world_size, backend, device) == want


def test_an_nccl_group_also_gets_gloo_for_cpu_tensors():
    # torch 2.13 distributed_c10d.py: Backend.backend_capability["nccl"] == ["cuda"]
    assert dist.Backend.backend_capability["nccl"] == ["cuda"]
    assert devices.group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert devices.group_backend("gloo") == "gloo"


@pytest.mark.parametrize("n_gpus, kwargs, pattern", [
    (1, dict(world_size=2, backend="nccl"),
     r"backend='nccl': world_size=2 is above the 1 visible CUDA GPU\(s\) and NCCL runs one process "
     r"per GPU. Pass world_size<=1, or backend=None \(or 'gloo'\) with device='cuda' to share"),
    (0, dict(world_size=2, device="cuda"), r"device=cuda: this machine has no visible CUDA GPU.*device='cpu'"),
    (0, dict(world_size=1, backend="nccl"), r"backend=nccl: this machine has no visible CUDA GPU"),
    (2, dict(world_size=2, backend="nccl", device="cpu"), r"backend='nccl' needs device='cuda'"),
])
def test_impossible_placements_are_refused_with_the_fix(monkeypatch, n_gpus, kwargs, pattern):
    gpus(monkeypatch, n_gpus)
    with pytest.raises(ValueError, match=pattern):
        devices.resolve_devices(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        ddpkit.launch(lambda ctx: None, **kwargs)  # before any process starts


@pytest.mark.parametrize("available, count, want", [(True, 2, 2), (False, 2, 0), (True, 0, 0)])
def test_gpus_count_only_where_cuda_can_run(monkeypatch, available, count, want):
    # NVML can count GPUs that the CUDA runtime cannot use (a driver older than torch's CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(devices, "_capability", lambda i: (8, 0))
    assert len(devices.cuda_gpus()) == want


def test_ranks_share_gpus_round_robin_and_the_run_says_so(monkeypatch):
    gpus(monkeypatch, 2)
    assert [devices.rank_gpu(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    note = devices.shared_note(5, "gloo", "cuda")
    assert "5 ranks share 2 GPU(s)" in note and "each rank's own CUDA memory" in note
    assert devices.shared_note(2, "nccl", "cuda") is None
    assert devices.shared_note(2, "gloo", "cuda") is None  # one GPU each: nothing shared


def test_the_shared_gpu_note_is_said_once_per_run_and_counted_whole(monkeypatch, capsys):
    # tests/gpu counts the note itself: it says "share" twice, so counting the word fails
    gpus(monkeypatch, 1)
    note = devices.shared_note(2, "gloo", "cuda")
    assert note.count("share") == 2
    # real gloo ranks with the note switched on in this kernel: printed once per launch and
    # once per pool (not per job, nor by the ranks, which start fresh without it)
    monkeypatch.setattr(devices, "shared_note", lambda *args: note)
    ddpkit.launch(gloo_timeout, world_size=2, backend="gloo", device="cpu")
    assert capsys.readouterr().out.count(note) == 1
    with ddpkit.Pool(world_size=2, backend="gloo", device="cpu") as pool:
        pool.launch(gloo_timeout)
        pool.launch(gloo_timeout)
    assert capsys.readouterr().out.count(note) == 1


@pytest.mark.parametrize("local_world, local_rank, want", [(2, 1, ("nccl", "cuda:1")),
                                                           (4, 3, ("gloo", "cuda:1"))])
def test_torchrun_ranks_make_the_same_choice(monkeypatch, local_world, local_rank, want):
    gpus(monkeypatch, 2)
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    ctx = Context.from_env()
    assert (ctx.backend, str(ctx.device)) == want


SRUN_ENV = dict(  # what srun sets for task 5 of 8, 4 per node, plus the user's RANK/WORLD_SIZE
    SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_TASKS_PER_NODE="4(x2)",
    SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_NODEID="1", SLURM_LOCALID="1", SLURM_PROCID="5",
    RANK="5", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


SRUN_GPU_ENV = ("SLURM_GPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")


def srun(monkeypatch, **env):
    for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", *SRUN_ENV, *SRUN_GPU_ENV):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**SRUN_ENV, **env}.items():
        if v is not None:
            monkeypatch.setenv(k, v)


def test_under_srun_the_local_world_is_this_nodes_tasks(monkeypatch):
    # 2 nodes x 4 GPUs: before, the whole world (8) counted as local, so 4 GPUs meant gloo
    gpus(monkeypatch, 4)
    srun(monkeypatch)
    assert devices.under_torchrun() and devices.local_world_size(8) == 4
    ctx = Context.from_env()
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (5, 8, 1)
    assert (ctx.backend, str(ctx.device)) == ("nccl", "cuda:1")
    cfg = ddpkit.TrainConfig(world_size=8, backend="nccl", device="cuda")  # not refused
    assert cfg.world_size == 8


EIGHT_TASKS = dict(SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8", SLURM_TASKS_PER_NODE="8(x2)",
                   SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_LOCALID="5", SLURM_PROCID="13",
                   RANK="13", WORLD_SIZE="16", CUDA_VISIBLE_DEVICES="5")


@pytest.mark.parametrize("gpu_env, want", [
    # srun --ntasks-per-node=8 --gpus-per-task=1: each task sees its own GPU, as its cuda:0
    (dict(SLURM_GPUS_PER_TASK="1"), ("nccl", "cuda:0")),
    (dict(SLURM_GPUS_ON_NODE="8", SLURM_STEP_GPUS="0,1,2,3,4,5,6,7"), ("nccl", "cuda:0")),
    (dict(SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"), ("nccl", "cuda:0")),
    # srun --ntasks-per-node=8 --ntasks-per-gpu=2 on 4 GPUs: two tasks per GPU, over gloo
    (dict(SLURM_GPUS_ON_NODE="4"), ("gloo", "cuda:0")),
])
def test_under_srun_a_gpu_bound_per_task_is_each_ranks_own(monkeypatch, gpu_env, want):
    gpus(monkeypatch, 1)  # what each task sees
    srun(monkeypatch, **EIGHT_TASKS, **gpu_env)
    ctx = Context.from_env()
    assert (ctx.rank, ctx.local_rank) == (13, 5)
    assert (ctx.backend, str(ctx.device)) == want
    if want[0] == "nccl":  # the config of such a run is not refused for 8 ranks on "1" GPU
        assert ddpkit.TrainConfig(world_size=16, backend="nccl", device="cuda").world_size == 16


@pytest.mark.parametrize("env, want", [
    (dict(SLURM_NTASKS_PER_NODE=None), 4),                    # srun --ntasks 8 on 2 nodes
    (dict(SLURM_STEP_TASKS_PER_NODE="3,2", SLURM_NODEID="1"), 2),  # uneven nodes
    (dict(SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="3"), 1),
    (dict(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None), 4),  # --ntasks-per-node
    (dict(LOCAL_WORLD_SIZE="2"), 2),                          # torch's own variable wins
])
def test_slurm_task_counts_in_every_form(monkeypatch, env, want):
    srun(monkeypatch, **env)
    assert devices.local_world_size(8) == want


def test_outside_slurm_and_torchrun_every_rank_is_local(monkeypatch):
    srun(monkeypatch, **{k: None for k in SRUN_ENV})
    assert devices.local_world_size(8) == 8 and devices.local_rank(3) == 3


# --- bf16 from the compute capability (fault 3)
def test_bf16_is_refused_below_compute_capability_8(monkeypatch):
    def no(*a, **k):
        raise AssertionError("is_bf16_supported counts emulation and starts CUDA here")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", no)
    gpus(monkeypatch, 2, capability=(7, 5))  # T4
    with pytest.raises(ValueError, match=r"precision='bf16': this GPU \(compute capability 7.5\) "
                                         r"has no native bf16.*pass precision='fp16'"):
        ddpkit.TrainConfig(precision="bf16", device="cuda")
    gpus(monkeypatch, 2, capability=(8, 0))  # A100
    assert ddpkit.TrainConfig(precision="bf16", device="cuda").precision == "bf16"


# --- tensors reach the kernel on CPU (fault 7)
@pytest.fixture(scope="module")
def lazy():
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")


def test_off_cpu_tensors_are_sent_as_cpu_copies(lazy):
    t = torch.arange(4.0, device=lazy)
    record = plain([t, {"x": t}, (t.sum(),)])
    assert record[0].device.type == "cpu" and record[1]["x"].device.type == "cpu"
    assert record[2] == (6.0,)
    value = loads_from_rank(*dumps_for_kernel({"t": t, "p": torch.nn.Parameter(t.clone())}))
    assert value["t"].device.type == "cpu" and value["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert isinstance(value["p"], torch.nn.Parameter) and value["p"].device.type == "cpu"


def lazy_values(ctx):
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    t = torch.arange(3.0, device="lazy")
    ctx.log(step=0, vec=t)
    return [t, {"w": t * 2}]


def test_records_and_returns_arrive_as_cpu_tensors():
    res = ddpkit.launch(lazy_values, world_size=1, backend="gloo", device="cpu")
    assert res.metrics[0]["vec"].device.type == "cpu"
    t, inner = res.returns[0]
    assert t.device.type == inner["w"].device.type == "cpu" and inner["w"].tolist() == [0.0, 2.0, 4.0]


# --- a pool between jobs (faults 6, 9)
def gloo_timeout(ctx):
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_a_pool_sets_the_collective_timeout_per_job():
    with ddpkit.Pool(world_size=2, backend="gloo", device="cpu") as pool:
        long = pool.launch(gloo_timeout, stall_timeout_s=1000).returns
        off = pool.launch(gloo_timeout, stall_timeout_s=None).returns
        short = pool.launch(gloo_timeout, stall_timeout_s=5).returns
    assert long[0] == long[1] >= 2 * 1000  # above the watchdog: ddpkit's speaks first
    assert off[0] >= 1800 and short[0] < 1000


WEAK = {}


def leave_a_cycle(ctx):
    import weakref

    gc.disable()  # from here only an explicit collection can free the cycle
    cycle = [torch.ones(1000)]
    cycle.append(cycle)
    WEAK["t"] = weakref.ref(cycle[0])
    return WEAK["t"]() is not None


def cycle_freed(ctx):
    gc.enable()
    return WEAK["t"]() is None


def test_a_pool_collects_the_last_jobs_garbage_before_the_next():
    with ddpkit.Pool(world_size=1, backend="gloo", device="cpu") as pool:
        assert pool.launch(leave_a_cycle).returns == [True]
        assert pool.launch(cycle_freed).returns == [True]


# --- the loss is read once per optimizer step (fault 5)
class CountItems(TorchDispatchMode):
    """Counts aten._local_scalar_dense: every .item(), the op that waits for the device."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_the_loss_is_read_once_per_step(accum_steps):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(3, 4), torch.randn(3)) for _ in range(accum_steps)]
    expected = sum(model(x, y).item() for x, y in batches) / accum_steps
    with CountItems() as counter:
        loss = train_step(model, opt, batches, accum_steps=accum_steps)
    assert counter.reads == 1
    assert loss == pytest.approx(expected, rel=1e-6)
