"""How long a step takes, predicted: the rank's simulated step (`optrace.py`: every op it runs,
in order) played on a machine's rates (`machine.py`).

One clock runs the rank's compute, op after op: an op takes its dispatch cost plus its matrix
product's, attention's or memory-bound time at its shape and dtype. Communication runs beside
it on the transport: DDP hands each bucket to its all-reduce when the bucket's gradients are
ready (the stream's ``bucket`` marks; none in a ``no_sync`` micro-step), they run one after
another, and the backward's end waits for all of them (DDP's finalizer); a collective op
(ZeRO-1's broadcasts, FSDP2's all-gathers and reduce-scatters) runs when issued and the first op
that reads what it wrote waits for it (FSDP2's prefetch hides an all-gather behind the block
before). Where collectives take a core from compute (gloo's copies and adds on a CPU rank),
compute goes slower while they run. A simulated link (``link_gbps``) holds each all-reduce
until a ring over that link would be done, buckets one after another on it, as the rank's
`engine.timeline.SimulatedLink` does.

The answer, `StepTime`, has the seconds, what they went to (``ledger``: forward, backward,
recompute, exposed_comm, optimizer, other; they add up), the communication and its overlap as
``res.overlap()`` measures them, and a timeline in the columns of ``res.timeline``.
"""
from __future__ import annotations

import dataclasses
import os

from ..devices import cuda_gpus, resolve_devices
from ..engine.timeline import ring_allreduce_s
from . import hardware, replay
from .attention import CudaTarget
from .calibrate import calibrate, remember
from .gpuplay import play_cuda
from .marks import ddp_buckets, timeline_row
from .optrace import Mark, Op
from .peak import heaviest_rank, streamed

LEDGER = ("forward", "backward", "recompute", "exposed_comm", "optimizer", "other")
COLUMNS = ["rank", "step", "micro_step", "kind", "name", "start_s", "end_s", "bytes"]
"""The timeline's columns, as ``ddpkit.runs.timeline.COLUMNS`` (a test holds them equal)."""
_KIND = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}


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


class _Comm:
    """The transport: collectives one after another (``free``: when it is next free), each
    also held until a simulated link has carried it (``link``: (gbps, latency_us) or None)."""

    def __init__(self, machine, ranks, link):
        self.machine, self.ranks, self.link = machine, ranks, link
        self.free = self.link_free = 0.0
        self.spans = []  # (start, end, kind, name, bytes, micro)

    def run(self, kind, nbytes, ready, name, micro):
        start = max(ready, self.free)
        end = start + self.machine.collective_s(kind, nbytes, self.ranks)
        self.free = end
        if self.link is not None and kind == "allreduce":
            gbps, latency = self.link
            begin = max(ready, self.link_free)
            self.link_free = begin + ring_allreduce_s(nbytes, self.ranks, gbps, latency)
            end = max(end, self.link_free)
        self.spans.append((start, end, kind, name, nbytes, micro))
        return end


class Player:
    """Plays one rank's stream on a machine: compute on one clock, collectives beside it."""

    def __init__(self, machine, ranks, slowdown, link):
        self.m, self.slow = machine, slowdown
        self.comm = _Comm(machine, ranks, link)
        self.t = 0.0
        self.ledger = dict.fromkeys(LEDGER, 0.0)
        self.pending = {}  # collective op index -> its end
        self.buckets = []  # this backward's DDP bucket all-reduces: their ends

    def op_seconds(self, op):
        return self.m.op_s(op) * self.slow

    def compute(self, work, kind):
        """Advance the compute clock by ``work`` seconds of compute, slower while a collective
        takes its share of the core."""
        share, t, left = self.m.comm_cpu_share, self.t, work
        while left > 0 and share > 0:
            running = [e for s, e, *_ in self.comm.spans if s <= t < e]
            if not running:
                later = [s for s, *_ in self.comm.spans if s > t]
                if not later or t + left <= min(later):
                    break
                left -= min(later) - t
                t = min(later)
                continue
            until, rate = min(running), 1.0 - share
            if t + left / rate <= until:
                t, left = t + left / rate, 0.0
            else:
                left -= (until - t) * rate
                t = until
        end = t + left
        self.ledger[kind] += end - self.t
        self.t = end

    def wait(self, until):
        if until > self.t:
            self.ledger["exposed_comm"] += until - self.t
            self.t = until


def play(stream, machine, *, ranks, slowdown=1.0, link=None, rank=0, caps=(2**20, 25 * 2**20)):
    """Play a simulated step's ``stream`` on ``machine``: (seconds, ledger, rows, comm spans).
    ``ranks``: the ranks each collective spans; ``slowdown``: how much slower this rank computes
    than alone (ranks sharing cores); ``link``: a simulated link (gbps, latency_us) or None;
    ``caps``: DDP's bucket caps in bytes (the first bucket's, the others')."""
    p = Player(machine, ranks, slowdown, link)
    p.compute(machine.step_s, "other")
    rows, opened = [], {}
    launches = ddp_buckets(stream, caps)

    def row(kind, name, start, end, micro, nbytes=0):
        rows.append((rank, 0, micro, kind, name, start, end, nbytes))

    for i, e in enumerate(stream):
        if isinstance(e, Op):
            if e.kind == "collective":
                p.pending[e.index] = p.comm.run(e.shape[0], e.bytes, p.t, e.shape[0], e.micro)
            else:
                kind = "recompute" if e.recompute else _KIND.get(e.phase, "other")
                p.compute(p.op_seconds(e), kind)
            continue
        what, micro = e.what, e.micro
        if i in launches:
            bucket, nbytes = launches[i]
            p.buckets.append(p.comm.run("allreduce", nbytes, p.t, f"bucket {bucket}", micro))
        elif what == "wait":
            p.wait(p.pending.pop(e.block, 0.0))
        elif what == "backward_end":
            p.wait(max(p.buckets, default=0.0))  # DDP's finalizer waits for every bucket
            p.buckets = []
        elif what == "optimizer_end":
            p.wait(max(p.pending.values(), default=0.0))  # ZeRO-1's broadcasts: waited on
            p.pending.clear()
        timeline_row(e, p.t, opened, row)
    for start, end, kind, name, nbytes, micro in p.comm.spans:
        row("allreduce" if kind == "allreduce" else kind, name, start, end, micro, nbytes)
    return p.t, p.ledger, rows, p.comm.spans


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
