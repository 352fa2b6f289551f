"""The Lab's peak panel, beside the memory plot: each rank's last probed peak, measured beside
predicted with the error in %, and one stacked bar of what each is made of (the ledger), topped
by the allocator's share: measured, the process's peak less the tensors' (``process_peak_bytes -
peak_bytes``: glibc's heap or CUDA's cached segments, and what lives outside tensors);
predicted, the allowance `fits` and `plan` budget for it (`gpus.allocator_allowance`).

Predictions come from `ddpkit.predict.peak` (the rank's step simulated on fake tensors), one per
(checkpoint setting, accumulation steps, step 0 or steady, rank) a record asks for, worked out on
the Lab's predictor thread (`background.Predictor`: a cold simulation takes seconds at real
sizes), so neither the kernel nor the figures wait for them. Redrawn at most once a second.
"""
from __future__ import annotations

import html
import threading

from ..engine.memory import KINDS
from .background import Pace
from .fit import figure
from ..predict.estimate import estimate
from ..predict.gpus import allocator_allowance
from ..predict.units import byte_unit, fmt_bytes

KIND_COLORS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer_state": "#e45756",
               "ddp_buckets": "#72b7b2", "fsdp_buffers": "#54a24b", "activations": "#eeca3b",
               "temporaries": "#b279a2", "other": "#bab0ac"}
ALLOCATOR, ALLOCATOR_COLOR = "allocator", "#d8d8d8"  # beyond the tensors: drawn last, grey


def allocator_share(rec):
    """The bytes a record's process held at its peak beyond the tensors' (0 if it says none)."""
    return max(rec.get("process_peak_bytes", 0) - rec["peak_bytes"], 0) \
        if "process_peak_bytes" in rec else 0


def _key(rec):
    """What a record's prediction depends on: its setting, accumulation, step and rank."""
    return rec.get("checkpoint"), rec.get("accum_steps"), min(rec["step"], 1), rec["rank"]


class PeakPanel:
    """``widget``: the stacked bar and the table. ``new_run(cfg)``, ``add(record)`` (from the
    drain thread), ``refresh()`` (from the Lab's refresher). ``predictor``: the Lab's
    `background.Predictor`, which works the predictions out."""

    def __init__(self, predictor, height=330, min_period=1.0):
        import ipywidgets as W

        self.predictor, self.min_period = predictor, min_period
        self.figure = figure(dict(
            title=dict(text="what the peak is made of", x=0.01, xanchor="left", y=0.98,
                       yanchor="top", font=dict(size=14)),
            barmode="stack", height=height - 70, autosize=True, template="plotly_white",
            legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=10)),
            margin=dict(t=92, b=36, l=96, r=16), xaxis=dict(title=dict(text="MiB", standoff=4))))
        self.table = W.HTML()
        self.widget = W.VBox([self.figure, self.table], layout=W.Layout(min_width="0"))
        self.cfg, self.last, self.predicted = None, {}, {}
        self._lock = threading.Lock()
        self._asked = set()
        self._pace = Pace(min_period)  # a new record or prediction: redrawn at this pace

    def new_run(self, cfg):
        with self._lock:
            self.cfg, self.last = cfg, {}
        self._pace.put()
        self.table.value = ""

    def add(self, record):
        if "peak_bytes" not in record or self.cfg is None:
            return
        key = _key(record)
        with self._lock:
            self.last[record["rank"]] = record
            cfg = self.cfg
            ask = (id(cfg), key) not in self._asked
            self._asked.add((id(cfg), key))
        self._pace.put()
        if ask:
            self.predictor.submit(lambda: self._predict(cfg, key))

    def _predict(self, cfg, key):
        checkpoint, accum, step, rank = key
        try:
            run = cfg.replace(checkpoint=cfg.checkpoint.with_value(checkpoint), accum_steps=accum)
            peak = estimate(run).peak(step=step, rank=rank)  # the trace and the simulated step
        except Exception as exc:  # noqa: BLE001 (shown in the table, never raised here)
            peak = exc
        with self._lock:
            self.predicted[id(cfg), key] = peak
        self._pace.put()

    def refresh(self, force=False):
        """Redraw if something changed (at most once per ``min_period`` unless ``force``)."""
        if self._pace.take(force) is None:
            return False
        with self._lock:
            cfg, last = self.cfg, dict(self.last)
            pairs = [(rec, self.predicted.get((id(cfg), _key(rec)))) for _, rec in
                     sorted(last.items())]
        self._draw(pairs)
        return True

    def _draw(self, pairs):
        bars = [(f"r{rec['rank']} measured",
                 {**rec["peak_ledger"], ALLOCATOR: allocator_share(rec)}) for rec, _ in pairs]
        done = [(rec, p) for rec, p in pairs if p is not None and not isinstance(p, Exception)]
        allowance = _allowance(self.cfg)
        if done:
            p = done[0][1]
            bars.append((f"r{done[0][0]['rank']} predicted",
                         {**p.ledger, ALLOCATOR: allowance.of(p.bytes) if allowance else 0}))
        unit, size = byte_unit(max((sum(ledger.values()) for _, ledger in bars), default=1))
        names = [name for name, _ in bars]
        with self.figure.batch_update():
            self.figure.data = []
            for kind in (*KINDS, ALLOCATOR):
                xs = [ledger.get(kind, 0) / size for _, ledger in bars]
                if any(xs):
                    self.figure.add_bar(y=names, x=xs, name=kind.replace("_", " "),
                                        orientation="h",
                                        marker_color=KIND_COLORS.get(kind, ALLOCATOR_COLOR))
            self.figure.layout.xaxis.title.text = unit
        self.table.value = _table(pairs, allowance)


def _allowance(cfg):
    """The allocator's allowance `fits` takes for ``cfg`` on its own device's memory."""
    return None if cfg is None else allocator_allowance(cfg)


def _table(pairs, allowance=None):
    rows = []
    for rec, p in pairs:
        measured = f"{fmt_bytes(rec['peak_bytes'])} in the {rec['peak_phase']}"
        if p is None:
            predicted, err = "simulating...", ""
        elif isinstance(p, Exception):
            predicted, err = html.escape(f"{type(p).__name__}: {p}"), ""
        else:
            predicted = f"{fmt_bytes(p.bytes)} in the {p.phase}"
            err = f"{100 * (p.bytes - rec['peak_bytes']) / rec['peak_bytes']:+.2f}%"
        process = "" if "process_peak_bytes" not in rec else (
            f"{fmt_bytes(rec['process_peak_bytes'])} (allocator "
            f"{fmt_bytes(allocator_share(rec))}, "
            f"{rec['process_peak_bytes'] / rec['peak_bytes']:.2f}x)")
        rows.append(f"<tr><td>rank {rec['rank']}, step {rec['step']}</td><td>{measured}</td>"
                    f"<td>{predicted}</td><td>{err}</td><td>{process}</td></tr>")
    allowed = html.escape(str(allowance)) if allowance else "not known"
    head = ("<tr><th>last probe</th><th>peak, measured</th><th>predicted</th>"
            "<th>error</th><th>process, measured</th></tr>")
    note = (f"<tr><td colspan='5'>process: the rank's own memory at its highest over the step "
            f"(resident on CPU, reserved on CUDA) beside the tensors'; the prediction's allowance "
            f"for it: {allowed}</td></tr>")
    return (f"<table style='font-size:12px;border-collapse:collapse'>{head}{''.join(rows)}"
            f"{note}</table>")
