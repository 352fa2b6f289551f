"""Where ranks run: the backend and device choice, made in the kernel before any process starts.

Every question to CUDA goes through `cuda_gpus()`, so a test can hand in any GPU count and
capability on a CPU-only machine. It asks without creating a CUDA context in the kernel: the
count the way torch does (``torch.cuda.device_count`` reads NVML before CUDA is initialised),
the capability from NVML too, falling back to torch only where NVML cannot answer.

The choices (torch 2.13's ``distributed/distributed_c10d.py`` backs each):

* ``nccl`` when there is a GPU per rank. NCCL serves only CUDA tensors
  (``Backend.backend_capability["nccl"] == ["cuda"]``), so the group is brought up as
  ``"cpu:gloo,cuda:nccl"``: CPU tensors and object collectives go over gloo. ``barrier()`` runs
  on NCCL: ddpkit binds each NCCL rank's GPU (``init_process_group(device_id=...)``), and
  ``barrier`` takes the group's ``bound_device_id`` before anything else.
* gloo on shared GPUs when there are fewer GPUs than ranks: NCCL cannot put two ranks on one
  GPU, gloo carries CUDA tensors (``backend_capability["gloo"] == ["cpu", "cuda"]``). Ranks take
  the GPUs round-robin. It shows DDP's behaviour, not its speed.
* gloo on CPU where there is no usable GPU.

Under torchrun (`under_torchrun`) the world spans machines: each machine chooses for the ranks it
runs itself (`local_world_size`), so every rank of a machine makes the same choice. Under srun
(SLURM) without torchrun, SLURM's variables say how many ranks run here where torch's are absent,
and whether SLURM bound GPUs of its own to each task (`gpus_bound_per_task`): then a task sees
only its own GPU, and 8 tasks on an 8-GPU node are 8 NCCL ranks, not 8 ranks sharing 1 GPU.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("gloo", "nccl")
BF16_CAPABILITY = (8, 0)  # Ampere: native bf16; torch emulates it (slowly) below


def cuda_gpus():
    """Compute capability ``(major, minor)`` of each GPU a rank started from here would see.

    Empty when CUDA cannot run here. Both torch questions are needed: NVML can count GPUs that
    the CUDA runtime cannot use (a driver older than torch's CUDA), and ``is_available()`` alone
    says nothing about how many. Neither creates a CUDA context (``torch/cuda/__init__.py``:
    ``is_available`` is ``cudaGetDeviceCount``; ``device_count`` uses NVML before init).
    """
    if not torch.cuda.is_available():
        return []
    return [_capability(i) for i in range(torch.cuda.device_count())]


def _capability(index):
    return _read_capability(index, os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=None)
def _read_capability(index, visible):
    """Cached per GPU: NVML's initialisation is not free, and configs are built often."""
    if not torch.cuda.is_initialized():
        try:
            return _nvml_capability(torch.cuda._get_nvml_device_index(index))
        except Exception:  # no NVML (or MIG UUIDs): ask the runtime instead
            pass
    # initialises torch's CUDA state in this process (harmless here: ranks are spawned)
    return torch.cuda.get_device_capability(index)


def _nvml_capability(nvml_index):
    """NVML's ``nvmlDeviceGetCudaComputeCapability``, loaded as torch loads NVML to count GPUs
    (``torch.cuda._raw_device_count_nvml``)."""
    from ctypes import CDLL, byref, c_int, c_void_p

    nvml = CDLL("libnvidia-ml.so.1")
    handle, major, minor = c_void_p(), c_int(), c_int()
    if (nvml.nvmlInit() or nvml.nvmlDeviceGetHandleByIndex_v2(nvml_index, byref(handle))
            or nvml.nvmlDeviceGetCudaComputeCapability(handle, byref(major), byref(minor))):
        raise RuntimeError("NVML could not tell the compute capability")
    return major.value, minor.value


def resolve_devices(world_size, backend=None, device=None):
    """Pick (backend, device_type) and refuse settings that cannot work, before spawning."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least 1 rank; pass world_size=1 or more")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; pass backend=None to choose")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device={device!r}: pass 'cpu', 'cuda' or None")
    gpus = len(cuda_gpus())
    if device == "cuda" and gpus == 0 or backend == "nccl" and gpus == 0:
        raise ValueError(f"{'backend=nccl' if backend == 'nccl' else 'device=cuda'}: this machine "
                         f"has no visible CUDA GPU; pass backend=None, device='cpu' (gloo ranks)")
    if backend == "nccl" and device == "cpu":
        raise ValueError("backend='nccl' needs device='cuda'; for CPU ranks pass backend='gloo'")
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"backend='nccl': world_size={world_size} is above the {gpus} visible CUDA GPU(s) and "
            f"NCCL runs one process per GPU. Pass world_size<={gpus}, or backend=None (or "
            f"'gloo') with device='cuda' to share the GPU(s) between ranks over gloo")
    if device is None:  # an explicit backend='gloo' means CPU ranks unless device='cuda'
        device = "cuda" if gpus and backend != "gloo" else "cpu"
    if backend is None:
        backend = "nccl" if device == "cuda" and world_size <= gpus else "gloo"
    return backend, device


def gpus_shared(world_size, backend, device):
    """True when several ranks share one GPU (gloo, more ranks than GPUs)."""
    return device == "cuda" and backend == "gloo" and world_size > len(cuda_gpus())


def shared_note(world_size, backend, device):
    """The line said once when a run shares GPUs, or None."""
    if not gpus_shared(world_size, backend, device):
        return None
    gpus = len(cuda_gpus())
    return (f"ddpkit: {world_size} ranks share {gpus} GPU(s) round-robin over gloo (NCCL needs one "
            f"GPU per rank). This shows DDP's behaviour, not its speed; peak_bytes is each "
            f"rank's own CUDA memory on the shared device.")


def group_backend(backend):
    """The backend string for ``init_process_group``. NCCL has no CPU backend, so a plain
    ``"nccl"`` group fails every CPU collective with "No backend type associated with device
    type cpu": pair it with gloo for CPU tensors, barriers and object collectives."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


DETERMINISTIC_CUBLAS = ":4096:8"  # torch's docs: deterministic cuBLAS needs a fixed workspace


def cublas_workspace_config(deterministic):
    """The ``CUBLAS_WORKSPACE_CONFIG`` a CUDA rank runs with: the user's own value where the
    kernel's environment has one, else ``:4096:8`` when the run is deterministic (cuBLAS is
    deterministic only with it set before CUDA initialises: torch's
    ``testing/_internal/common_utils.py``), else None (cuBLAS's default). The ranks set it and
    the estimate reads it from here, so they agree."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG") or (
        DETERMINISTIC_CUBLAS if deterministic else None)


def rank_gpu(rank, gpus):
    """The GPU index of a rank: its own with one per GPU, round-robin when they share."""
    return rank % gpus


def check_bf16(world_size):
    """Refuse bf16 on GPUs without native bf16 (compute capability below 8.0).

    ``torch.cuda.is_bf16_supported()`` is no guide: it defaults to ``including_emulation=True``
    (true on T4/V100, where bf16 is emulated) and creates a CUDA context in the kernel to find out.
    """
    caps = cuda_gpus()
    used = sorted({caps[rank_gpu(r, len(caps))] for r in range(world_size)})
    if used and used[0] < BF16_CAPABILITY:
        raise ValueError(
            f"TrainConfig.precision='bf16': this GPU (compute capability "
            f"{used[0][0]}.{used[0][1]}) has no native bf16, which needs 8.0 (Ampere) or newer; "
            f"pass precision='fp16' (with GradScaler) or 'fp32'")


def under_torchrun():
    """Was this process started by torchrun (or a launcher that sets torch's ``env://``
    variables: RANK, WORLD_SIZE, MASTER_ADDR)? Then it joins that group instead of spawning."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def local_world_size(world_size):
    """How many of ``world_size`` ranks run on this machine: torch's ``LOCAL_WORLD_SIZE`` where
    the launcher set it (torchrun does: the world may span machines); else SLURM's count of
    tasks on this node, where srun started the process (a user's script sets RANK, WORLD_SIZE
    and MASTER_ADDR from SLURM's variables, rarely LOCAL_WORLD_SIZE); else all of them."""
    here = os.environ.get("LOCAL_WORLD_SIZE") or slurm_tasks_on_this_node()
    return min(world_size, int(here or world_size))


def local_share(world_size):
    """How many ranks share this process's visible GPUs, for a process a launcher started
    (torchrun, srun): this machine's ranks (`local_world_size`), or 1 where SLURM bound GPUs of
    its own to each task (`gpus_bound_per_task`). The backend is chosen for that many."""
    here = local_world_size(world_size)
    return 1 if gpus_bound_per_task(here) else here


def gpus_bound_per_task(local_tasks):
    """Did SLURM bind GPUs of its own to each of this node's ``local_tasks`` tasks
    (``srun --gpus-per-task=1``, whose default is ``--gpu-bind=per_task:1``; ``--gpu-bind``)?
    Each task then sees only its own GPU(s) (SLURM sets ``CUDA_VISIBLE_DEVICES`` per task), so
    counting the visible GPUs against the node's tasks would put 8 ranks on "one" GPU over gloo.

    Bound when this task sees ``SLURM_GPUS_PER_TASK`` GPUs, or fewer than the step holds on
    this node (``SLURM_GPUS_ON_NODE``, or the ids in ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``)
    and that many are enough for every task to have as many of its own. Tasks that share GPUs
    (``--ntasks-per-gpu=2``) are not bound: they stay on gloo."""
    env = os.environ
    if "SLURM_LOCALID" not in env or local_tasks < 2:
        return False
    visible = len(cuda_gpus())
    per_task = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]  # "1" or "a100:1"
    ids = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    on_node = int(env.get("SLURM_GPUS_ON_NODE") or 0) or (len(ids.split(",")) if ids else 0)
    if not visible:
        return False
    if per_task.isdigit() and visible == int(per_task):
        return True
    return visible < on_node and on_node >= local_tasks * visible


