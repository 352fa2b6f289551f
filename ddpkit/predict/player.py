"""Playing a CPU rank's simulated step (`optrace.py`: every op it runs, in order) on a
machine's rates (`machine.py`): the seconds, what they went to, its timeline.

One clock runs the rank's compute, op after op: an op takes its dispatch cost plus its matrix
product's, attention's or memory-bound time at its shape and dtype. Communication runs beside
it on the transport: DDP hands each bucket to its all-reduce when the bucket's gradients are
ready (the stream's ``bucket`` marks; none in a ``no_sync`` micro-step), they run one after
another, and the backward's end waits for all of them (DDP's finalizer); a collective op
(ZeRO-1's broadcasts, FSDP2's all-gathers and reduce-scatters) runs when issued and the first op
that reads what it wrote waits for it (FSDP2's prefetch hides an all-gather behind the block
before). Where collectives take a core from compute (gloo's copies and adds on a CPU rank),
compute goes slower while they run, by the share `calibrate.fit_share` measured; the delay is
booked as exposed communication. A simulated link (``link_gbps``) holds each all-reduce until a
ring over that link would be done, buckets one after another on it, as the rank's
`engine.timeline.SimulatedLink` does; that wait holds no core.
"""
from __future__ import annotations

from ..engine.timeline import ring_allreduce_s
from .marks import ddp_buckets, lanes, timeline_row
from .optrace import Op

LEDGER = ("forward", "backward", "recompute", "exposed_comm", "optimizer", "other")
_KIND = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}


class _Comm:
    """The transport: collectives one after another (``free``: when it is next free), each
    also held until a simulated link has carried it (``link``: (gbps, latency_us) or None)."""

    def __init__(self, machine, ranks, link):
        self.machine, self.ranks, self.link = machine, ranks, link
        self.free = self.link_free = 0.0
        self.spans = []  # (start, end, kind, name, bytes, micro)
        self.busy = []  # (start, end) of each collective's own work: a simulated link's wait is not

    def run(self, kind, nbytes, ready, name, micro):
        start = max(ready, self.free)
        end = start + self.machine.collective_s(kind, nbytes, self.ranks)
        self.free = end
        self.busy.append((start, end))
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
        takes its share of the core (the delay is the collective's: booked as exposed)."""
        share, t, left = self.m.comm_cpu_share, self.t, work
        while left > 0 and share > 0:
            running = [e for s, e in self.comm.busy if s <= t < e]
            if not running:
                later = [s for s, _ in self.comm.busy if s > t]
                if not later or t + left <= min(later):
                    break
                left -= min(later) - t
                t = min(later)
                continue
            until, rate = min(running), 1.0 - share
            if rate <= 0.0:  # the collective holds the core: compute waits for its end
                t = until
            elif t + left / rate <= until:
                t, left = t + left / rate, 0.0
            else:
                left -= (until - t) * rate
                t = until
        end = t + left
        self.ledger[kind] += work  # what compute was held back by a collective is its cost
        self.ledger["exposed_comm"] += end - self.t - work
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
    (rows, row), opened = lanes(rank), {}
    launches = ddp_buckets(stream, caps)

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
