"""The Lab's timeline, `LiveTimeline`: the swimlanes of the last probed step and the exposed
communication per step, fed while a run goes (the rows: `ddpkit.runs.timeline`; the figures'
traces and layouts: `ddpkit.runs.figures`; its controls, DDP's bucket size and the simulated
link, are rows of `controls.CONTROLS`).
"""
from __future__ import annotations

from ..runs.figures import (COLORS, exposed_layout, lanes_height, titled, swimlane_layout,
                            swimlane_traces)
from ..runs.timeline import overlap, timeline_frame
from .background import Pace
from .fit import grid, held, opened


class LiveTimeline:
    """The Lab's two timeline figures, fed records on the drain thread (`add`) and redrawn by
    `flush` at most ``max_hz`` times a second: the swimlanes of the last probed step (its few
    bars replaced) and the exposed communication per step (one point per probed step)."""

    def __init__(self, world_size=2, max_hz=1.0):
        self.max_hz = max_hz
        self._pace = Pace(1.0 / max_hz)  # records from the drain thread, redrawn at this pace
        self.redraws = 0
        self.lanes = held(swimlane_layout(world_size, "-"))
        self.exposed = held(exposed_layout(None))
        self.new_run(world_size)
        # each comm opens with its figure whole (fit.py says why); the browser test finds the
        # swimlanes by their class
        opened(self.lanes, classes=["ddpkit-swimlanes"])
        opened(self.exposed)
        self.widget = grid([self.lanes, self.exposed])

    def new_run(self, world_size, link=None):
        self._pace.clear()
        self.world_size, self.link, self._rows, self._over = world_size, link, {}, []
        with self.lanes.batch_update():
            self.lanes.data = []
            self.lanes.update_layout(swimlane_layout(world_size, "-", link))
        with self.exposed.batch_update():
            self.exposed.data = []
            self.exposed.update_layout(exposed_layout(link))
            for r in range(world_size):
                c = COLORS[r % len(COLORS)]
                self.exposed.add_scatter(x=[], y=[], name=f"exposed r{r}", mode="lines+markers",
                                         line=dict(color=c, width=2))
                self.exposed.add_scatter(x=[], y=[], name=f"all-reduce r{r}", mode="lines",
                                         line=dict(color=c, width=1, dash="dot"))

    def add(self, record):
        if "timeline" in record:
            self._pace.put(record)

    def flush(self, force=False):
        """Redraw if a probed step arrived and (unless ``force``) a period has passed."""
        batch = self._pace.take(force)
        if batch is None:
            return False
        for rec in batch:
            self._rows.setdefault(rec["step"], {})[rec["rank"]] = rec
        done = [s for s, by in self._rows.items() if len(by) == self.world_size]
        if not done:
            return False
        last = max(done)
        recs = [self._rows[s][r] for s in sorted(done) for r in range(self.world_size)]
        tl = timeline_frame(recs)
        over = overlap(tl)
        traces, step = swimlane_traces(tl[tl.step == last])
        with self.lanes.batch_update():
            self.lanes.data = []
            for t in traces:
                self.lanes.add_trace(t)
            self.lanes.layout.title.text = titled(f"step {step}: what each rank did", self.link)
            self.lanes.layout.height = lanes_height(self.world_size)
        with self.exposed.batch_update():
            for r in range(self.world_size):
                g = over[over["rank"] == r]
                self.exposed.data[2 * r].x = list(self.exposed.data[2 * r].x) + list(g.step)
                self.exposed.data[2 * r].y = list(self.exposed.data[2 * r].y) + list(1e3 * g.exposed_comm_s)
                self.exposed.data[2 * r + 1].x = list(self.exposed.data[2 * r + 1].x) + list(g.step)
                self.exposed.data[2 * r + 1].y = list(self.exposed.data[2 * r + 1].y) + list(1e3 * g.comm_s)
        for s in done:
            del self._rows[s]
        self.redraws += 1
        return True