def local_rank(rank):
    """This process's rank on its machine: torch's ``LOCAL_RANK``, else SLURM's
    ``SLURM_LOCALID``, else the global ``rank`` (one machine)."""
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or rank)


def slurm_tasks_on_this_node():
    """The number of tasks SLURM runs on this node, or None outside SLURM.

    ``SLURM_STEP_TASKS_PER_NODE`` (srun's own step) or ``SLURM_TASKS_PER_NODE`` (the job) list
    every node's count in SLURM's compressed form, ``"4(x2),3"`` for 4, 4, 3, indexed by
    ``SLURM_NODEID``; ``SLURM_NTASKS_PER_NODE`` (set only with ``--ntasks-per-node``) is one
    number for all nodes."""
    env = os.environ
    listed = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if listed:
        counts = []
        for part in listed.split(","):
            count, _, times = part.partition("(x")
            counts += [int(count)] * int(times.rstrip(")") or 1)
        node = int(env.get("SLURM_NODEID", 0))
        if node < len(counts):
            return counts[node]
    return int(env["SLURM_NTASKS_PER_NODE"]) if env.get("SLURM_NTASKS_PER_NODE") else None


# A CPU rank's heap: glibc's mmap threshold, left to glibc (dynamic) unless the kernel's
# environment fixes it, in which case each CPU rank fixes it at its start (`rank.heap`); the
# kernel reads the same (the allocator's allowance `predict.gpus` budgets, the check before a launch)
MMAP_ENV, GLIBC_MMAP_ENV = "DDPKIT_MMAP_THRESHOLD", "MALLOC_MMAP_THRESHOLD_"
MMAP_TIGHT, MMAP_DYNAMIC = 131072, "dynamic"  # glibc's starting threshold: the tight figure
_MMAP_MAX = 32 * 2**20  # glibc's largest threshold on 64-bit (HEAP_MAX_SIZE / 2)


