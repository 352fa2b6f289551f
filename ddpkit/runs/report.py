"""A sweep's figures and its HTML report (what ``ddpkit demo`` writes): the trade-off, measured
beside predicted for the step time, the peak and the activations, and the loss.

The report is one self-contained page: a heading, an HTML table (as tall as its rows: a plotly
table in a subplot grid kept a fixed share of the figure, a blank band under four rows), then
each figure in its own box of a CSS grid, each with its own legend, drawn by plotly (plotly.js
inlined once, so it opens offline) at its box's width.
"""
from __future__ import annotations

import html
import math

from ..engine.saving import atomic_write_bytes
from ..predict.units import byte_unit, fmt_bytes

MEASURED, PREDICTED = "#1f77b4", "#7f7f7f"
"""Measured in colour, predicted in grey and open markers or dashes, in every figure."""


def pareto(cost, memory):
    """Indices of the settings no other setting beats on both cost and memory (lower is better),
    ordered by cost: the frontier of the trade-off."""
    pts = sorted(range(len(cost)), key=lambda i: (cost[i], memory[i]))
    front, best = [], float("inf")
    for i in pts:
        if memory[i] < best:
            front.append(i)
            best = memory[i]
    return front


def settings(df):
    """A short label per row from the grid's columns (those before ``final_loss``)."""
    grid = list(df.columns[:list(df.columns).index("final_loss")])
    return [", ".join(f"{c}={row[c]}" for c in grid) for _, row in df.iterrows()]


def _predicted(df, column):
    """The column's values where the sweep predicted them (None where not, or no column)."""
    if column not in df.columns or not df[column].notna().any():
        return None
    return list(df[column])


def _label_sides(x, lo, hi):
    """Each label on the side of its point away from the nearer edge of the axis' range
    ``lo..hi`` (every point, error bar and prediction the panel draws): a label at the right
    end reads leftwards, inside the plot, instead of running off it."""
    mid = (lo + hi) / 2
    return ["top left" if hi > lo and v > mid else "top right" for v in x]


def _span(x, err, guess):
    """The x range a panel draws: its points, their error bars, the predictions beside them."""
    guess = [g for g in guess or [] if g == g]  # NaN where a setting was not predicted
    low = [v - e for v, e in zip(x, err or [0] * len(x))] + guess
    high = [v + e for v, e in zip(x, err or [0] * len(x))] + guess
    lo, hi = min(low), max(high)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
    return lo - pad, hi + pad


