"""`Measure`: the probes a run turned on, and when each one reads, as one object for the loop.

``with measure.step(step, changed, model, optimizer, policy) as acts:`` around one optimizer step
(``policy``: the checkpoint policy in force, whose regions the activation probe and the timeline
watch; pass ``acts`` to `train_step` as its activation probe: None on the steps it does not
read), then
``measure.read(model, optimizer)`` for the step's fields of the record (before ``zero_grad``
frees the gradients). The schedules, each with its reason:

* activation bytes are fixed by the checkpoint setting and the batch's shapes, and model-state
  bytes by the model and the optimizer: they are read at the first step, at the step a mid-run
  change lands and every ``peak_every`` steps, and carried between (the activation probe's hook
  on every saved tensor costs ~0.3 ms a micro-batch on a CPU rank);
* the step's peak (`memory.PeakProbe`), and the process's beside it (`process.ProcessProbe`:
  ``process_peak_bytes``, the resident high-water mark on CPU, reserved on CUDA): on CPU its
  profiler window lengthens the step it reads by about a third, so steps 0 (the optimizer
  state is made) and 1 (DDP rebuilds its buckets), every ``peak_every`` steps after, and the
  step a change lands (CUDA's counter is free: every step); the activation probe reads on
  those steps too (the peak's ledger names what it saved);
* all-reduce calls and bytes (DDP's comm hook), every collective of the step
  (`collectives.CollectiveCounter`: ``comm_bytes``, ``comm_by_op``, ``comm_calls``), and the
  step's time: every step;
* the timeline (`timeline.TimelineProbe`): its hooks on the steps ``timeline_every`` picks.

Make it before the model is built: the peak probe counts what is allocated after it.
"""
from __future__ import annotations

import contextlib
import os

from .collectives import CollectiveCounter
from .allocations import cpu_accounting
from .memory import PeakProbe, cuda_history
from .process import ProcessProbe
from .probes import ActivationProbe, StepTimer, state_bytes

STATE_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes")


class Measure:
    """The probes of one run (``plan.probes``) on ``device`` of rank ``rank``; its steps run
    inside `running`."""

    def __init__(self, plan, device, rank=0):
        probes = plan.probes
        self.peak = PeakProbe(device) if "peak" in probes else None  # first: it counts after
        self.process = ProcessProbe(device) if self.peak else None
        self.acts = ActivationProbe() if "activations" in probes else None
        self.timer = StepTimer(device)
        self.collectives = CollectiveCounter() if "comm" in probes else None
        self.cuda = device.type == "cuda"
        self.plan, self.rank, self.comm, self.first, self.timeline = plan, rank, None, 0, None
        self.every = plan.peak_every
        self.states = {}  # model-state bytes: read on the sampled steps, carried between
        self._sample = self._peak = False

    def left_out(self, make, *args):
        """``make(*args)``, its bytes left out of the peak (the dataset: on a GPU run it stays
        in host memory): what this thread allocates meanwhile (`PeakProbe.leaving_out`)."""
        if not self.peak:
            return make(*args)
        with self.peak.leaving_out():
            return make(*args)

    @contextlib.contextmanager
    def running(self, comm, first, timeline=None):
        """Around the run's steps: ``comm``, the DDP comm counter `strategies.wrap` installed
        (None without one), ``first``, the run's first step. At the end, even on an error,
        what the probes switched on for the process is off again (c10's allocation count, the
        kernels on the collective ops): a warm rank's next job runs without them."""
        self.comm, self.first, self.timeline = comm, first, timeline
        try:
            yield self
        finally:
            if self.collectives is not None:
                CollectiveCounter.uninstall()
            if self.peak is not None and not self.peak.cuda:
                cpu_accounting(False)

    def samples(self, step, changed):
        """Does this step read activation and model-state bytes?"""
        return (step == self.first or bool(changed) or step % self.every == 0
                or self.peaks(step, changed))

    def peaks(self, step, changed):
        """Does this step read the peak?"""
        return self.peak is not None and (self.cuda or bool(changed) or step - self.first < 2
                                          or (step - 1) % self.every == 0)

    @property
    def phase(self):
        """`train_step`'s phase marks for this step (the peak probe's), or None."""
        return self.peak.phase if self._peak else None

    @contextlib.contextmanager
    def step(self, step, changed, model, optimizer, policy=None):
        """Around one optimizer step: times it, and opens the probes this step reads. Yields
        the activation probe for `train_step` (None when this step does not read it).
        ``policy``: the `CheckpointPolicy` installed on ``model`` (its regions are watched)."""
        self._sample, self._peak = self.samples(step, changed), self.peaks(step, changed)
        if self.comm is not None:
            self.comm.reset()
        acts = self.acts if self._sample else None
        if acts is not None:
            acts.new_step(policy)
        peak = self.peak.step(model, optimizer, self.comm.bucket_buffers if self.comm else None,
                              acts) if self._peak else contextlib.nullcontext()
        # inside the peak probe's window: read before it reads its events
        process = self.process.step(self.peak) if self._peak else contextlib.nullcontext()
        tl = self.timeline.step(step, model, optimizer, policy) if self.timeline \
            else contextlib.nullcontext()
        with self.timer.time(), peak, process, self._history(step), tl, self._collectives():
            yield acts

    @contextlib.contextmanager
    def _collectives(self):
        """Every collective issued inside the step, on any thread (`CollectiveCounter`)."""
        if self.collectives is None:
            yield
            return
        self.collectives.reset()
        self.collectives.start()
        try:
            yield
        finally:
            self.collectives.stop()

    def _history(self, step):
        """``memory_snapshot``: the allocator's history of step 1, on CUDA."""
        folder = self.plan.memory_snapshot
        if not (folder and self.cuda and step == self.first + 1):
            return contextlib.nullcontext()
        os.makedirs(folder, exist_ok=True)
        return cuda_history(os.path.join(folder, f"rank{self.rank}-step{step}.pickle"))

    def read(self, model, optimizer):
        """The step's measured fields for its record (call before ``zero_grad``)."""
        if self._sample:
            self.states = dict(zip(STATE_FIELDS, state_bytes(model, optimizer)))
        out = dict(self.states)
        if self.acts is not None:
            out["activation_bytes"] = self.acts.max_bytes
        if self._peak and self.peak.peak is not None:
            p = self.peak.peak
            out.update(peak_bytes=p.bytes, peak_phase=p.phase, peak_ledger=p.ledger,
                       peak_by_phase=p.by_phase, peak_base=p.base,
                       data_bytes=self.peak.data_bytes)
            if self.process.bytes is not None:
                out["process_peak_bytes"] = self.process.bytes
        if self.comm is not None:
            out.update(allreduce_calls=self.comm.calls, allreduce_bytes=self.comm.bytes)
        if self.collectives is not None:
            out.update(self.collectives.record_fields())
            if self.comm is not None and self.comm.bytes is None:  # PowerSGD: sizes vary
                out["allreduce_bytes"] = self.collectives.payload.get("allreduce", 0)
        if self.timeline is not None:
            out.update(self.timeline.record_fields())
        return out

    @property
    def seconds(self):
        """The last step's wall time."""
        return self.timer.seconds
