"""What DDP does during a step, as timed rows: forward and backward per block, the recompute of
checkpointed regions inside backward, each bucket's all-reduce, the optimizer step. And a
simulated network link that all-reduces go no faster than.

`TimelineProbe` records, on the steps it probes (``TrainConfig.timeline_every``), one row per
event: ``(rank, step, micro_step, kind, name, start_s, end_s, bytes)``.

* ``forward``: module forward pre-hooks and hooks on each block and on the model (``stem``: the
  model's start to the first block; ``head``: the last block to the model's end, the loss in it).
* ``backward``: gradient hooks on tensors. A block's backward starts when the gradient of its
  output is computed and ends when the gradient of its input is (a hook on each; torch's
  ``register_full_backward_hook`` does the same with wrapper nodes that break on in-place
  outputs). ``head``: from the loss's gradient to the last block's; ``stem``: from the first
  block's input gradient to the end of the autograd pass (a callback queued on torch's engine,
  as DDP queues its own finalizer).
* ``recompute``: a checkpointed region's forward run again inside backward (the policy's region
  function, timed when it runs outside the model's forward).
* ``allreduce``: one per DDP bucket, from the DDP comm hook (``CommCounter``'s, wrapping the
  default all-reduce): start when DDP hands the bucket over, end in ``Future.then``. On gloo the
  callback runs on gloo's worker thread once the collective is done. On NCCL the future completes
  when the kernel is *queued* (torch's ``Future.then`` docstring), so the rows are CUDA events
  (one recorded in the hook on the current stream, one in the callback, whose current stream
  torch synchronises with the all-reduce) read after the step; so are all other rows on CUDA.
* ``optimizer``: the optimizer's step pre- and post-hooks.

Clocks. Every row is ``time.time_ns()`` (CLOCK_REALTIME), the clock DDP's reducer timer and the
torch profiler stamp their events with, so the three compare with no conversion; times are
seconds since rank 0's reading at a start-up barrier. Ranks on one host read one system clock:
the alignment error is zero (a reading costs ~50 ns). Ranks on several hosts: each rank's offset
to rank 0 is the median over 5 rounds of (its reading - rank 0's) right after a barrier, and the
error is at most the slowest of those barriers (``clock_error_s`` in the first probed record).

The link (``link_gbps``, ``link_latency_us``) is a **simulation**: a ring all-reduce of B bytes
over N ranks sends 2(N-1)/N x B bytes through each link in 2(N-1) steps, so it takes at least
``2(N-1)/N * B * 8 / bandwidth + 2(N-1) * latency``. Buckets share the link one after another.
The comm hook's future completes no earlier than that (the ``then`` callback waits on the thread
that completes it: gloo's worker thread), so DDP's backward waits for it as it would for a real
network. Gloo only: with NCCL the callback runs at queue time on the host and cannot delay the GPU.
"""
from __future__ import annotations

import socket
import statistics
import threading
import time
from contextlib import contextmanager

import torch

KINDS = ("forward", "backward", "recompute", "allreduce", "optimizer")


def ring_allreduce_s(nbytes, world_size, gbps=None, latency_us=0.0):
    """Seconds a ring all-reduce of ``nbytes`` takes over links of ``gbps`` Gbit/s and
    ``latency_us`` per message: 2(N-1)/N x bytes on the wire, 2(N-1) steps of latency."""
    n = world_size
    if n < 2:
        return 0.0
    wire = 2 * (n - 1) / n * nbytes * 8 / (gbps * 1e9) if gbps else 0.0
    return wire + 2 * (n - 1) * latency_us * 1e-6


class SimulatedLink:
    """A network link all-reduces wait for (a simulation: see the module docstring)."""

    def __init__(self, world_size, gbps=None, latency_us=0.0):
        self.world_size, self.gbps, self.latency_us = world_size, gbps, latency_us
        self._free_ns = 0
        self._lock = threading.Lock()

    def book(self, nbytes, start_ns):
        """The time this all-reduce may finish: after the previous one left the link."""
        with self._lock:
            begin = max(start_ns, self._free_ns)
            self._free_ns = begin + int(1e9 * ring_allreduce_s(nbytes, self.world_size,
                                                                self.gbps, self.latency_us))
            return self._free_ns

    def describe(self):
        bw = f"{self.gbps:g} Gbit/s" if self.gbps else "unlimited bandwidth"
        return f"simulated link: {bw}, {self.latency_us:g} us latency"