def tradeoff(df, memory="activation_bytes"):
    """Memory against recompute (FLOP ratio) and against step time, one point per setting of
    a `ddpkit.sweep` DataFrame, the Pareto frontier of each panel drawn as a line through its
    settings (larger markers, labelled inside the plot); where the sweep predicted step times,
    the predicted ones beside the measured (open diamonds). ``memory``: ``'activation_bytes'``
    or ``'peak_bytes'``."""
    from plotly.subplots import make_subplots

    if memory not in ("activation_bytes", "peak_bytes"):
        raise ValueError(f"tradeoff(memory={memory!r}): pass 'activation_bytes' or 'peak_bytes'")
    unit, size = byte_unit(df[memory].max())
    mem = [v / size for v in df[memory]]
    labels = settings(df)
    what = "activations" if memory == "activation_bytes" else "peak"
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=("vs recompute (FLOPs, counted)",
                                        "vs step time (median, bars: IQR)"))
    panels = (("recompute_flops_ratio", None, "FLOPs / no checkpointing"),
              ("step_time_ms", "step_time_iqr_ms", "step time (ms)"))
    guess = _predicted(df, "predicted_step_ms")
    for col, (x_key, err_key, title) in enumerate(panels, start=1):
        x = list(df[x_key])
        half = [v / 2 for v in df[err_key]] if err_key else None
        err = dict(type="data", array=half, thickness=1) if err_key else None
        lo, hi = _span(x, half, guess if col == 2 else None)
        fig.add_scatter(x=x, y=mem, mode="markers", text=labels, error_x=err,
                        marker=dict(size=9, color=MEASURED), name="setting",
                        legendgroup="setting", showlegend=col == 1,
                        hovertemplate="%{text}<br>%{x:.4g}, %{y:.4g} " + unit + "<extra></extra>",
                        row=1, col=col)
        front = pareto(x, mem)
        fx = [x[i] for i in front]
        fig.add_scatter(x=fx, y=[mem[i] for i in front],
                        mode="lines+markers+text", text=[labels[i] for i in front],
                        textposition=_label_sides(fx, lo, hi), textfont=dict(size=10),
                        marker=dict(size=13, symbol="star", color="#d62728"),
                        line=dict(color="#d62728", dash="dash"), name="Pareto frontier",
                        legendgroup="pareto", showlegend=col == 1, hoverinfo="skip",
                        row=1, col=col)
        fig.update_xaxes(title_text=title, range=[lo, hi], row=1, col=col)
    if guess is not None:
        fig.add_scatter(x=guess, y=mem, mode="markers", text=labels, name="predicted step time",
                        marker=dict(size=10, symbol="diamond-open", color=PREDICTED,
                                    line=dict(width=2)),
                        hovertemplate="%{text}<br>predicted %{x:.4g} ms<extra></extra>",
                        row=1, col=2)
    # room above the highest point for its label (the labels sit above their points)
    fig.update_yaxes(title_text=f"{what} per rank ({unit})", range=[0, 1.2 * max(mem)],
                     row=1, col=1)
    fig.update_layout(title=f"Trade-off: {what} vs recompute and vs step time, one point per "
                            f"setting", height=420, legend=dict(orientation="h", y=-0.2),
                      template="plotly_white", margin=dict(r=20, t=80))
    return fig


def memory_figure(df):
    """Activations and the step's peak per setting, measured (bars, a line) beside predicted
    (grey: open markers, dashes)."""
    import plotly.graph_objects as go

    labels = settings(df)
    unit, size = byte_unit(max(df["peak_bytes"].max(), df["activation_bytes"].max()))
    fig = go.Figure()
    fig.add_bar(x=labels, y=df.activation_bytes / size, name="activations, measured",
                marker_color=MEASURED)
    fig.add_scatter(x=labels, y=df.predicted_activation_bytes / size, mode="markers",
                    name="activations, predicted",
                    marker=dict(symbol="diamond-open", size=11, color=PREDICTED,
                                line=dict(width=2)))
    fig.add_scatter(x=labels, y=df.peak_bytes / size, mode="markers+lines", name="peak, measured",
                    line=dict(color="#ff7f0e"))
    peak = _predicted(df, "predicted_peak_bytes")
    if peak is not None:
        fig.add_scatter(x=labels, y=[v / size for v in peak], mode="markers+lines",
                        name="peak, predicted", line=dict(color=PREDICTED, dash="dash"),
                        marker=dict(symbol="diamond-open", size=9))
    return _layout(fig, "Memory per rank vs checkpoint segments", unit)


def time_figure(df):
    """Step time per setting: measured (median, bars: ± half the IQR) beside predicted."""
    import plotly.graph_objects as go

    labels = settings(df)
    fig = go.Figure()
    fig.add_bar(x=labels, y=df.step_time_ms, error_y=dict(array=df.step_time_iqr_ms / 2),
                name="measured (median ± IQR/2)", marker_color="#2ca02c")
    guess = _predicted(df, "predicted_step_ms")
    if guess is not None:
        fig.add_scatter(x=labels, y=guess, mode="markers", name="predicted",
                        marker=dict(symbol="diamond-open", size=12, color=PREDICTED,
                                    line=dict(width=2)))
    return _layout(fig, "Step time per setting", "ms")


