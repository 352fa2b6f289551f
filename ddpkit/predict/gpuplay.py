"""A CUDA rank's step, played with CUDA's semantics: the host issues, the GPU's streams run.

`player.play` times a CPU rank, where an op's time is the time the rank spends on it. A CUDA
rank's Python thread only *issues* work: each op costs the host its dispatch (Python, the
dispatcher, autograd; `Machine.host_s`) and queues a kernel on a stream, which runs when the
stream is free and the host has issued it (`Machine.device_s`). So the host runs ahead of the
GPU while kernels are long, and the GPU idles while the host issues many short ones; a step
ends when its last work ends (``train_step`` reads the loss: one sync per step). What is
modelled, exactly:

* **streams**: op ``o`` on stream ``s`` (`optrace.Op.stream`; 0 is the compute stream) starts
  at ``max(host time after issuing o, end of the work queued on s before o, the end of any
  collective o waits for)``; views and ops that launch no kernel (``empty``, profiler ranges;
  `NO_KERNEL`) cost the host only;
* **events** (FSDP2's own, recorded by `cudastreams`): ``record`` stamps the time stream ``s``
  reaches that point; ``wait_event``/``wait_stream`` hold a stream back until then;
  ``synchronize`` holds the host;
* **collectives** take the network one after another (`Machine.collective_s`: the ring over
  NVLink or the nodes' cards). On a side stream (FSDP2's all-gather and reduce-scatter
  streams) a collective occupies that stream, as NCCL's synchronous ops do; on the compute
  stream (ZeRO-1's broadcasts) it runs on NCCL's own stream from the point it is issued, and
  the first op reading its output waits for it (the stream's ``wait`` marks), on that op's
  stream;
* **DDP** hands each bucket to NCCL's stream when its last gradient is ready (the stream's
  ``grad`` marks, as `marks.ddp_buckets` lays them out): it starts once the compute
  stream has run the work queued before that point; the backward's end waits for every
  bucket (DDP's finalizer makes the compute stream wait);
* **FSDP2's prefetch** needs nothing more: its all-gathers are issued on their streams as
  soon as the host reaches them (block i+1's while block i computes), bounded by its events.

The ledger accounts the compute stream's time: a gap before a kernel is ``exposed_comm``
where a collective or another stream held it back, else the kernel's kind (the host was
issuing: the framework's cost); a kernel's own time is its kind. NCCL's kernels take SMs
from compute while both run: a kernel that starts while a collective runs is slower by
``Machine.comm_cpu_share`` (a named device's is `hardware.NCCL_SM_SHARE`). Not modelled: the
caching allocator's own syncs and retries near a full GPU, clocks lowered by a power limit;
and the simulation's autocast is CPU autocast (a CPU build cannot run CUDA's): its
lower-precision list has the same matrix products and attention as CUDA's, but CUDA's fp32
list (the norms, softmax, losses, ``pow``/``exp``/``rsqrt``) is longer, so such an op runs in
its input's dtype (bf16 after a bf16 matmul) where a GPU would run it in fp32. transformers' models compute those
in fp32 themselves (Llama's RMSNorm upcasts, the causal-LM loss upcasts the logits), and FSDP's
mixed precision runs without autocast.
"""
from __future__ import annotations

from .marks import ddp_buckets, lanes, timeline_row
from .optrace import Mark, Op

NO_KERNEL = frozenset({
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize_",
    "set_", "record_stream", "_record_function_enter_new", "_record_function_exit",
    "_local_scalar_dense"})
"""Ops that launch no kernel on a CUDA rank: allocations, profiler ranges, a scalar read of a
CPU tensor (the optimizer's step counts live on the CPU unless ``capturable``)."""
_KIND = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}
LEDGER = ("forward", "backward", "recompute", "exposed_comm", "optimizer", "other")


class _Network:
    """Collectives one after another on the rank's links."""

    def __init__(self, machine, ranks):
        self.machine, self.ranks, self.free, self.spans = machine, ranks, 0.0, []

    def run(self, kind, nbytes, group, ready, name, micro):
        start = max(ready, self.free)
        end = start + self.machine.collective_s(kind, nbytes, group if group > 1 else self.ranks)
        self.free = end
        self.spans.append((start, end, kind, name, nbytes, micro))
        return end


