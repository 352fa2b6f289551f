"""Live plotly figures that follow a run: loss per rank; activation and peak memory per rank
beside the predicted line; step time and all-reduce calls per step.

Records arrive on ddpkit's drain thread; `LivePlots.add` only appends to a buffer. `flush()`
pushes the buffer into the `FigureWidget`s in place, inside ``batch_update()`` (one message per
figure), and is called at a bounded rate (``max_hz``, 10 by default) by the lab's refresher. Past
``max_points`` points a trace is thinned to every k-th point, so a long run stays cheap. Finished
runs stay as faded overlays.
"""
from __future__ import annotations

import threading
import time

MIB = 2**20
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def thin(xs, ys, max_points):
    """Every k-th point (and always the last) so at most ~max_points remain."""
    if len(xs) <= max_points:
        return xs, ys
    k = -(-len(xs) // max_points)
    idx = list(range(0, len(xs), k))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


class LivePlots:
    """Three FigureWidgets (``loss``, ``memory``, ``timing``) fed by records."""

    def __init__(self, world_size=2, max_hz=10.0, max_points=2000, height=340):
        import plotly.graph_objects as go

        legend = dict(orientation="h", y=-0.3)
        self.max_hz, self.max_points = max_hz, max_points
        self._lock = threading.Lock()
        self._pending = []
        self._last_flush = 0.0
        self.flushes = 0
        self.loss = go.FigureWidget(layout=dict(title="loss per rank", height=height,
                                                xaxis_title="optimizer step", yaxis_title="loss",
                                                margin=dict(t=40, b=40, l=50, r=10), legend=legend))
        self.memory = go.FigureWidget(layout=dict(title="memory per rank (MiB)", height=height,
                                                  xaxis_title="optimizer step", yaxis_title="MiB",
                                                  margin=dict(t=40, b=40, l=50, r=10), legend=legend))
        self.timing = go.FigureWidget(layout=dict(
            title="step time (ms) and all-reduce calls", height=height,
            xaxis_title="optimizer step", yaxis=dict(title="ms"),
            yaxis2=dict(title="all-reduces", overlaying="y", side="right"),
            margin=dict(t=40, b=40, l=50, r=50), legend=legend))
        self._traces = {}
        self._data = {}
        self.new_run(world_size)

    @property
    def figures(self):
        return [self.loss, self.memory, self.timing]

    # --- runs
    def new_run(self, world_size, predict=None, label="run"):
        """Fade the traces of the run before and start fresh ones for this run."""
        with self._lock:
            self._pending.clear()
        for fig in self.figures:
            with fig.batch_update():
                for tr in fig.data:
                    tr.opacity = 0.25
                    tr.showlegend = False
                fig.layout.shapes = ()
                fig.layout.annotations = ()
        self._traces, self._data = {}, {}
        for r in range(world_size):
            c = COLORS[r % len(COLORS)]
            self._add(self.loss, ("loss", r), f"rank {r}", c)
            self._add(self.memory, ("activation_bytes", r), f"activations r{r}", c)
            self._add(self.memory, ("peak_bytes", r), f"peak r{r}", c, dash="dot", mode="lines+markers")
            self._add(self.timing, ("step_time_s", r), f"step ms r{r}", c)
            self._add(self.timing, ("allreduce_calls", r), f"all-reduces r{r}", c, dash="dot",
                      yaxis="y2")
        self._predict = predict  # record -> predicted activation bytes (estimate.py)
        if predict is not None:
            self._add(self.memory, ("predicted", 0), "activations predicted", "#7f7f7f", dash="dash")
        self._label = label

    def _add(self, fig, key, name, color, dash=None, mode="lines", yaxis=None):
        fig.add_scatter(x=[], y=[], name=name, mode=mode, line=dict(color=color, dash=dash),
                        **({"yaxis": yaxis} if yaxis else {}))
        self._traces[key] = (fig, fig.data[-1])
        self._data[key] = ([], [])

    # --- records (drain thread)
    def add(self, record):
        with self._lock:
            self._pending.append(record)

    def mark(self, step, text):
        """A vertical line where a mid-run change landed, on every figure."""
        for fig in self.figures:
            fig.add_vline(x=step, line=dict(color="#444", dash="dot"), annotation_text=text,
                          annotation_position="top left")

    # --- figure updates (bounded rate)
    def flush(self, force=False):
        now = time.monotonic()
        if not force and now - self._last_flush < 1.0 / self.max_hz:
            return False
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return False
        self._last_flush = now
        marks = []
        for rec in batch:
            r, step = rec["rank"], rec.get("step")
            for key, scale in (("loss", 1), ("activation_bytes", 1 / MIB), ("peak_bytes", 1 / MIB),
                               ("step_time_s", 1000), ("allreduce_calls", 1)):
                if key in rec and (key, r) in self._data:
                    xs, ys = self._data[(key, r)]
                    xs.append(step)
                    ys.append(rec[key] * scale)
            if self._predict is not None and r == 0:
                xs, ys = self._data[("predicted", 0)]
                xs.append(step)
                ys.append(self._predict(rec) / MIB)
            if rec.get("changed") and r == 0:
                marks.append((step, rec["changed"] + " changed"))
        for fig in self.figures:
            with fig.batch_update():
                for key, (owner, trace) in self._traces.items():
                    if owner is fig:
                        trace.x, trace.y = thin(*self._data[key], self.max_points)
        for step, text in marks:
            self.mark(step, text)
        self.flushes += 1
        return True

    def points(self, key, rank=0):
        """What the figure holds for a trace now (tests read this)."""
        return list(self._data.get((key, rank), ([], []))[1])