def loss_figure(df):
    """Rank 0's loss per step, one line per setting."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, res in zip(settings(df), df.result):
        fig.add_scatter(y=res.per_rank("loss", 0), name=label, mode="lines")
    fig = _layout(fig, "Loss per step (identical curves: checkpointing changes memory, not "
                       "the maths)", "loss (rank 0)")
    fig.update_xaxes(title_text="optimizer step")
    return fig


def _layout(fig, title, yunit):
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=15)),
                      height=380, template="plotly_white",
                      legend=dict(orientation="h", x=0, y=-0.15, yanchor="top"),
                      margin=dict(l=60, r=20, t=50, b=40))
    fig.update_yaxes(title_text=yunit, rangemode="tozero")
    return fig


def table_html(df):
    """The sweep as an HTML table: measured beside predicted, with the prediction's error."""
    labels = settings(df)
    time_guess = _predicted(df, "predicted_step_ms") or [math.nan] * len(df)
    peak_guess = _predicted(df, "predicted_peak_bytes") or [math.nan] * len(df)
    head = ("<thead><tr><th rowspan=2>setting</th><th rowspan=2>final loss</th>"
            "<th colspan=4>step time (ms)</th><th colspan=2>activations</th>"
            "<th colspan=3>peak</th><th rowspan=2>FLOP ratio</th></tr><tr>"
            + "".join(f"<th>{h}</th>" for h in ("measured", "IQR", "predicted", "error",
                                                "measured", "predicted", "measured",
                                                "predicted", "error")) + "</tr></thead>")
    rows = []
    for i, row in enumerate(df.itertuples()):
        cells = [labels[i], f"{row.final_loss:.4f}", f"{row.step_time_ms:.2f}",
                 f"{row.step_time_iqr_ms:.2f}", _num(time_guess[i]),
                 _error(time_guess[i], row.step_time_ms), fmt_bytes(row.activation_bytes),
                 fmt_bytes(row.predicted_activation_bytes), fmt_bytes(row.peak_bytes),
                 fmt_bytes(peak_guess[i]), _error(peak_guess[i], row.peak_bytes),
                 f"{row.recompute_flops_ratio:.3f}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class=runs>{head}<tbody>{''.join(rows)}</tbody></table>"


def _num(v):
    return "-" if v != v else f"{v:.2f}"


def _error(predicted, measured):
    """The prediction's error against the measurement, signed, in percent ('-' for none)."""
    if predicted != predicted or not measured:
        return "-"
    err = round(100 * (predicted - measured) / measured, 1)
    return f"{err:+.1f}%" if err else "0.0%"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; font-weight: 600; margin: 0 0 6px; }
p.how { font-size: 13px; color: #444; margin: 0 0 10px; max-width: 1100px; }
table.runs { border-collapse: collapse; font-size: 13px; margin: 0 0 12px; }
table.runs th, table.runs td { border: 1px solid #d8dde6; padding: 3px 8px; text-align: right; }
table.runs th { background: #eef2f8; font-weight: 600; text-align: center; }
table.runs td:first-child { text-align: left; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr));
           gap: 4px 20px; }
.figures .wide { grid-column: 1 / -1; }
.figures > div { min-width: 0; }
"""


def report_html(df, cfg, how=""):
    """The whole page: the heading, what measured and predicted mean (``how``, HTML), the table
    and the figures."""
    import plotly.io as pio

    title = (f"ddpkit demo: {cfg.model}, {cfg.n_blocks} blocks, width {cfg.width}, "
             f"{cfg.world_size} ranks, micro_batch {cfg.micro_batch} x accum {cfg.accum_steps}, "
             f"{cfg.steps} steps per setting")
    figures = [("wide", tradeoff(df)), ("", memory_figure(df)), ("", time_figure(df)),
               ("wide", loss_figure(df))]
    boxes = []
    for i, (cls, fig) in enumerate(figures):
        div = pio.to_html(fig, full_html=False, include_plotlyjs=i == 0, default_width="100%",
                          default_height=f"{fig.layout.height}px",
                          config={"responsive": True, "displaylogo": False})
        boxes.append(f'<div class="{cls}">{div}</div>')
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class=how>{how}</p>{table_html(df)}<div class=figures>{''.join(boxes)}</div>"
            f"</body></html>")


def write_html(df, cfg, path, how=""):
    """The report written atomically to ``path``."""
    atomic_write_bytes(path, report_html(df, cfg, how).encode("utf-8"))
    return path
