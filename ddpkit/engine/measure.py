"""`Measure`: the probes a run turned on, and when each one reads, as one object for the loop.

``with measure.step(step, changed, model, optimizer) as acts:`` around one optimizer step (pass
``acts`` to `train_step` as its activation probe: None on the steps it does not read), then
``measure.read(model, optimizer)`` for the step's fields of the record (before ``zero_grad``
frees the gradients). The schedules, each with its reason:

* activation bytes are fixed by the checkpoint setting and the batch's shapes, and model-state
  bytes by the model and the optimizer: they are read at the first step, at the step a mid-run
  change lands and every ``peak_every`` steps, and carried between (the activation probe's hook
  on every saved tensor costs ~0.3 ms a micro-batch on a CPU rank);
* the peak: on CPU its profiler window doubles the step it measures, so step 1, every
  ``peak_every`` steps and the step a change lands (CUDA's counter is free: every step);
* all-reduce calls and bytes, and the step's time: every step.
"""
from __future__ import annotations

import contextlib

from .probes import ActivationProbe, PeakProbe, StepTimer, state_bytes

STATE_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes")


class Measure:
    """The probes of one run (``cfg.probes``) on ``device``; ``comm``: the DDP comm counter that
    `strategies.wrap` installed (None without one); ``first``: the run's first step."""

    def __init__(self, cfg, device, comm=None, first=0):
        probes = cfg.probes
        self.acts = ActivationProbe() if "activations" in probes else None
        self.peak = PeakProbe(device) if "peak" in probes else None
        self.comm = comm
        self.timer = StepTimer(device)
        self.cuda = device.type == "cuda"
        self.first, self.every, self.steps = first, cfg.peak_every, cfg.steps
        self.states = {}  # model-state bytes: read on the sampled steps, carried between
        self._sample = self._peak = False

    def samples(self, step, changed):
        """Does this step read activation and model-state bytes?"""
        return step == self.first or bool(changed) or step % self.every == 0

    def peaks(self, step, changed):
        """Does this step read the peak?"""
        return self.peak is not None and (self.cuda or bool(changed) or
                                          (step - 1) % self.every == 0 or self.steps == 1)

    @contextlib.contextmanager
    def step(self, step, changed, model, optimizer):
        """Around one optimizer step: times it, and opens the probes this step reads. Yields
        the activation probe for `train_step` (None when this step does not read it)."""
        self._sample, self._peak = self.samples(step, changed), self.peaks(step, changed)
        if self.comm is not None:
            self.comm.reset()
        acts = self.acts if self._sample else None
        if acts is not None:
            acts.new_step()
        peak = self.peak.step(model, optimizer) if self._peak else contextlib.nullcontext()
        with self.timer.time(), peak:
            yield acts

    def read(self, model, optimizer):
        """The step's measured fields for its record (call before ``zero_grad``)."""
        if self._sample:
            self.states = dict(zip(STATE_FIELDS, state_bytes(model, optimizer)))
        out = dict(self.states)
        if self.acts is not None:
            out["activation_bytes"] = self.acts.max_bytes
        if self._peak:
            out["peak_bytes"] = self.peak.peak_bytes
        if self.comm is not None:
            out.update(allreduce_calls=self.comm.calls, allreduce_bytes=self.comm.bytes)
        return out

    @property
    def seconds(self):
        """The last step's wall time."""
        return self.timer.seconds
