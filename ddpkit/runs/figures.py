"""The static figures of a run's records: the timeline's swimlanes and exposed communication
(`timeline.py` reads the rows), and the bytes each rank sent by collective beside the ZeRO
paper's rule. The Lab's live figures reuse their traces and layouts (`ddpkit.lab`).
"""
from __future__ import annotations

from numbers import Integral

from ..predict.units import byte_unit
from ..predict.zero import comm_volume

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
"""One colour per rank (or per run), in order: the live plots and the static figures alike."""
KIND_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "recompute": "#e45756",
               "optimizer": "#54a24b", "allreduce": "#b279a2"}


def lanes_height(world_size):
    return 150 + 95 * world_size


def _lanes(world_size, ranks=None):
    ticks = []
    for r in range(world_size) if ranks is None else ranks:
        ticks += [(-3 * r, f"rank {r} compute"), (-3 * r - 1, f"rank {r} all-reduce")]
    return sorted(ticks)


PREDICTED = dict(shape="/", fgcolor="white", fgopacity=0.7, size=6)
"""The predicted bars' hatching (`predicted_swimlane_figure`): set apart from measured ones."""


def swimlane_traces(timeline, step=None, predicted=False):
    """Bar traces (one per kind) of one step (the last probed one by default): per rank a
    compute track and an all-reduce track, times in ms from the step's earliest row.
    ``predicted``: a predicted step's rows, its bars hatched and out of the legend (each in its
    kind's legend group, so a click on the kind hides both)."""
    import plotly.graph_objects as go

    if timeline.empty:
        return [], None
    step = timeline.step.max() if step is None else step
    g = timeline[timeline.step == step]
    t0 = g.start_s.min()
    traces, who = [], "predicted " if predicted else ""
    for kind in ("forward", "backward", "recompute", "optimizer", "allreduce"):
        k = g[g.kind == kind]
        if kind == "allreduce":  # buckets may run at once (gloo has 2 threads): stagger them
            y = [-3 * r - 1 + (0.2 if b % 2 else -0.2) for r, b in zip(k["rank"], k["bucket"])]
            width, text = 0.38, [f"{b}" for b in k["bucket"]]
        else:
            y = [-3 * r for r in k["rank"]]
            width = 0.5 if kind == "recompute" else 0.8
            text = [n.replace("block ", "b") for n in k["name"]]
        hover = [f"{who}rank {r} micro-step {m}: {kind} {n}<br>{1e3 * (e - s):.2f} ms"
                 + (f", {b / 2**20:.2f} MiB" if b else "")
                 for r, m, n, s, e, b in zip(k["rank"], k.micro_step, k["name"], k.start_s,
                                             k.end_s, k["bytes"])]
        name = "all-reduce" if kind == "allreduce" else kind
        traces.append(go.Bar(name=name, orientation="h", y=y, base=1e3 * (k.start_s - t0),
                             x=1e3 * (k.end_s - k.start_s), width=width, text=text,
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             marker=dict(color=KIND_COLORS[kind],
                                         line=dict(width=0.5, color="white"),
                                         pattern=PREDICTED if predicted else None),
                             opacity=0.8 if predicted else None, legendgroup=name,
                             showlegend=not predicted, hovertext=hover, hoverinfo="text"))
    return traces, int(step)


def titled(kind, link):
    sim = f" · SIMULATED link {link}" if link else ""
    return kind + sim


