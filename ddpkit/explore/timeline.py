"""The timeline of a run, read: rows as a DataFrame, exposed communication per step, DDP's own
statistics beside ours, and the figures (swimlanes, exposed communication), static and live.

Rows come from `ddpkit.engine.timeline.TimelineProbe` inside each probed step's record
(``timeline``: tuples; ``timeline_window``: the step's start and end; ``ddp_stats``: what DDP's
reducer timed). Times are seconds on one clock shared by the ranks (see the probe).
"""
from __future__ import annotations

import threading
import time
from numbers import Integral

from .fit import grid, held, opened
from .plots import COLORS

COLUMNS = ["rank", "step", "micro_step", "kind", "name", "start_s", "end_s", "bytes"]
COMPUTE = ("forward", "backward", "recompute", "optimizer")
KIND_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "recompute": "#e45756",
               "optimizer": "#54a24b", "allreduce": "#b279a2"}


def timeline_frame(metrics):
    """Every probed step's rows, all ranks, one DataFrame (``COLUMNS``; ``bucket``: the DDP
    bucket index of an all-reduce row, else -1), sorted by rank, step and start."""
    import pandas as pd

    rows = [r for m in metrics for r in m.get("timeline", ())]
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["bucket"] = [int(n.split()[1]) if k == "allreduce" else -1
                    for k, n in zip(df["kind"], df["name"])]
    return df.sort_values(["rank", "step", "start_s"], kind="stable").reset_index(drop=True)


def windows_frame(metrics):
    """Each probed step's window per rank: ``rank, step, start_s, end_s``."""
    import pandas as pd

    return pd.DataFrame([(m["rank"], m["step"], *m["timeline_window"]) for m in metrics
                         if "timeline_window" in m], columns=["rank", "step", "start_s", "end_s"])


def ddp_frame(metrics):
    """DDP's own runtime statistics (``_get_ddp_logging_data()``), one row per rank and synced
    iteration it timed; its timestamps in the timeline's seconds."""
    import pandas as pd

    return pd.DataFrame([{"rank": m["rank"], **s} for m in metrics for s in m.get("ddp_stats", ())])


def _union(spans):
    """Total length of the union of (start, end) spans, and the merged spans."""
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged), merged


def _exposed(comm, compute):
    """Length of the comm spans not covered by any compute span."""
    _, comp = _union(compute)
    total, spans = 0.0, _union(comm)[1]
    for a, b in spans:
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in comp)
        total += (b - a) - covered
    return total


def overlap(timeline):
    """One row per rank and step: ``compute_s`` (union of forward, backward, recompute and
    optimizer rows), ``comm_s`` (union of all-reduce rows), ``exposed_comm_s`` (all-reduce time
    with no compute under it: what the step waits for) and ``overlap`` (the hidden fraction,
    1 - exposed/comm, 0..1; NaN where the step had no all-reduce)."""
    import pandas as pd

    out = []
    for (rank, step), g in timeline.groupby(["rank", "step"], sort=True):
        spans = lambda kinds: list(zip(g.start_s[g.kind.isin(kinds)],  # noqa: E731
                                       g.end_s[g.kind.isin(kinds)]))
        compute, comm = spans(COMPUTE), spans(("allreduce",))
        comm_s = _union(comm)[0]
        exposed = _exposed(comm, compute)
        out.append(dict(rank=rank, step=step, compute_s=_union(compute)[0], comm_s=comm_s,
                        exposed_comm_s=exposed,
                        overlap=1 - exposed / comm_s if comm_s > 0 else float("nan")))
    return pd.DataFrame(out, columns=["rank", "step", "compute_s", "comm_s", "exposed_comm_s",
                                      "overlap"])


def versus_ddp(timeline, ddp):
    """DDP's figures for each iteration it timed beside the timeline's for the same synced
    micro-step (found by the first all-reduce's start): backward compute (DDP: end of its
    forward to the end of the autograd pass; here: end of the model's forward to the end of
    the backward), comm (first bucket handed over to the last one done) and overlap (comm start
    to compute end). Iterations whose micro-step the timeline did not probe are left out."""
    import pandas as pd

    rows = []
    for _, d in ddp.iterrows():
        mine = timeline[(timeline["rank"] == d["rank"])]
        ar = mine[mine.kind == "allreduce"]
        if ar.empty or d["backward_comm_start_s"] is None:
            continue
        firsts = ar.groupby(["step", "micro_step"]).start_s.min()
        key = (firsts - d["backward_comm_start_s"]).abs().idxmin()
        if abs(firsts[key] - d["backward_comm_start_s"]) > 0.05:  # not a probed micro-step
            continue
        g = mine[(mine.step == key[0]) & (mine.micro_step == key[1])]
        fwd_end = g[g.kind == "forward"].end_s.max()
        bwd_end = g[g.kind.isin(("backward", "recompute"))].end_s.max()
        a = g[g.kind == "allreduce"]
        rows.append(dict(rank=d["rank"], iteration=d["iteration"], step=key[0],
                         micro_step=key[1],
                         ddp_compute_s=d["backward_compute_time_s"],
                         compute_s=bwd_end - fwd_end,
                         ddp_comm_s=d["backward_comm_time_s"],
                         comm_s=a.end_s.max() - a.start_s.min(),
                         ddp_overlap_s=d["backward_compute_comm_overlap_time_s"],
                         overlap_s=bwd_end - a.start_s.min(),
                         ddp_comm_start_s=d["backward_comm_start_s"],
                         comm_start_s=a.start_s.min(),
                         ddp_comm_end_s=d["backward_comm_end_s"], comm_end_s=a.end_s.max(),
                         ddp_compute_end_s=d["backward_compute_end_s"], compute_end_s=bwd_end))
    return pd.DataFrame(rows)


