"""Live plotly figures that follow a run: loss per rank (raw, and smoothed by an EMA); activation
and peak memory per rank beside the predicted line; step time and all-reduce calls per step.

Records arrive on ddpkit's drain thread; `LivePlots.add` only appends to a buffer. `flush()` is
called at a bounded rate (``max_hz``, 5 by default: on 2 shared cores 10 a second slowed the
ranks by 5%, 5 (or 4) by about 2%) by the lab's refresher and sends **only the
points that arrived since the last flush**: one small custom message to a tiny anywidget
(`_Feeder`) whose front end calls ``Plotly.extendTraces`` on the figures in the page. A
``FigureWidget`` update re-sends every trace's whole arrays, so its cost grows with the run (82 ms
per update at 5,000 points, TORCH_NOTES); this stays flat (bench/live_plots.py measures both).

Very long runs are thinned: a trace keeps every ``stride``-th point, and when it would pass
``max_points`` the stride doubles and the thinned trace is sent once in full (log2(steps /
max_points) times in a run). `sync()` (at the end of a run) writes the shown points into the
FigureWidgets' own state too, so a re-rendered view draws them. The previous run stays as a faded
overlay; older ones are dropped.
"""
from __future__ import annotations

import itertools
import time

import anywidget
import traitlets

from .background import Pace
from .controls import change_text
from .fit import grid, held, opened
from ..predict.units import MIB, byte_unit

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
PREDICTED = "#555555"
_ids = itertools.count()