def swimlane_layout(world_size, step, link=None, height=None):
    ticks = _lanes(world_size)
    # the title at the top of the figure, the legend just above the plot: a legend that wraps
    # to two rows on a narrow figure grows upwards into the margin, not over the title
    return dict(title=dict(text=titled(f"step {step}: what each rank did", link), x=0.01,
                           xanchor="left", y=0.99, yanchor="top", yref="container",
                           font=dict(size=14)),
                barmode="overlay", template="plotly_white", autosize=True,
                height=height or lanes_height(world_size),
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


def predicted_swimlane_figure(timeline, predicted, step=None, link=None):
    """One probed step measured (above: every rank's lanes) and the step predicted for the
    same config (below, hatched: the heaviest rank's lanes, ``estimate(cfg).step_time()``), on
    one time axis in ms from each step's first event. ``predicted``: a `StepTime`."""
    from plotly.subplots import make_subplots

    measured, step = swimlane_traces(timeline, step)
    guess_tl = predicted.timeline
    guess, _ = swimlane_traces(guess_tl, predicted=True)
    world = int(timeline["rank"].max()) + 1 if not timeline.empty else 1
    ranks = sorted({int(r) for r in guess_tl["rank"]}) or [0]
    lanes = world + len(ranks)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[world / lanes, len(ranks) / lanes])
    for row, traces in ((1, measured), (2, guess)):
        for t in traces:
            fig.add_trace(t, row=row, col=1)
    layout = swimlane_layout(world, step, link, height=lanes_height(lanes) + 30)
    fig.update_layout({k: v for k, v in layout.items() if k not in ("xaxis", "yaxis")})
    guessed = f"predicted {1e3 * predicted.seconds:.1f} ms (below, hatched)"
    if step is None:  # no probed step: the prediction alone
        title = f"no step measured (TrainConfig.timeline_every picks them); {guessed}"
    else:
        g = timeline[timeline.step == step]
        title = f"step {step}: measured {1e3 * (g.end_s.max() - g.start_s.min()):.1f} ms " \
                f"(above), {guessed}"
    fig.update_layout(title_text=titled(title, link))
    for row, lanes, rng, what in ((1, _lanes(world), [-3 * world + 1.4, 0.6], "measured"),
                                  (2, _lanes(0, ranks), [-3 * ranks[-1] - 1.6, -3 * ranks[0] + 0.6],
                                   "predicted")):
        fig.update_yaxes(tickvals=[t for t, _ in lanes], ticktext=[n for _, n in lanes],
                         range=rng, automargin=True, title=dict(text=what, standoff=6),
                         row=row, col=1)
    fig.update_xaxes(title=dict(text="ms since the step's first event", standoff=4), row=2, col=1)
    return fig


def exposed_figure(over, link=None):
    """Exposed and total all-reduce time per probed step, per rank (ms)."""
    import plotly.graph_objects as go

    fig = go.Figure(layout=exposed_layout(link))
    for k, (r, g) in enumerate(over.groupby("rank", sort=False)):  # or any label of runs
        c, label = COLORS[k % len(COLORS)], f"r{r}" if isinstance(r, Integral) else str(r)
        g = g.groupby("step", as_index=False)[["exposed_comm_s", "comm_s"]].median()
        fig.add_scatter(x=g.step, y=1e3 * g.exposed_comm_s, name=f"exposed {label}",
                        mode="lines+markers", line=dict(color=c, width=2))
        fig.add_scatter(x=g.step, y=1e3 * g.comm_s, name=f"all-reduce {label}",
                        mode="lines", line=dict(color=c, width=1, dash="dot"))
    return fig


def exposed_layout(link, height=330):
    return dict(title=dict(text=titled("exposed communication per step", link), x=0.01,
                           xanchor="left", y=0.99, yanchor="top", yref="container",
                           font=dict(size=14)),
                template="plotly_white", autosize=True, height=height,
                xaxis=dict(title=dict(text="optimizer step", standoff=4)),
                yaxis=dict(title=dict(text="ms", standoff=4), rangemode="tozero"),
                legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=11)),
                margin=dict(t=96, b=44, l=56, r=16))


def comm_figure(runs):
    """Bytes each rank sent per step, by collective, one stacked bar per run: a `ddpkit.sweep`
    DataFrame (its ``comm_by_op`` column) or a list of `TrainResult`s (rank 0's last step).
    Where the paper's rule covers a run's config, a marker shows it."""
    import plotly.graph_objects as go

    if hasattr(runs, "columns"):  # a sweep's table
        results = list(runs["result"])
        grid = [c for c in runs.columns if c not in ("result",) and c in results[0].config.to_dict()]
        labels = [", ".join(f"{c}={runs[c][i]}" for c in grid) or f"run {i}"
                  for i in range(len(runs))]
    else:
        results = list(runs)
        labels = [f"{r.config.strategy} x{r.config.world_size}" for r in results]
    by_op = [[m for m in r.metrics if m["rank"] == 0][-1].get("comm_by_op", {}) for r in results]
    unit, size = byte_unit(max([sum(b.values()) for b in by_op] + [1]))
    fig = go.Figure()
    for op in sorted({op for b in by_op for op in b}):
        fig.add_bar(x=labels, y=[b.get(op, 0) / size for b in by_op], name=op)
    rules = []
    for r in results:
        try:
            rules.append(sum(comm_volume(r.config).values()) / size)
        except ValueError:
            rules.append(None)
    if any(v is not None for v in rules):
        fig.add_scatter(x=labels, y=rules, mode="markers", name="ZeRO paper's rule",
                        marker=dict(symbol="line-ew-open", size=30, color="black",
                                    line=dict(width=3)))
    fig.update_layout(barmode="stack", title="sent per rank per step, every collective",
                      yaxis_title=unit, height=380, margin=dict(l=60, r=20, t=50, b=60))
    return fig
