"""How long a step takes, predicted: `step_time(cfg)`, the rank's simulated step (`optrace.py`)
played on a machine: this machine's CPU ranks (`player.play`, on `calibrate`'s rates) or a GPU's
rank, named or calibrated here (`gpuplay.play_cuda`, CUDA's streams on a roofline).

The answer, `StepTime`, has the seconds, what they went to (``ledger``: forward, backward,
recompute, exposed_comm, optimizer, other; they add up), the communication and its overlap as
``res.overlap()`` measures them, and a timeline in the columns of ``res.timeline``.
"""
from __future__ import annotations

import dataclasses
import os

from ..devices import cuda_gpus, resolve_devices
from . import hardware, replay
from .attention import CudaTarget
from .calibrate import calibrate, remember
from .gpuplay import play_cuda
from .optrace import Op
from .peak import heaviest_rank, streamed
from .player import LEDGER, play

COLUMNS = ["rank", "step", "micro_step", "kind", "name", "start_s", "end_s", "bytes"]
"""The timeline's columns, as ``ddpkit.runs.timeline.COLUMNS`` (a test holds them equal)."""


@dataclasses.dataclass
class StepTime:
    """A predicted optimizer step on one rank. ``ledger``: seconds by kind (they add up to
    ``seconds``); ``comm_s``: the union of the step's communication; ``overlap``: the share of
    it hidden under compute (0..1; NaN without communication); ``timeline``: rows ``(rank,
    step, micro_step, kind, name, start_s, end_s, bytes)`` as ``res.timeline`` has them."""
    seconds: float
    ledger: dict
    comm_s: float
    overlap: float
    samples: int
    tokens: int
    flops: int
    machine: str
    rows: list = dataclasses.field(default_factory=list, repr=False)
    peak_flops: float | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def samples_per_s(self):
        return self.samples / self.seconds

    @property
    def tokens_per_s(self):
        """Tokens a second over all ranks (None for a model whose samples are not sequences)."""
        return self.tokens / self.seconds if self.tokens else None

    @property
    def mfu(self):
        """Model FLOPs utilisation: the step's FLOPs (recompute left out, as the term is used)
        over the device's peak, where the device's peak is known."""
        if not self.peak_flops:
            return None
        return self.flops / self.seconds / self.peak_flops

    @property
    def timeline(self):
        """The rows as a DataFrame, with ``bucket`` as ``res.timeline`` has it."""
        import pandas as pd

        df = pd.DataFrame(self.rows, columns=COLUMNS)
        df["bucket"] = [int(n.split()[1]) if k == "allreduce" else -1
                        for k, n in zip(df["kind"], df["name"])]
        return df

    def __repr__(self):
        parts = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in self.ledger.items() if v)
        return (f"StepTime({1e3 * self.seconds:.2f} ms on {self.machine}: {parts} ms; "
                f"comm {1e3 * self.comm_s:.2f} ms, {self._overlap_text()})")

    def _overlap_text(self):
        return "no communication" if self.comm_s == 0 else f"{100 * self.overlap:.0f}% hidden"


def step_time(cfg, device=None, link=None, rank=None, machine=None, bucket_cap_mb=...):
    """The predicted `StepTime` of ``cfg``'s optimizer step on rank ``rank`` (None: the
    heaviest, as `peak` picks it). ``device=None``: this machine's ranks, from its calibration
    (`calibrate.calibrate`: measured on first use, then cached; CPU ranks over gloo, or this
    machine's GPUs where it has them); a name (``"H100"``, ``"A100-80GB"``...:
    `hardware.DEVICES`) or a `hardware.Device`: that GPU's rank, simulated as the CUDA rank it
    is (`hardware.target`) and played with CUDA's streams (`gpuplay`) on its roofline.
    ``link``: a simulated link for this machine's CPU ranks (None: the config's own
    ``link_gbps``), or, for a named device, the network between its nodes (``"400Gbps"``,
    ``"NDR"``, a number of Gbit/s per GPU; `hardware.network`): needed once ``world_size``
    spans nodes. ``machine``: a `Machine` to use as it is. ``bucket_cap_mb``: DDP's bucket
    size to play the step with, where it is not the config's (the simulated step does not
    depend on it: only when each all-reduce starts does)."""
    target = None
    if device is not None:
        target = hardware.target(device)
        machine = hardware.with_link(machine or hardware.machine(device), link, cfg.world_size)
    elif machine is None:  # the calibration of the ranks the config runs: CPU or GPU
        machine = calibrate(device=resolve_devices(cfg.world_size, cfg.backend, cfg.device)[1])
    if machine.kind == "cuda" and target is None:  # this machine's GPUs, calibrated
        target = _local_target(cfg)
    sim = streamed(cfg, heaviest_rank(cfg, target) if rank is None else rank, target)
    if machine.key and machine.kind == "measured" and replay.learn(machine, sim.stream):
        remember(machine)  # what it measured here for the first time, for next time
    mb = cfg.bucket_cap_mb if bucket_cap_mb is ... else bucket_cap_mb
    cap = (mb or 25) * 2**20
    caps = (2**20 if mb is None else cap, cap)  # torch's default first bucket: 1 MiB
    if target is not None:
        seconds, ledger, rows, spans = play_cuda(sim.stream, machine, ranks=cfg.world_size,
                                                 rank=sim.rank, caps=caps)
    else:
        slow = 1.0
        if machine.kind == "measured":
            slow = machine.slowdown(cfg.world_size, os.cpu_count() or 1)
        gbps = _gbps(link) if link is not None else cfg.link_gbps
        wire = (gbps, cfg.link_latency_us) if gbps or cfg.link_latency_us else None
        seconds, ledger, rows, spans = play(sim.stream, machine, ranks=cfg.world_size,
                                            slowdown=slow, link=wire, rank=sim.rank, caps=caps)
    comm = _union([(s, e) for s, e, *_ in spans])
    hidden = comm - ledger["exposed_comm"]
    samples = cfg.world_size * cfg.micro_batch * cfg.accum_steps
    flops = sum(e.flops for e in sim.stream if isinstance(e, Op) and not e.recompute)
    dtype = "bfloat16" if cfg.precision in ("bf16", "fp16") else "float32"
    return StepTime(seconds, ledger, comm, hidden / comm if comm else float("nan"), samples,
                    samples * cfg.seq_len if _sequences(cfg) else 0, flops, machine.name, rows,
                    machine.peak_flops.get(dtype), notes=list(machine.notes))


def _local_target(cfg):
    """The `attention.CudaTarget` of this machine's first GPU (a calibrated GPU machine)."""
    gpus = cuda_gpus()
    if not gpus:
        raise ValueError("step_time(machine=...): a GPU's calibration needs that GPU here; pass "
                         "device='H100' (a named device) or machine=calibrate() on this machine")
    return CudaTarget.of_gpu(gpus[0])


def _sequences(cfg):
    """Are the config's samples sequences of ``seq_len`` tokens (the built-in GPT, a causal LM
    on synthetic tokens)?"""
    return cfg.model == "gpt" or (not cfg.builtin and cfg.data is None)


def _gbps(link):
    if isinstance(link, (int, float)):
        return float(link)
    return hardware.link_gbps(link)


def _union(spans):
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