class CudaRank:
    """One CUDA rank's clocks: the host's, each stream's, each event's last record."""

    def __init__(self, machine, ranks):
        self.m = machine
        self.net = _Network(machine, ranks)
        self.host = 0.0
        self.dev = {0: 0.0}
        self.events, self.pending, self.buckets, self.waits = {}, {}, [], []
        self.ledger = dict.fromkeys(LEDGER, 0.0)
        self.acc = 0.0  # the compute stream's time the ledger has accounted for

    def _account(self, new, held, kind):
        """The compute stream moves to ``new``: the part held back past the host's time by
        ``held`` (a collective's or another stream's end) is exposed communication, the rest
        ``kind``."""
        if new <= self.acc:
            return
        comm = max(0.0, min(new, held) - max(self.acc, self.host))
        self.ledger["exposed_comm"] += comm
        self.ledger[kind] += new - self.acc - comm
        self.acc = new
        self.dev[0] = max(self.dev[0], new)

    def op(self, op):
        self.host += self.m.host_s(op)
        if op.kind == "collective":
            return self._collective(op)
        s, held = op.stream, max(self.waits, default=0.0)
        self.waits = []
        work = 0.0 if op.kind == "view" or op.name in NO_KERNEL else self.m.device_s(op)
        if work <= 0:  # a view of a collective's output: its stream's next kernels wait
            if held:
                self.hold(s, held, op.phase)
            return
        start = max(self.host, self.dev.get(s, 0.0), held)
        work *= self._interference(start, work)
        if s == 0:
            kind = "recompute" if op.recompute else _KIND.get(op.phase, "other")
            self._account(start, held, kind)
            self._account(start + work, 0.0, kind)
        else:
            self.dev[s] = start + work

    def _interference(self, start, work):
        share = self.m.comm_cpu_share
        if not share or not any(a < start + work and b > start for a, b, *_ in self.net.spans):
            return 1.0
        return 1.0 / (1.0 - share)

    def _collective(self, op):
        s = op.stream
        ready = max(self.host, self.dev.get(s, 0.0), max(self.waits, default=0.0))
        self.waits = []
        end = self.net.run(op.shape[0], op.bytes, op.group, ready, op.shape[0], op.micro)
        self.pending[op.index] = end
        if s != 0:  # FSDP2's streams: NCCL's synchronous op holds its stream
            self.dev[s] = end

    def hold(self, stream, until, phase):
        """Stream ``stream`` waits until ``until`` (an event's or another stream's time)."""
        if stream == 0:
            self._account(max(self.dev[0], until), until, _KIND.get(phase, "other"))
        else:
            self.dev[stream] = max(self.dev.get(stream, 0.0), until)

    def mark(self, e, launch=None):
        what = e.what
        if launch is not None:  # a DDP bucket: NCCL's stream waits for the compute stream
            bucket, nbytes = launch
            ready = max(self.host, self.dev[0])
            self.buckets.append(self.net.run("allreduce", nbytes, 0, ready, f"bucket {bucket}",
                                             e.micro))
        if what == "wait":
            self.waits.append(self.pending.pop(e.block, 0.0))
        elif what == "record":
            self.events[e.block] = max(self.dev.get(e.stream, 0.0), self.host)
        elif what == "wait_event":
            self.hold(e.stream, self.events.get(e.block, 0.0), e.phase)
        elif what == "wait_stream":
            self.hold(e.stream, self.dev.get(e.block, 0.0), e.phase)
        elif what == "sync_event":
            self.host = max(self.host, self.events.get(e.block, 0.0))
        elif what == "backward_end":  # DDP's finalizer: the compute stream waits for buckets
            self.hold(0, max(self.buckets, default=0.0), "backward")
            self.buckets = []
        elif what == "optimizer_end":  # ZeRO-1's broadcasts are waited on
            self.hold(0, max(self.pending.values(), default=0.0), "optimizer")
            self.pending.clear()

    def now(self):
        """The time the compute stream reaches the point the host has issued up to."""
        return max(self.dev[0], self.host)

    def finish(self):
        """The step's end: the loss is read (the host waits for the compute stream), and every
        stream's and collective's work is done."""
        ends = [self.host, *self.dev.values(), self.net.free]
        end = max(ends)
        comm = max([self.net.free] + [v for k, v in self.dev.items() if k != 0])
        self._account(end, comm, "other")
        return end


def play_cuda(stream, machine, *, ranks, rank=0, caps=(2**20, 25 * 2**20)):
    """Play a CUDA rank's simulated ``stream`` on ``machine`` (a named device's roofline or a
    GPU's calibration): (seconds, ledger, rows, comm spans), as `player.play` returns."""
    r = CudaRank(machine, ranks)
    (rows, row), opened = lanes(rank), {}
    launches = ddp_buckets(stream, caps)

    for i, e in enumerate(stream):
        if isinstance(e, Op):
            r.op(e)
            continue
        r.mark(e, launches.get(i))
        if isinstance(e, Mark):
            timeline_row(e, r.now(), opened, row)
    seconds = r.finish()
    for start, end, kind, name, nbytes, micro in r.net.spans:
        row(kind, name, start, end, micro, nbytes)
    return seconds, r.ledger, rows, r.net.spans
