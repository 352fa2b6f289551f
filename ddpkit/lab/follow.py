"""Following one Lab run: its records into the figures (at most ``max_hz`` updates a second),
the progress bar, and at the end a history row and any error as a red banner with the
culprit's traceback. One refresher thread per run; the kernel stays free meanwhile."""
from __future__ import annotations

import html
import threading
import time

from ..errors import RankError, RankStalled
from .history import history_html, history_row


class RunFollower:
    """``view``: the `LabView`; ``plots``: its `LivePlots`; ``history``: the Lab's list of rows
    (a row is added when a run ends); ``peaks``: the `PeakPanel` beside the memory plot."""

    def __init__(self, view, plots, history, peaks=None, timeline=None):
        self.view, self.plots, self.history, self.peaks = view, plots, history, peaks
        self.timeline = timeline  # [timeline] `LiveTimeline`: swimlanes, at most once a second
        self.metrics = []
        self.thread = None
        self._rank0_steps, self._t0 = 0, 0.0

    @property
    def alive(self):
        return self.thread is not None and self.thread.is_alive()

    def reset(self, cfg):
        """Before a run: no records yet, the progress bar at 0 of ``cfg.steps``."""
        self.metrics, self._rank0_steps = [], 0
        self.view.progress.max, self.view.progress.value = cfg.steps, 0

    def start(self, cfg, handle):
        self.thread = threading.Thread(target=self._follow, args=(cfg, handle),
                                       name="ddpkit-lab", daemon=True)
        self.thread.start()

    def clock(self):
        self._t0 = time.monotonic()

    def on_metric(self, record):
        self.metrics.append(record)
        self._rank0_steps += record["rank"] == 0
        self.plots.add(record)
        if self.peaks is not None:
            self.peaks.add(record)
        if self.timeline is not None:
            self.timeline.add(record)

    def on_output(self, rank, line):
        self.view.output.append_stdout(f"[rank {rank}] {line}\n")

    def _follow(self, cfg, handle):
        # one wake-up per allowed figure update: each widget change is a message to the
        # browser, and the kernel shares the cores with the ranks
        period, shown = 1.0 / self.plots.max_hz, 0.0
        while not handle.done:
            handle.join(period)
            # the progress bar and its label: twice a second is enough to read them
            if self.timeline is not None:
                self.timeline.flush()  # itself bounded to max_hz
            if self.plots.flush(force=True) and time.monotonic() - shown >= 0.5:
                self._update_progress(cfg)
                shown = time.monotonic()
            if self.peaks is not None:
                self.peaks.refresh()  # at most once a second
        self.plots.flush(force=True)
        if self.peaks is not None:
            self.peaks.refresh(force=True)
        if self.timeline is not None:
            self.timeline.flush(force=True)
        self.plots.sync()  # the figures' own state gets the points, for a re-rendered view
        self._update_progress(cfg)
        self._finish(cfg, handle)

    def _update_progress(self, cfg):
        done = self._rank0_steps
        self.view.progress.value = done
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (cfg.steps - done) if done else float("nan")
        self.view.progress_label.value = (f"step {done} of {cfg.steps}" +
                                          (f", about {eta:.0f} s to go" if done else ""))

    def _finish(self, cfg, handle):
        self.history.append(history_row(len(self.history), cfg, handle, self.metrics,
                                        time.monotonic() - self._t0))
        if handle.error is not None:
            self._show_error(handle.error)
        self.view.history_html.value = history_html(self.history)
        self.view.set_running(False)

    def _show_error(self, error):
        if isinstance(error, RankError):
            head = f"rank {error.rank} failed: {error.exc_type}: {error.message}"
            tb = error.traceback
        elif isinstance(error, RankStalled):
            head, tb = str(error).split(";")[0], str(error)
        else:
            head, tb = f"{type(error).__name__}: {error}", ""
        view = self.view
        view.banner.value = (f"<div style='background:#fdd;border-left:6px solid #c00;"
                             f"padding:6px'><b>{html.escape(head)}</b></div>")
        view.traceback.children[0].value = f"<pre>{html.escape(tb)}</pre>"
        view.traceback.layout.display = "" if tb else "none"

    def wait(self, timeout=None):
        """Block until the run ends and its history row is written; returns the row."""
        if self.thread is None:
            return None
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"run still going after {timeout}s; call stop() to end it")
        return self.history[-1]
