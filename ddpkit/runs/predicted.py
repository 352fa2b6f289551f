"""A run's step time and peak, predicted beside the run (``train(predict=...)``).

The prediction (`ddpkit.predict.steptime.step_time` and `ddpkit.predict.peak.predicted_peak`:
the rank's step simulated on fake tensors, then played on this machine's calibration) costs a
simulated step, 0.3-5 s of CPU. It runs on a thread of the kernel started just before the launch,
at the lowest CPU priority (Linux keeps a nice value per thread): it takes the CPU the ranks
leave, so it does not slow the steps it is set beside; once the ranks are done it has the cores.
Predictions run one at a time (a sweep's settings, the Lab's runs).

Which runs are predicted: ``predict=None`` (the default) those on CPU ranks when this machine's
calibration is cached (`ddpkit.calibrate` made it once: a run never measures one), live runs
(the Lab's, whose read-out predicts each setting itself) left out;
``predict=True`` every run, calibrating first where none is cached (CPU ranks: 30-60 s, once
per machine, a progress bar; GPU ranks: this machine's GPUs, `calibrate(device="cuda")`);
``predict=False`` none. A run on GPUs is predicted only with ``predict=True``: the cache the
default reads is the CPU ranks' (`calibrate.cached`).

Each probed step's record (those with a ``timeline``, those with ``peak_bytes``) gains
``predicted_step_s``, and those with ``peak_bytes`` ``predicted_peak_bytes`` (the heaviest
rank's predicted peak of that step: step 0 makes the optimizer state, the later ones are
steady). A record is stamped on the drain thread as it arrives once the prediction is ready (and
the probed records before it then); a blocking ``train`` waits for the prediction after its ranks
are done (at most `WAIT_S`) and stamps the rest. A live run's records after its first change of
settings are not stamped: the prediction is of the settings it started with.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from ..devices import resolve_devices
from ..predict.calibrate import cached, calibrate
from ..predict.peak import predicted_peak
from ..predict.steptime import step_time

WAIT_S = 60.0
"""How long a blocking ``train`` waits, once its ranks are done, for its prediction (then the
result says so, and ``res.summary()`` adds it once it is there)."""
_ONE_AT_A_TIME = threading.Lock()


def start(cfg, predict=None, live=False):
    """The `Prediction` of a run of ``cfg``, started on its thread, or None (not predicted: see
    the module's docstring). Bad ``predict`` values are refused here, before any rank starts."""
    if predict is False or predict is None and live:
        return None
    if predict not in (None, True):
        raise ValueError(f"train(predict={predict!r}): pass None (predict where this machine's "
                         f"calibration is cached), True (calibrate first where it is not) or "
                         f"False (no prediction)")
    _, device = resolve_devices(cfg.world_size, cfg.backend, cfg.device)
    if device == "cpu":
        machine = cached()
        if machine is None and predict:  # the kernel's thread, its progress bar, once a machine
            machine = calibrate(device="cpu")
    else:  # this machine's GPUs: calibrated (or loaded) only where asked
        machine = calibrate(device="cuda") if predict else None
    if machine is None:
        return None
    return Prediction(cfg, machine)


class Prediction:
    """The step time and peak of one run's config, predicted on a thread beside the run.
    ``step_time``: a `StepTime` once done; ``peaks``: the predicted `Peak` of step 0 and of a
    steady step; ``error``: the exception where the prediction failed (both then stay None)."""

    def __init__(self, cfg, machine):
        self.config, self.machine = cfg, machine
        self.step_time = self.peaks = self.error = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._waiting = []  # probed records seen before the prediction was ready
        self._changed = set()  # ranks whose settings changed mid-run (a live run)
        # not a daemon: Python's end waits for it (a daemon thread inside torch's C++ at exit
        # aborts the process)
        self._thread = threading.Thread(target=self._predict, name="ddpkit-predict-step")
        self._thread.start()

    def _predict(self):
        _lowest_priority()
        try:
            with _ONE_AT_A_TIME:
                st = step_time(self.config, machine=self.machine)
                self.peaks = (predicted_peak(self.config, 0), predicted_peak(self.config, 1))
                self.step_time = st
        except Exception as exc:  # a model the simulation cannot run: said in the result
            self.error, self.peaks = exc, None
        finally:
            self._done.set()

    @property
    def done(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        """Wait for the prediction (at most ``timeout`` seconds); True once it is done."""
        return self._done.wait(timeout)

    @property
    def seconds(self):
        return self.step_time.seconds if self.step_time is not None else None

    @property
    def peak_bytes(self):
        """The higher of the two predicted peaks (what ``estimate(cfg).peak()`` answers)."""
        return max(p.bytes for p in self.peaks) if self.peaks else None

    def watch(self, on_metric=None):
        """An ``on_metric`` for the run: each record is seen (stamped once the prediction is
        ready), then handed to ``on_metric``."""
        def see_then_pass(record):
            self.see(record)
            if on_metric is not None:
                on_metric(record)
        return see_then_pass

    def see(self, record):
        """Note a record as it arrives; stamp it (and those waiting) once the prediction is
        ready. Called on the thread that receives the records."""
        rank = record.get("rank")
        if record.get("changed"):
            self._changed.add(rank)
        if rank in self._changed or not ("timeline" in record or "peak_bytes" in record):
            return
        with self._lock:
            self._waiting.append(record)
        if self.done:
            self.fill()

    def fill(self):
        """Stamp every probed record seen so far, if the prediction is there (call it from the
        thread that owns the records: the drain thread while they arrive, yours after)."""
        if self.step_time is None:
            return
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for record in waiting:
            record["predicted_step_s"] = self.step_time.seconds
            if "peak_bytes" in record:
                record["predicted_peak_bytes"] = self.peaks[0 if record.get("step") == 0
                                                            else 1].bytes

    def note(self):
        """What the result says when there is no prediction to show (None when there is)."""
        if self.error is not None:
            return (f"no step-time prediction: {type(self.error).__name__}: {self.error} "
                    f"(estimate(cfg).step_time() raises it too)")
        if not self.done:
            return (f"the step-time prediction was still running {WAIT_S:.0f} s after the ranks "
                    f"were done; res.summary() adds it once it is there")
        return None

    def __repr__(self):
        if self.step_time is not None:
            return f"<Prediction {1e3 * self.seconds:.2f} ms/step on {self.machine.name}>"
        return f"<Prediction {'failed' if self.error is not None else 'running'}>"


def _lowest_priority():
    """This thread at nice 19: Linux keeps a nice value per thread (the thread's id as the
    process id), so only this thread yields to the ranks. Elsewhere the call would lower the
    whole kernel: it is left as it is."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