class _CudaClock:
    """Stamps are CUDA events on the current stream, read after the step against a reference
    event recorded on an idle device (after a synchronize) at a known host time."""

    def __init__(self):
        self.ref = self.ref_ns = None

    def start(self):
        torch.cuda.synchronize()
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref_ns = time.time_ns()

    def stamp(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def read(self, ev):
        return self.ref_ns + int(self.ref.elapsed_time(ev) * 1e6)  # elapsed_time: ms


class _HostClock:
    def start(self):
        pass

    @staticmethod
    def stamp():
        return time.time_ns()

    @staticmethod
    def read(t):
        return t


def _first_tensor(obj):
    """The first tensor that requires grad in a module's inputs or outputs (a loss, logits,
    a ModelOutput's first field)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    if isinstance(obj, dict) or hasattr(obj, "values") and hasattr(obj, "keys"):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


class TimelineProbe:
    """``probe.step(step, model, optimizer)`` around each optimizer step; on the probed ones
    ``probe.rows`` holds its events. ``watch`` is the comm hook's observer (`CommCounter`)."""

    def __init__(self, rank, world_size, device, every, link=None):
        self.rank, self.world_size, self.every, self.link = rank, world_size, every, link
        self.clock = _CudaClock() if torch.device(device).type == "cuda" else _HostClock()
        self.origin_ns, self.offset_ns, self.clock_error_s = 0, 0, 0.0
        self.ddp = None  # DDP's own runtime statistics are read beside the rows (`attach`)
        self._first = True
        self.active = False
        self.rows, self.window, self.ddp_stats = [], None, []
        self._raw, self._handles, self._lock = [], [], threading.Lock()
        self._ddp_seen, self._read_next = 0, False
        self.step_index = self.micro = -1
        self.phase = None

    @classmethod
    def from_plan(cls, plan, ctx):
        """The probe a plan asks for (``timeline_every``, ``link_gbps``,
        ``link_latency_us``), or None when it asks for neither."""
        simulate = plan.link_gbps is not None or plan.link_latency_us > 0
        if not plan.timeline_every and not simulate:
            return None
        link = SimulatedLink(ctx.world_size, plan.link_gbps, plan.link_latency_us) \
            if simulate else None
        return cls(ctx.rank, ctx.world_size, ctx.device, plan.timeline_every, link)

    def attach(self, wrapped):
        """After wrapping (collective): align the clocks; read DDP's own statistics of every
        synced iteration beside ours (``_set_ddp_runtime_logging_sample_rate(1)``: a few
        clock reads per iteration)."""
        if self.every:
            self.align()
            if hasattr(wrapped, "_get_ddp_logging_data"):
                self.ddp = wrapped
                wrapped._set_ddp_runtime_logging_sample_rate(1)
        return self

    def record_fields(self):
        """What this step adds to its record: the rows and the step's window on probed steps,
        DDP's statistics read since the last record, and the link when one is simulated."""
        out = {}
        if self.window is not None:
            out.update(timeline=self.rows, timeline_window=self.window)
            if self._first:  # the origin, on this rank's clock: other tools' ns map onto ours
                out.update(clock_error_s=self.clock_error_s,
                           clock_origin_ns=self.origin_ns + self.offset_ns)
                self._first = False
            if self.link is not None:
                out["simulated_link"] = self.link.describe()
            self.rows, self.window = [], None
        if self.ddp_stats:
            out["ddp_stats"], self.ddp_stats = self.ddp_stats, []
        return out

    # --- clocks
    def align(self):
        """Collective: rank 0's clock is the origin; ranks on other hosts measure their offset."""
        import torch.distributed as dist

        if not dist.is_initialized():
            self.origin_ns = time.time_ns()
            return
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        t = torch.zeros(1, dtype=torch.int64)
        if len(set(hosts)) > 1:
            offsets, spans = [], []
            for _ in range(5):
                b0 = time.time_ns()
                dist.barrier()
                now = time.time_ns()
                spans.append(now - b0)
                got = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
                dist.all_gather(got, torch.tensor([now]))
                offsets.append(now - got[0].item())
            self.offset_ns = int(statistics.median(offsets))
            err = torch.tensor([max(spans)], dtype=torch.int64)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            self.clock_error_s = err.item() / 1e9
        dist.barrier()
        t[0] = time.time_ns() - self.offset_ns
        dist.broadcast(t, 0)
        self.origin_ns = t.item()

    def _s(self, stamp):
        return (self.clock.read(stamp) - self.offset_ns - self.origin_ns) / 1e9

    def probed(self, step):
        """Steps every-1, 2*every-1, ...: the last of each window, never the first step (its
        one-off costs, DDP's bucket rebuild among them, are not typical); every=1: all."""
        return bool(self.every) and step % self.every == self.every - 1

    # --- one step
    @contextmanager
    def step(self, step, model, optimizer, policy=None):
        """Around one optimizer step; records when ``step`` is probed. ``model``: the plain
        module; ``policy``: the `CheckpointPolicy` installed on it (its blocks are the stacks
        the policy was applied to, in order; each run of its regions is timed)."""
        read_after = self._read_next  # DDP logs an iteration's timers at the next synced forward
        if not self.probed(step):
            yield self
            if read_after:
                self._read_ddp()
            return
        self.rows, self._raw, self.step_index, self.micro = [], [], step, -1
        self.clock.start()
        self._install(model, optimizer, policy)
        self.active = True
        t0 = self.clock.stamp()
        try:
            yield self
        finally:
            t1 = self.clock.stamp()
            self.active = False
            for h in self._handles:
                h.remove()
            self._handles = []
            if policy is not None:
                policy.on_region = None
            self.phase = None
        if self.clock.__class__ is _CudaClock:
            torch.cuda.synchronize()
        self.window = (self._s(t0), self._s(t1))
        self.rows = [(self.rank, step, micro, kind, name, self._s(a), self._s(b), nbytes)
                     for micro, kind, name, a, b, nbytes in self._raw]
        self._read_next = self.ddp is not None
        self._read_ddp()

    def _read_ddp(self):
        """DDP's runtime statistics of the iterations logged since the last read (times in ns
        since the epoch, as ours: turned into timeline seconds)."""
        self._read_next = False
        if self.ddp is None:
            return
        d = self.ddp._get_ddp_logging_data()
        it = d.get("iteration", 0)
        if not it or it == self._ddp_seen or "backward_comm_time_start" not in d:
            return
        self._ddp_seen = it
        out = {"iteration": it, "bucket_sizes": d.get("bucket_sizes", ""),
               "rebuilt_bucket_sizes": d.get("rebuilt_bucket_sizes", "")}
        for key in ("forward_compute_time_start", "backward_compute_time_start",
                    "backward_compute_time_end", "backward_comm_time_start",
                    "backward_comm_time_end"):
            out[key.replace("time_", "") + "_s"] = \
                (d[key] - self.offset_ns - self.origin_ns) / 1e9 if d.get(key) else None
        for key in ("backward_compute_time", "backward_comm_time",
                    "backward_compute_comm_overlap_time", "avg_backward_compute_time",
                    "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time"):
            out[key + "_s"] = d.get(key, 0) / 1e9
        self.ddp_stats.append(out)

    def _add(self, kind, name, start, end, nbytes=0, micro=None):
        with self._lock:  # all-reduce rows come from gloo's threads
            self._raw.append((self.micro if micro is None else micro, kind, name, start, end,
                              nbytes))

    # --- hooks, installed for a probed step only (nothing runs on the others)
    def _install(self, model, optimizer, policy):
        stamp, add, handles = self.clock.stamp, self._add, self._handles
        state = {}

        def model_pre(module, args):
            self.micro += 1
            self.phase = "forward"
            state.update(model_start=stamp(), bwd={}, fwd={}, first=None, last=None)

        def model_post(module, args, out):
            end = stamp()
            self.phase = "backward"  # whatever runs from here until the next forward
            first, last = state["first"], state["last"]
            if first is None:
                add("forward", "model", state["model_start"], end)
            else:
                add("forward", "stem", state["model_start"], state["fwd"][first][0])
                add("forward", "head", state["fwd"][last][1], end)
            t = _first_tensor(out)
            if t is not None:
                micro = self.micro
                t.register_hook(lambda g: self._backward_started(state, micro))

        handles.append(model.register_forward_pre_hook(model_pre))
        handles.append(model.register_forward_hook(model_post))
        stacks = policy.containers if policy is not None else ()  # the stacks it was put on
        for i, block in enumerate(b for stack in stacks for b in stack):
            handles.append(block.register_forward_pre_hook(self._block_pre(i, state)))
            handles.append(block.register_forward_hook(self._block_post(i, state)))
        if policy is not None:
            policy.on_region = self._region
        handles.append(optimizer.register_step_pre_hook(
            lambda *a: state.__setitem__("opt", stamp())))
        handles.append(optimizer.register_step_post_hook(
            lambda *a: add("optimizer", "optimizer step", state["opt"], stamp())))

    def _block_pre(self, i, state):
        def hook(module, args):
            t = _first_tensor(args)
            if self.phase == "forward":
                state["fwd"][i] = [self.clock.stamp(), None]
                state["first"] = i if state["first"] is None else state["first"]
            if t is not None and ("in", i) not in state["bwd"]:  # its gradient: backward's end
                state["bwd"][("in", i)] = True
                micro = self.micro
                t.register_hook(lambda g: self._block_backward(state, i, "end", micro))
        return hook

    def _block_post(self, i, state):
        def hook(module, args, out):
            if self.phase == "forward":
                state["fwd"][i][1] = end = self.clock.stamp()
                state["last"] = i
                self._add("forward", f"block {i}", state["fwd"][i][0], end)
            t = _first_tensor(out)  # in a reentrant region: armed at the recompute
            if t is not None and ("out", i) not in state["bwd"]:
                state["bwd"][("out", i)] = True
                micro = self.micro
                t.register_hook(lambda g: self._block_backward(state, i, "start", micro))
        return hook

    def _backward_started(self, state, micro):
        state["bwd_start"] = self.clock.stamp()

        def finished():  # the end of this autograd pass (queued first: runs before DDP's)
            end = self.clock.stamp()
            spans = state.get("bspans", {})
            if not spans:
                self._add("backward", "model", state["bwd_start"], end, micro=micro)
                return
            last, first = max(spans), min(spans)
            self._add("backward", "head", state["bwd_start"],
                      spans[last][0] or state["bwd_start"], micro=micro)
            self._add("backward", "stem", spans[first][1] or end, end, micro=micro)

        torch.autograd.Variable._execution_engine.queue_callback(finished)

    def _block_backward(self, state, i, edge, micro):
        spans = state.setdefault("bspans", {})
        span = spans.setdefault(i, [None, None])
        span[0 if edge == "start" else 1] = now = self.clock.stamp()
        if edge == "end":
            self._add("backward", f"block {i}", span[0] or state.get("bwd_start", now), now,
                      micro=micro)

    def _region(self, fn, name):
        """Wraps a checkpointed region's function: a run outside the model's forward is the
        recompute (torch's early stop ends it with an exception: timed all the same)."""
        def run(*args, **kwargs):
            if self.phase == "forward":
                return fn(*args, **kwargs)
            start = self.clock.stamp()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add("recompute", name, start, self.clock.stamp())
        return run

    # --- the comm hook's observer
    def watch(self, bucket, nbytes, launch):
        """Launch one bucket's all-reduce (``launch()``: the wrapped hook's future); time it
        on probed steps, and hold its future back until the simulated link is done with it."""
        if not self.active and self.link is None:
            return launch()
        record, micro, index = self.active, self.micro, bucket.index()
        start = self.clock.stamp()
        fut = launch()
        deadline = self.link.book(nbytes, time.time_ns()) if self.link is not None else None

        def done(f):
            if deadline is not None:  # on gloo's worker thread, as DDP's own callbacks
                wait = deadline - time.time_ns()
                if wait > 0:
                    time.sleep(wait / 1e9)
            if record:
                self._add("allreduce", f"bucket {index}", start, self.clock.stamp(), nbytes,
                          micro=micro)
            return f.value()
        return fut.then(done)