def rebuilt_buckets(ddp):
    """DDP's bucket sizes in bytes after its rebuild (bucket index order), from its stats."""
    for text in ddp.get("rebuilt_bucket_sizes", ()):
        if text:
            return [int(x) for x in text.split(",")]
    return None


# --------------------------------------------------------------------------- figures
def _lanes_height(world_size):
    return 150 + 95 * world_size


def _lanes(world_size):
    ticks = [(-3 * r, f"rank {r} compute") for r in range(world_size)]
    ticks += [(-3 * r - 1, f"rank {r} all-reduce") for r in range(world_size)]
    return sorted(ticks)


def swimlane_traces(timeline, step=None):
    """Bar traces (one per kind) of one step (the last probed one by default): per rank a
    compute track and an all-reduce track, times in ms from the step's earliest row."""
    import plotly.graph_objects as go

    if timeline.empty:
        return [], None
    step = timeline.step.max() if step is None else step
    g = timeline[timeline.step == step]
    t0 = g.start_s.min()
    traces = []
    for kind in ("forward", "backward", "recompute", "optimizer", "allreduce"):
        k = g[g.kind == kind]
        if kind == "allreduce":  # buckets may run at once (gloo has 2 threads): stagger them
            y = [-3 * r - 1 + (0.2 if b % 2 else -0.2) for r, b in zip(k["rank"], k["bucket"])]
            width, text = 0.38, [f"{b}" for b in k["bucket"]]
        else:
            y = [-3 * r for r in k["rank"]]
            width = 0.5 if kind == "recompute" else 0.8
            text = [n.replace("block ", "b") for n in k["name"]]
        hover = [f"rank {r} micro-step {m}: {kind} {n}<br>{1e3 * (e - s):.2f} ms"
                 + (f", {b / 2**20:.2f} MiB" if b else "")
                 for r, m, n, s, e, b in zip(k["rank"], k.micro_step, k["name"], k.start_s,
                                             k.end_s, k["bytes"])]
        traces.append(go.Bar(name="all-reduce" if kind == "allreduce" else kind, orientation="h", y=y, base=1e3 * (k.start_s - t0),
                             x=1e3 * (k.end_s - k.start_s), width=width, text=text,
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             marker=dict(color=KIND_COLORS[kind],
                                         line=dict(width=0.5, color="white")),
                             hovertext=hover, hoverinfo="text"))
    return traces, int(step)


def _title(kind, link):
    sim = f" · SIMULATED link {link}" if link else ""
    return kind + sim


def swimlane_layout(world_size, step, link=None, height=None):
    ticks = _lanes(world_size)
    # the title at the top of the figure, the legend just above the plot: a legend that wraps
    # to two rows on a narrow figure grows upwards into the margin, not over the title
    return dict(title=dict(text=_title(f"step {step}: what each rank did", link), x=0.01,
                           xanchor="left", y=0.99, yanchor="top", yref="container",
                           font=dict(size=14)),
                barmode="overlay", template="plotly_white", autosize=True,
                height=height or _lanes_height(world_size),
                xaxis=dict(title=dict(text="ms since the step's first event", standoff=4)),
                yaxis=dict(tickvals=[t for t, _ in ticks], ticktext=[n for _, n in ticks],
                           range=[-3 * world_size + 1.4, 0.6], automargin=True),
                legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=11)),
                margin=dict(t=96, b=44, l=10, r=16),
                uniformtext=dict(minsize=8, mode="hide"))


def swimlane_figure(timeline, step=None, link=None):
    """A plotly figure: one lane per rank (compute: forward, backward per block, recompute,
    optimizer; all-reduce: each bucket) for one step."""
    import plotly.graph_objects as go

    traces, step = swimlane_traces(timeline, step)
    world = int(timeline["rank"].max()) + 1 if not timeline.empty else 1
    return go.Figure(traces, layout=swimlane_layout(world, step, link))


