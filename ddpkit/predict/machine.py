"""What one op, one collective and one step's fixed work take on a machine: the rates a
step-time prediction (`steptime.py`) applies to a simulated step's ops (`optrace.py`).

A `Machine` is plain data (it is saved as JSON, never as a pickle: nothing loaded from disk can
run code). Two kinds exist:

* **this machine**, measured (`calibrate.py`): the time of a matrix product by its shape and
  dtype (a grid of measured shapes, interpolated in log space), of attention by its shape, the
  bytes per second of memory-bound ops (by op where measured, else the median), the cost of
  each op the framework dispatches (forward: Python, the dispatcher and autograd's recording;
  backward: autograd's engine; the optimizer's Python loop), each collective's time by size
  and ranks over the real transport (gloo on loopback), what a rank loses when more ranks than
  cores share the machine, and a step's fixed work (the loop, DDP's reducer);
* **a named device** (`hardware.py`): a roofline from its published peak FLOP/s and memory
  bandwidth with stated efficiency factors, and a link model for its collectives.
"""
from __future__ import annotations

import bisect
import dataclasses
import math


def _interp(xs, ys, x):
    """Piecewise-linear interpolation of ys over sorted xs, held flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclasses.dataclass
class Machine:
    """Rates of one machine (per rank: ``threads`` threads each, ``ranks`` ranks sharing it when
    measured). Every time is in seconds, every rate in units per second.

    ``gemm[dtype]``: {"sizes": [s...], "flops_per_s": nested [m][n][k]} over the grid of sizes;
    ``attention[dtype]``: {"forward"/"backward": [(flops, flops_per_s)...]} by size;
    ``memory``: {"bytes_per_s": [(bytes, rate)...], "ops": {name: factor}} (an op's bytes per
    second is the rate at its size times its factor); ``overhead``: seconds per dispatched op
    by phase ("forward", "backward", "optimizer", "other"); ``collectives``: {"allreduce/2":
    [(bytes, seconds)...], ...}; ``step_s``: a step's fixed work; ``per_param_s``: DDP's
    per-parameter work in a synced backward; ``contention``: {"ranks/cores": slowdown}.
    ``peak_flops``: {dtype: FLOP/s} where a device's peak is known (for MFU)."""
    name: str
    kind: str = "measured"
    threads: int = 1
    gemm: dict = dataclasses.field(default_factory=dict)
    attention: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    overhead: dict = dataclasses.field(default_factory=dict)
    collectives: dict = dataclasses.field(default_factory=dict)
    step_s: float = 0.0
    per_param_s: float = 0.0
    contention: dict = dataclasses.field(default_factory=dict)
    kernel_s: float = 0.0
    """A device kernel's fixed cost (a roofline's; a CPU op's is in its measured rate)."""
    comm_cpu_share: float = 0.0
    """The share of a collective's time that takes a core from compute (CPU ranks: gloo copies
    and adds on the rank's own cores; a GPU's collectives run beside its compute: 0)."""
    peak_flops: dict = dataclasses.field(default_factory=dict)
    replayed: dict = dataclasses.field(default_factory=dict)
    """Seconds of each op run again here at its own shapes (`replay`), by its recipe; None
    for an op that could not be rebuilt (its time then comes from the rate tables)."""
    factor: dict = dataclasses.field(default_factory=dict)
    """What an op costs inside a real step over what it costs run alone (caches cold, its
    output newly allocated, the other rank beside it), by "phase/op name" as measured on the
    reference steps, and by "phase/memory" and "phase/compute" for ops they do not run; 1
    where nothing was measured."""
    per_byte: dict = dataclasses.field(default_factory=dict)
    """What an op costs inside a real step beyond its cost alone, in seconds per byte it moves,
    by "phase/memory" and "phase/compute" (its operands come from memory, not a cache kept hot
    by running it again; its output's pages are new): fitted on the reference steps. Where it
    is known it replaces ``factor``, which grows wrong with an op's size (a small op's ratio is
    not a large one's)."""
    key: str = ""
    """What the figures were measured for (host, processor, torch, threads): a cache key."""
    notes: list = dataclasses.field(default_factory=list)

    # --- compute
    def op_s(self, op):
        """Seconds of one `optrace.Op` (not a collective): the framework's cost of dispatching
        it in its phase (a recompute's ops are dispatched as a forward's) and its work."""
        phase = "forward" if op.recompute else (op.phase or "other")
        host = self.overhead.get(phase + "_view" if op.kind == "view" else phase, 0.0)
        work = 0.0
        alone = self.replayed.get(repr(op.recipe)) if op.recipe is not None else None
        if alone is not None and op.kind != "view":
            return host + self._inside(op, alone)
        if op.kind == "matmul":
            work = self.gemm_s(op.shape, op.dtype)
        elif op.kind == "attention":
            which = "backward" if op.name.endswith("backward") else "forward"
            work = self.attention_s(op.flops, which, op.dtype)
        elif op.kind == "memory" and op.bytes:  # one that moves nothing costs its dispatch
            work = self.memory_s(op.name, op.bytes)
        if self.kind == "roofline":  # the device runs it while the host issues the next ones
            return max(host, work + self.kernel_s) if op.kind != "view" else host
        return host + self._inside(op, work)

    def _inside(self, op, alone):
        """What ``op`` costs inside a step, ``alone`` its cost run alone: plus its bytes at its
        phase's and kind's cost per byte where that was fitted, else times its factor (its
        phase's and name's, else its phase's and kind's) (`calibrate.fit_costs`)."""
        kind = "memory" if op.kind == "memory" else "compute"
        per_byte = self.per_byte.get(f"{op.phase}/{kind}")
        if per_byte is not None:
            return alone + per_byte * op.bytes
        f = self.factor
        return alone * (f.get(f"{op.phase}/{op.name}") or f.get(f"{op.phase}/{kind}", 1.0))

    def needs_tables(self):
        """Is this a measured machine whose rate tables are not measured yet?"""
        return self.kind == "measured" and not self.gemm

    # --- a CUDA rank: the host issues, the device runs (`gpuplay`)
    def host_s(self, op):
        """Seconds the host spends issuing ``op`` (a CUDA rank's Python thread: dispatch,
        autograd's recording, the kernel's launch; a recompute's ops cost as a forward's)."""
        phase = "forward" if op.recompute else (op.phase or "other")
        return self.overhead.get(phase + "_view" if op.kind == "view" else phase,
                                 self.overhead.get(phase, 0.0))

    def device_s(self, op):
        """Seconds ``op``'s kernel runs on the device (not a view, not a collective): a matrix
        product at its shape (and never faster than moving its operands), attention at its
        kernel's rate (a causal kernel skips the masked half of what torch's formula counts),
        a memory-bound op at the bandwidth; plus a kernel's fixed cost."""
        if op.kind == "matmul":
            work = max(self.gemm_s(op.shape, op.dtype), self.memory_s(op.name, op.bytes))
        elif op.kind == "attention":
            which = "backward" if op.name.endswith("backward") else "forward"
            work = self.attention_s(op.flops * (0.5 if op.causal else 1.0), which, op.dtype)
        else:
            work = self.memory_s(op.name, op.bytes)
        return work + self.kernel_s

    def gemm_s(self, shape, dtype):
        """Seconds of a matrix product (batch, m, n, k) in ``dtype``."""
        table = self.gemm.get(dtype) or self.gemm.get("float32")
        b, m, n, k = shape
        if "roofline" in table:  # a short inner dimension leaves each tile's epilogue unhidden
            ramp = k / (k + table.get("k_half", 0))
            return 2 * b * m * n * k / (table["roofline"] * ramp)
        sizes = [math.log(s) for s in table["sizes"]]
        rate = math.exp(_trilinear(sizes, table["log_rate"], math.log(max(m, 1)),
                                   math.log(max(n, 1)), math.log(max(k, 1))))
        return b * 2 * m * n * k / rate

    def attention_s(self, flops, which, dtype):
        table = self.attention.get(dtype) or self.attention.get("float32") or {}
        if "roofline" in table:
            return flops / table.get("roofline_" + which, table["roofline"])
        points = table.get(which)
        if not points:
            return flops / self.gemm_s_rate(dtype)
        xs, ys = zip(*points)
        return flops / math.exp(_interp([math.log(x) for x in xs], [math.log(y) for y in ys],
                                        math.log(max(flops, 1))))

    def gemm_s_rate(self, dtype):
        """The largest measured matrix-product rate (FLOP/s) in ``dtype``."""
        table = self.gemm.get(dtype) or self.gemm.get("float32")
        if "roofline" in table:
            return table["roofline"]
        return math.exp(max(v for plane in table["log_rate"] for row in plane for v in row))

    def memory_s(self, name, nbytes):
        """Seconds a memory-bound op moving ``nbytes`` takes."""
        if "bandwidth" in self.memory:
            return nbytes / (self.memory["bandwidth"] * self.memory.get("ops", {}).get(name, 1.0))
        points = self.memory["bytes_per_s"]
        xs, ys = zip(*points)
        rate = math.exp(_interp([math.log(x) for x in xs], [math.log(y) for y in ys],
                                math.log(max(nbytes, 1))))
        return nbytes / (rate * self.memory.get("ops", {}).get(name, 1.0))

    # --- communication
    def collective_s(self, kind, nbytes, ranks):
        """Seconds of one collective of ``nbytes`` (its payload) over ``ranks`` ranks."""
        if ranks < 2:
            return 0.0
        if "link" in self.collectives:
            return self._ring_s(kind, nbytes, ranks)
        points = self.collectives.get(f"{kind}/{ranks}") or self._nearest(kind, ranks)
        if not points:
            return 0.0
        xs, ys = zip(*points)
        if nbytes >= xs[-1]:  # beyond the largest measured: its bandwidth, and its latency
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
            return ys[-1] + slope * (nbytes - xs[-1])
        return math.exp(_interp([math.log(max(x, 1)) for x in xs], [math.log(y) for y in ys],
                                math.log(max(nbytes, 1))))

    def _ring_s(self, kind, nbytes, ranks):
        """NCCL's ring (a named device's `hardware` links): ``volume x (N-1)/N x B`` at the
        ring's bus bandwidth plus a latency per ring step, B the gathered (or reduced) size
        (an all-gather's or reduce-scatter's payload counts its shard too: B is N/(N+1) of it).
        Inside a node the bus is the node's link (all-reduce's own where NVLink SHARP lifts
        it); a ring spanning nodes runs at its slower part: the node's link, or the cards
        between two nodes (GPUs per node x each GPU's card), with the network's latency."""
        volume = 2 if kind == "allreduce" else 1
        if kind in ("allgather", "reduce_scatter"):
            nbytes = nbytes * ranks / (ranks + 1)
        bus, alpha = self.collectives["link"]
        if kind == "allreduce":
            bus = self.collectives.get("link_allreduce", bus)
        per_node = min(ranks, self.collectives.get("node", ranks))
        if ranks > per_node:
            net_bus, net_alpha = self.collectives.get("network") or (bus / per_node, alpha)
            bus, alpha = min(bus, per_node * net_bus), max(alpha, net_alpha)
        return volume * (ranks - 1) / ranks * nbytes / bus + volume * (ranks - 1) * alpha

    def _nearest(self, kind, ranks):
        """A measured rank count's figures scaled to ``ranks`` by the ring's 2(N-1)/N (or
        (N-1)/N) volume and its 2(N-1) steps: for counts the calibration did not run."""
        have = sorted(int(k.split("/")[1]) for k in self.collectives if k.startswith(kind + "/"))
        if not have:
            return None
        n0 = min(have, key=lambda n: abs(n - ranks))
        f = ((ranks - 1) / ranks) / ((n0 - 1) / n0)
        return [(b, s * f) for b, s in self.collectives[f"{kind}/{n0}"]]

    def slowdown(self, ranks, cores):
        """How much slower a rank computes with ``ranks`` ranks of ``threads`` threads on
        ``cores`` cores than alone (measured where the calibration ran that many)."""
        if self.kind != "measured":
            return 1.0
        key = f"{ranks}/{cores}"
        if key in self.contention:
            return self.contention[key]
        return max(1.0, ranks * self.threads / max(cores, 1))

    def to_json(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data):
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _trilinear(axes, grid, x, y, z):
    """Trilinear interpolation on a cubic grid with the same axis for m, n, k (values held flat
    beyond the grid's ends)."""
    def locate(v):
        if v <= axes[0]:
            return 0, 0.0
        if v >= axes[-1]:
            return len(axes) - 2, 1.0
        i = bisect.bisect_right(axes, v) - 1
        return i, (v - axes[i]) / (axes[i + 1] - axes[i])
    (i, fx), (j, fy), (k, fz) = locate(x), locate(y), locate(z)
    out = 0.0
    for di, wx in ((0, 1 - fx), (1, fx)):
        for dj, wy in ((0, 1 - fy), (1, fy)):
            for dk, wz in ((0, 1 - fz), (1, fz)):
                w = wx * wy * wz
                if w:
                    out += w * grid[i + di][j + dj][k + dk]
    return out