def thin(xs, ys, max_points):
    """Every k-th point (and always the last) so at most ~max_points remain."""
    if len(xs) <= max_points:
        return xs, ys
    k = -(-len(xs) // max_points)
    idx = list(range(0, len(xs), k))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def check_ema(ema, who):
    """The loss plot's smoothing factor, or a ValueError that names it (``who``: the caller)."""
    if not 0 <= ema < 1:
        raise ValueError(f"{who}(ema={ema!r}): the smoothing factor must be in [0, 1); "
                         f"pass e.g. ema=0.95 (0 turns the smoothed loss off)")


class _Feeder(anywidget.AnyWidget):
    """Appends points to the figures of one `LivePlots` in the browser (``Plotly.extendTraces``).

    A message: ``{"extend": [[key, [trace index...], [[x...]...], [[y...]...]], ...]}``.
    The figures' own FigureWidget views draw them; this only finds their plot divs, by the key
    in each figure's ``layout.meta`` (what plotly drew), not by a class: ipywidgets adds a
    view's classes only once the view is attached, and one view in a CI run never got them."""

    _esm = """
    // Points wait here, merged per figure and trace, and each figure is drawn at an animation
    // frame with one extendTraces (and one restyle for traces re-sent in full); after a draw that
    // took c ms the next waits 3c ms. Drawing so takes at most a quarter of the page's main
    // thread on any machine: on two busy cores a redraw per message (ten a second, three
    // figures) left no time for a click on Stop.
    const TOLERANCE = 3, GIVE_UP_MS = 10000;
    function initialize({ model }) {
      const pending = new Map();  // figure key -> Map(trace index -> {full, xs, ys})
      const plots = document.getElementsByClassName('js-plotly-plot');  // live, no layout
      let scheduled = false, readyAt = 0;
      const waitingSince = new Map();
      function put(key, full, idx, xs, ys) {
        if (!pending.has(key)) pending.set(key, new Map());
        const traces = pending.get(key);
        idx.forEach((i, k) => {
          const have = traces.get(i);
          if (have && !full) { for (const v of xs[k]) have.xs.push(v); for (const v of ys[k]) have.ys.push(v); }
          else traces.set(i, {full: full || false, xs: xs[k].slice(), ys: ys[k].slice()});
        });
        schedule();
      }
      function schedule(ms) {
        if (scheduled) return;
        scheduled = true;
        const wait = ms !== undefined ? ms : Math.max(0, readyAt - performance.now());
        setTimeout(() => requestAnimationFrame(draw), wait);
      }
      function draw() {
        scheduled = false;
        const Plotly = window.Plotly;  // set by plotly's widget bundle
        const t0 = performance.now();
        let later = false;
        for (const [key, traces] of Array.from(pending)) {
          const gds = Array.from(plots).filter(gd => gd.layout && gd.layout.meta === key);
          const top = Math.max(...traces.keys());
          if (!(Plotly && gds.length && gds.every(gd => gd.data && gd.data.length > top))) {
            // the figure (or a trace just added) is not drawn yet: wait for it, a while
            if (!waitingSince.has(key)) waitingSince.set(key, t0);
            if (t0 - waitingSince.get(key) < GIVE_UP_MS) { later = true; continue; }
          }
          waitingSince.delete(key);
          pending.delete(key);
          if (!gds.length) continue;  // never drawn (the output was cleared): dropped
          for (const full of [true, false]) {
            const idx = Array.from(traces.keys()).filter(i => traces.get(i).full === full);
            if (!idx.length) continue;
            const xs = idx.map(i => traces.get(i).xs), ys = idx.map(i => traces.get(i).ys);
            for (const gd of gds) {
              if (full) Plotly.restyle(gd, {x: xs, y: ys}, idx);
              else Plotly.extendTraces(gd, {x: xs, y: ys}, idx);
            }
          }
        }
        const t1 = performance.now();
        readyAt = t1 + TOLERANCE * (t1 - t0);
        if (later) schedule(50);
      }
      model.on("msg:custom", msg => {
        for (const [key, idx, xs, ys] of msg.extend || []) put(key, false, idx, xs, ys);
        for (const [key, idx, xs, ys] of msg.replace || []) put(key, true, idx, xs, ys);
      });
    }
    function render({ model, el }) {}
    export default { initialize, render };
    """
    points_sent = traitlets.Int(0)  # kernel side only: what tests and the benchmark read


class _Trace:
    """One trace's points (all kept in the kernel) and what of them the browser holds."""

    def __init__(self, fig, trace):
        self.fig, self.trace = fig, trace
        self.xs, self.ys = [], []
        self.stride, self.sent = 1, 0  # next index of xs not yet considered for sending
        self.shown = 0

    def take_new(self, max_points):
        """The new points to send, or None when the trace must be re-sent in full (thinned)."""
        new = [i for i in range(self.sent, len(self.xs)) if i % self.stride == 0]
        self.sent = len(self.xs)
        if self.shown + len(new) <= max_points:
            self.shown += len(new)
            return [self.xs[i] for i in new], [self.ys[i] for i in new]
        while len(self.xs) / self.stride > max_points:
            self.stride *= 2
        return None

    def thinned(self):
        return self.xs[::self.stride], self.ys[::self.stride]


class LivePlots:
    """Three FigureWidgets (``loss``, ``memory``, ``timing``) fed by records; ``widget`` lays
    them out in a grid that fills the cell's width, with ``beside_memory`` (the Lab's peak
    panel) right after the memory plot. The grid's children are set once: a box whose children
    change after it is shown makes new views of the figures after the change."""

    def __init__(self, world_size=2, max_hz=5.0, max_points=2000, height=330, ema=0.95,
                 beside_memory=None):
        check_ema(ema, "LivePlots")
        self.max_hz, self.max_points, self.ema = max_hz, max_points, ema
        self._pace = Pace(1.0 / max_hz)  # records from the drain thread, flushed at this pace
        self.flushes = 0
        self._uid = f"ddpkit-plots-{next(_ids)}-{int(time.time() * 1000) % 10**6}"
        # legends above the plot area, wrapped to its width: nothing is cut at the right edge
        legend = dict(orientation="h", x=0, xanchor="left", y=1.0, yanchor="bottom",
                      font=dict(size=11), bgcolor="rgba(255,255,255,0.6)")

        def figure(key, title, ytitle, right=16, **extra):
            # meta: how the page's feeder finds the figure's plot div (in the layout the
            # figure is made with, so a view the page makes again has it too)
            layout = dict(meta=f"{self._uid}-{key}",
                          title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top",
                                     font=dict(size=14)),
                          height=height, autosize=True, legend=legend,
                          xaxis=dict(title=dict(text="optimizer step", standoff=4)),
                          yaxis=dict(title=dict(text=ytitle, standoff=4)),
                          margin=dict(t=92, b=44, l=56, r=right), template="plotly_white", **extra)
            return held(layout)  # opened below, once its first traces are in

        self.loss = figure(0, "loss per rank", "loss")
        self.memory = figure(1, "memory per rank", "MiB")
        self.timing = figure(2, "step time and all-reduce calls", "ms per step", right=56,
                             yaxis2=dict(title=dict(text="all-reduces per step", standoff=4),
                                         overlaying="y", side="right", rangemode="tozero",
                                         showgrid=False))
        self._traces, self._ema, self._marks = {}, {}, 0
        self._mem_unit = ("MiB", MIB)
        self.new_run(world_size)
        for fig in self.figures:
            opened(fig)  # each figure's comm opens with its layout and traces (fit.py says why)
        self.feeder = _Feeder()
        extra = [beside_memory] if beside_memory is not None else []
        self.widget = grid([self.loss, self.memory, *extra, self.timing, self.feeder])

    @property
    def figures(self):
        return [self.loss, self.memory, self.timing]

    # --- runs
    def new_run(self, world_size, predict=None, label="run", setting=None):
        """Fade the traces of the run before (dropping older ones) and start fresh ones.
        ``setting``: the run's `CheckpointSetting` (its stacks), for the labels of checkpoint
        changes."""
        self._pace.clear()
        for fig in self.figures:
            with fig.batch_update():
                if any(t.meta == "faded" for t in fig.data):  # only the last run stays
                    fig.data = [t for t in fig.data if t.meta != "faded"]
                for tr in fig.data:
                    tr.meta = "faded"
                    tr.opacity = 0.2
                    tr.showlegend = False
                    tr.hoverinfo = "skip"
                fig.layout.shapes = ()
                fig.layout.annotations = ()
        self._traces, self._ema, self._marks = {}, {}, 0
        self._calls_top, self._calls_seen = None, 0
        self._mem_unit = None  # chosen from the first memory values of the run
        for r in range(world_size):
            c = COLORS[r % len(COLORS)]
            self._add(self.loss, ("loss", r), f"rank {r}", c,
                      width=1, opacity=0.45 if self.ema else 1.0)
            if self.ema:
                self._add(self.loss, ("loss_ema", r), f"rank {r} EMA", c, width=2.5)
            self._add(self.memory, ("activation_bytes", r), f"activations r{r} (measured)", c,
                      width=2)
            self._add(self.memory, ("peak_bytes", r), f"peak r{r} (measured)", c,
                      mode="markers", marker=dict(symbol="diamond", size=6, color=c,
                                                  line=dict(width=1, color="white")))
            self._add(self.timing, ("step_time_s", r), f"step ms r{r}", c, width=1.5)
        self._add(self.timing, ("allreduce_calls", 0), "all-reduces", "#7f7f7f", dash="dot",
                  yaxis="y2", width=2)
        self._predict = predict  # record -> predicted activation bytes (estimate.py)
        if predict is not None:
            self._add(self.memory, ("predicted", 0), "activations predicted", PREDICTED,
                      dash="dash", width=2.5)
        self._label, self._setting = label, setting

    def _add(self, fig, key, name, color, dash=None, mode="lines", yaxis=None, width=2,
             opacity=1.0, marker=None):
        fig.add_scatter(x=[], y=[], name=name, mode=mode, opacity=opacity,
                        line=dict(color=color, dash=dash, width=width),
                        **({"marker": marker} if marker else {}),
                        **({"yaxis": yaxis} if yaxis else {}))
        self._traces[key] = _Trace(fig, fig.data[-1])

    # --- records (drain thread)
    def add(self, record):
        self._pace.put(record)

    def mark(self, step, text):
        """A vertical line where a mid-run change landed, on every figure; its label (on the
        loss figure) is staggered in height so that several changes stay readable."""
        row = self._marks % 4
        self._marks += 1
        for fig in self.figures:
            fig.add_vline(x=step, line=dict(color="#444", dash="dot", width=1))
        self.loss.add_annotation(x=step, xref="x", y=0.97 - 0.09 * row, yref="paper", text=text,
                                 showarrow=False, xanchor="left", xshift=3, font=dict(size=10),
                                 bgcolor="rgba(255,255,255,0.85)", bordercolor="#999",
                                 borderwidth=1, borderpad=2)

    # --- figure updates (bounded rate)
    def _memory_scale(self, rec):
        if self._mem_unit is None:
            seen = [rec.get(k, 0) for k in ("peak_bytes", "activation_bytes")]
            if self._predict is not None:
                seen.append(self._predict(rec))
            if max(seen) == 0:
                return MIB
            self._mem_unit = byte_unit(max(seen))
            self.memory.layout.yaxis.title.text = self._mem_unit[0]
        return self._mem_unit[1]

    def flush(self, force=False):
        batch = self._pace.take(force)
        if batch is None:
            return False
        marks = []
        for rec in batch:
            r, step = rec["rank"], rec.get("step")
            mem = self._memory_scale(rec) if ("activation_bytes" in rec or "peak_bytes" in rec) \
                else None
            for key, scale in (("loss", 1), ("activation_bytes", mem), ("peak_bytes", mem),
                               ("step_time_s", 1000), ("allreduce_calls", 1)):
                t = self._traces.get((key, r))
                if key in rec and t is not None:
                    t.xs.append(step)
                    t.ys.append(rec[key] / scale if key in ("activation_bytes", "peak_bytes")
                                else rec[key] * scale)
            if ("loss_ema", r) in self._traces:
                n, avg = self._ema.get(r, (0, 0.0))
                n, avg = n + 1, self.ema * avg + (1 - self.ema) * rec["loss"]
                self._ema[r] = (n, avg)
                t = self._traces[("loss_ema", r)]
                t.xs.append(step)
                t.ys.append(avg / (1 - self.ema ** n))  # bias-corrected, as Adam's moments
            if self._predict is not None and r == 0:
                t = self._traces[("predicted", 0)]
                t.xs.append(step)
                t.ys.append(self._predict(rec) / (mem or MIB))
            if rec.get("changed") and r == 0:
                marks.append((step, change_text(rec, self._setting)))
        self._calls_axis()
        self._send()
        for step, text in marks:
            self.mark(step, text)
        self.flushes += 1
        return True

    def _calls_axis(self):
        """All-reduce calls are whole numbers, most often one value for a whole run: the right
        axis runs from 0 to a little above the largest count, ticked at whole numbers (plotly's
        own autorange puts a constant line at the top edge, ticked 0.026, 0.388, 0.75)."""
        t = self._traces.get(("allreduce_calls", 0))
        new = t.ys[self._calls_seen:] if t is not None else []  # only the points since the last
        if not new:
            return
        self._calls_seen = len(t.ys)
        if self._calls_top is not None and max(new) <= self._calls_top:
            return
        top = self._calls_top = max(new)
        dtick = max(1, -(-int(top) // 4))
        with self.timing.batch_update():
            self.timing.layout.yaxis2.range = [0, top + max(0.5, 0.15 * top)]
            self.timing.layout.yaxis2.dtick = dtick
            self.timing.layout.yaxis2.tickformat = "d"

    def _send(self, full=False):
        """One message with every trace's new points; full re-sends only when thinning, or of
        every trace (``full``)."""
        extend, replace = {}, {}

        def put(into, t, xs, ys):
            # by identity: a figure's == compares whole figures (to_dict, deep copies)
            i = next(k for k, fig in enumerate(self.figures) if fig is t.fig)
            idx, all_xs, all_ys = into.setdefault(i, ([], [], []))
            idx.append(next(k for k, tr in enumerate(t.fig.data) if tr is t.trace))
            all_xs.append(xs)
            all_ys.append(ys)

        for t in self._traces.values():
            new = None if full else t.take_new(self.max_points)
            if new is None:  # rare: the stride just doubled; the thinned trace goes in full
                xs, ys = t.thinned()
                put(replace, t, xs, ys)
                t.shown = len(xs)
            elif new[0]:
                put(extend, t, *new)
        if extend or replace:
            # one message, drawn in order by the page: extends first, then the full copies
            msg = {"extend": [[f"{self._uid}-{i}", *v] for i, v in extend.items()],
                   "replace": [[f"{self._uid}-{i}", *v] for i, v in replace.items()]}
            self.feeder.send(msg)
            self.feeder.points_sent += sum(len(x) for item in msg.values()
                                           for _, _, xs, _ in item for x in xs)

    def sync(self):
        """Write the points the browser shows into the FigureWidgets' own state (one full send
        per trace; the lab calls it when a run ends), so a re-rendered view is complete; and the
        same points to the feeder in full, last: a page behind on busy cores still holds
        extends the feeder has not drawn, which would land on top of the figure's new state and
        show those points twice (70 where the run made 54). A full copy takes their place."""
        for fig in self.figures:
            with fig.batch_update():
                for t in self._traces.values():
                    if t.fig is fig:
                        t.trace.x, t.trace.y = t.thinned()
        self._send(full=True)

    def points(self, key, rank=0):
        """Every value a trace has received this run (tests read this)."""
        t = self._traces.get((key, rank))
        return list(t.ys) if t is not None else []