def exposed_figure(over, link=None):
    """Exposed and total all-reduce time per probed step, per rank (ms)."""
    import plotly.graph_objects as go

    fig = go.Figure(layout=_exposed_layout(link))
    for k, (r, g) in enumerate(over.groupby("rank", sort=False)):  # or any label of runs
        c, label = COLORS[k % len(COLORS)], f"r{r}" if isinstance(r, Integral) else str(r)
        g = g.groupby("step", as_index=False)[["exposed_comm_s", "comm_s"]].median()
        fig.add_scatter(x=g.step, y=1e3 * g.exposed_comm_s, name=f"exposed {label}",
                        mode="lines+markers", line=dict(color=c, width=2))
        fig.add_scatter(x=g.step, y=1e3 * g.comm_s, name=f"all-reduce {label}",
                        mode="lines", line=dict(color=c, width=1, dash="dot"))
    return fig


def _exposed_layout(link, height=330):
    return dict(title=dict(text=_title("exposed communication per step", link), x=0.01,
                           xanchor="left", y=0.99, yanchor="top", yref="container",
                           font=dict(size=14)),
                template="plotly_white", autosize=True, height=height,
                xaxis=dict(title=dict(text="optimizer step", standoff=4)),
                yaxis=dict(title=dict(text="ms", standoff=4), rangemode="tozero"),
                legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=11)),
                margin=dict(t=96, b=44, l=56, r=16))


BUCKET_MIB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
LINKS = (("loopback (real)", 0.0), ("100 Gbit/s (simulated)", 100.0),
         ("10 Gbit/s (simulated)", 10.0), ("1 Gbit/s (simulated)", 1.0))


def timeline_controls(cfg, style, layout):
    """The Lab's controls for the knobs the timeline shows: DDP's bucket size (0: torch's
    default) and the simulated link (0: the real transport). They only edit the config."""
    import ipywidgets as W

    caps = [("torch default", 0.0)] + [(f"{v:g}", float(v)) for v in BUCKET_MIB]
    if cfg.bucket_cap_mb and float(cfg.bucket_cap_mb) not in dict(caps).values():
        caps.append((f"{cfg.bucket_cap_mb:g}", float(cfg.bucket_cap_mb)))
    links = list(LINKS)
    if cfg.link_gbps and float(cfg.link_gbps) not in dict(links).values():
        links.append((f"{cfg.link_gbps:g} Gbit/s (simulated)", float(cfg.link_gbps)))
    return {"bucket_cap_mb": W.SelectionSlider(options=caps, value=float(cfg.bucket_cap_mb or 0),
                                               description="bucket MiB", style=style,
                                               layout=layout()),
            "link_gbps": W.Dropdown(options=links, value=float(cfg.link_gbps or 0),
                                    description="link", style=style, layout=layout())}


def link_label(cfg):
    """'1 Gbit/s' (', 5 µs' with a latency) for a config with a simulated link, else None."""
    if cfg.link_gbps is None and not cfg.link_latency_us:
        return None
    bw = f"{cfg.link_gbps:g} Gbit/s" if cfg.link_gbps else "no bandwidth limit"
    return bw + (f", {cfg.link_latency_us:g} µs" if cfg.link_latency_us else "")


class LiveTimeline:
    """The Lab's two timeline figures, fed records on the drain thread (`add`) and redrawn by
    `flush` at most ``max_hz`` times a second: the swimlanes of the last probed step (its few
    bars replaced) and the exposed communication per step (one point per probed step)."""

    def __init__(self, world_size=2, max_hz=1.0):
        self.max_hz = max_hz
        self._lock, self._pending, self._last = threading.Lock(), [], 0.0
        self.redraws = 0
        self.lanes = held(swimlane_layout(world_size, "-"))
        self.exposed = held(_exposed_layout(None))
        self.new_run(world_size)
        # each comm opens with its figure whole (fit.py says why); the browser test finds the
        # swimlanes by their class
        opened(self.lanes, classes=["ddpkit-swimlanes"])
        opened(self.exposed)
        self.widget = grid([self.lanes, self.exposed])

    def new_run(self, world_size, link=None):
        with self._lock:
            self._pending = []
        self.world_size, self.link, self._rows, self._over = world_size, link, {}, []
        with self.lanes.batch_update():
            self.lanes.data = []
            self.lanes.update_layout(swimlane_layout(world_size, "-", link))
        with self.exposed.batch_update():
            self.exposed.data = []
            self.exposed.update_layout(_exposed_layout(link))
            for r in range(world_size):
                c = COLORS[r % len(COLORS)]
                self.exposed.add_scatter(x=[], y=[], name=f"exposed r{r}", mode="lines+markers",
                                         line=dict(color=c, width=2))
                self.exposed.add_scatter(x=[], y=[], name=f"all-reduce r{r}", mode="lines",
                                         line=dict(color=c, width=1, dash="dot"))

    def add(self, record):
        if "timeline" in record:
            with self._lock:
                self._pending.append(record)

    def flush(self, force=False):
        """Redraw if a probed step arrived and (unless ``force``) a second has passed."""
        now = time.monotonic()
        if not force and now - self._last < 1.0 / self.max_hz:
            return False
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return False
        self._last = now
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
            self.lanes.layout.title.text = _title(f"step {step}: what each rank did", self.link)
            self.lanes.layout.height = _lanes_height(self.world_size)
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