def mmap_threshold_problem(environ=None):
    """What is wrong with ``DDPKIT_MMAP_THRESHOLD``, in words, or None."""
    raw = (os.environ if environ is None else environ).get(MMAP_ENV, "").strip()
    if raw in ("", MMAP_DYNAMIC) or raw.isdigit() and 0 < int(raw) <= _MMAP_MAX:
        return None
    return (f"{MMAP_ENV}={raw!r} is not a threshold: set it to a number of bytes from 1 to "
            f"{_MMAP_MAX} ({MMAP_TIGHT} for a resident peak within a few % of the tensors'), or to "
            f"'{MMAP_DYNAMIC}' (or leave it unset) for glibc's own, which raises it as it goes")


def mmap_threshold(environ=None):
    """The threshold a CPU rank started under ``environ`` (the kernel's) runs with: bytes when
    fixed, None when glibc raises it as it goes (unset, ``dynamic``, or a bad value of the user's)."""
    environ = os.environ if environ is None else environ
    glibc = environ.get(GLIBC_MMAP_ENV, "").strip()
    if glibc:
        return int(glibc) if glibc.isdigit() else None
    raw = environ.get(MMAP_ENV, "").strip()
    if raw in ("", MMAP_DYNAMIC) or mmap_threshold_problem(environ):
        return None
    return int(raw)
