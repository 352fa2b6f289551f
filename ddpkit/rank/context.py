"""`Context`: what the user's function receives as its first argument, on every rank.

The same `Context` is built from the environment under ``torchrun`` (`Context.from_env`), so the
training code is one function whichever launcher started it.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .. import devices
from .output import plain


def format_record(record):
    """One record as a log line: ``step=3 loss=0.512 ...``."""
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else
                    f"{k}=<{len(v)} rows>" if isinstance(v, list) else f"{k}={v}"
                    for k, v in record.items())


class Context:
    """What the user's function receives as its first argument.

    ``rank``, ``world_size``, ``local_rank``, ``device``, ``backend``, ``is_main`` (rank 0),
    ``seed``; ``log(**fields)`` streams one record to the kernel; ``barrier()``;
    ``sync_controls()`` returns the settings the kernel changed mid-run, the same on every rank.
    """

    def __init__(self, rank, world_size, local_rank, device, backend, seed=0, channel=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.backend, self.seed = device, backend, seed
        self.is_main = rank == 0
        self._channel = channel
        self.new_job()
        self.records = []  # kept here only when there is no kernel to send them to (torchrun)
        self.on_record = None  # under torchrun: called with each record instead of printing it

    @classmethod
    def from_env(cls, seed=0, backend=None, device=None):
        """A Context for a process started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) or by
        srun with RANK and WORLD_SIZE set (the local rank and count then come from SLURM's
        variables); ``backend`` and ``device`` as in `ddpkit.launch`."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = devices.local_rank(rank)  # LOCAL_RANK, or SLURM_LOCALID under srun
        here = devices.local_share(world)  # 1 where SLURM bound a GPU of its own to each task
        # the choice a spawned run of this machine's ranks gets, so every rank agrees on it
        backend, kind = devices.resolve_devices(here, backend, device)
        if kind == "cuda":
            place = torch.device("cuda", devices.rank_gpu(local, len(devices.cuda_gpus())))
        else:
            place = torch.device("cpu")
        return cls(rank, world, local, place, backend, seed)

    def new_job(self):
        """Clear the per-job state (the last step logged, when to talk about settings next):
        a warm rank starts each job as a fresh one would."""
        self.last_step = None
        self._next_sync, self._last_sync = 0, None

    def log(self, **fields):
        """Send one record (a flat dict of numbers/strings) to the kernel, now."""
        record = {k: plain(v) for k, v in fields.items()}
        if "step" in record:
            self.last_step = record["step"]
        if self._channel is not None:
            self._channel.send("metric", record)
            return
        self.records.append({"rank": self.rank, **record})
        if self.on_record is not None:  # the CLI's progress bar
            self.on_record(self.records[-1])
        elif self.is_main:  # under torchrun there is no kernel: print rank 0's records
            print(format_record(record), flush=True)

    def barrier(self):
        if dist.is_initialized():
            dist.barrier()

    def sync_controls(self, step, latency_s=0.1):
        """Settings the kernel sent while running, the same on every rank, at the same step.

        Collective: every rank calls it at every step with the same ``step`` (the train loop
        does), but it only talks on the steps it scheduled: rank 0 reads its pipe and
        broadcasts ``[has settings, next step to talk]``, spacing the talks about ``latency_s``
        apart (a change lands within ~0.1 s), so a fast step does not pay a collective each time.
        """
        if step < self._next_sync:
            return {}
        fresh = {}
        if self.is_main and self._channel is not None:
            while self._channel.poll():
                msg = self._channel.recv()
                if msg[0] == "control":
                    fresh.update(msg[1])
        now = time.monotonic()
        if self._last_sync is not None and step > self._last_sync[0]:
            per_step = (now - self._last_sync[1]) / (step - self._last_sync[0])
            gap = max(1, min(1000, int(latency_s / max(per_step, 1e-6))))
        else:
            gap = 1
        self._last_sync = (step, now)
        header = [1 if fresh else 0, step + gap]
        if dist.is_initialized() and self.world_size > 1:
            flag = torch.tensor(header, device=self._flag_device())
            dist.broadcast(flag, src=0)
            header = flag.tolist()
            if header[0]:
                box = [fresh]
                dist.broadcast_object_list(box, src=0, device=self._flag_device())
                fresh = box[0]
        self._next_sync = header[1]
        return fresh

    def _flag_device(self):
        # every group ddpkit starts has gloo for CPU tensors (devices.group_backend): a CPU flag
        # needs no device-to-host copy to read
        return torch.device("cpu")
