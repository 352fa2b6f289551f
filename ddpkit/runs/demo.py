"""The trade-off figure of a sweep, and ``ddpkit demo``: a small sweep on the embedded default
(CPU, gloo, 2 ranks), printed as a table and written as one self-contained HTML file by plotly's
own writer (plotly.js inlined, so it opens offline)."""
from __future__ import annotations

import os
import time

from ..config import TrainConfig
from ..engine.saving import atomic_write_bytes
from ..predict.units import byte_unit, fmt_bytes
from .sweep import sweep

DEMO = dict(model="gpt", n_blocks=8, width=64, seq_len=32, world_size=2, micro_batch=4,
            accum_steps=2, optimizer="adamw", lr=3e-3)
SEGMENTS = [None, 2, 4, 8]
DEMO_STEPS = 40  # the step-time medians are over steps 1..39: a 4-step median was noise


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


def _settings(df):
    """A short label per row from the grid's columns (those before ``final_loss``)."""
    grid = list(df.columns[:list(df.columns).index("final_loss")])
    return [", ".join(f"{c}={row[c]}" for c in grid) for _, row in df.iterrows()]


def tradeoff(df, memory="activation_bytes"):
    """Memory against recompute (FLOP ratio) and against step time, one point per setting of
    a `ddpkit.sweep` DataFrame, the Pareto frontier of each panel drawn as a line through its
    settings (larger markers). ``memory``: ``'activation_bytes'`` or ``'peak_bytes'``."""
    from plotly.subplots import make_subplots

    if memory not in ("activation_bytes", "peak_bytes"):
        raise ValueError(f"tradeoff(memory={memory!r}): pass 'activation_bytes' or 'peak_bytes'")
    unit, size = byte_unit(df[memory].max())
    mem = [v / size for v in df[memory]]
    labels = _settings(df)
    what = "activations" if memory == "activation_bytes" else "peak"
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=("vs recompute (FLOPs, counted)",
                                        "vs step time (median, bars: IQR)"))
    panels = (("recompute_flops_ratio", None, "FLOPs / no checkpointing"),
              ("step_time_ms", "step_time_iqr_ms", "step time (ms)"))
    for col, (x_key, err_key, title) in enumerate(panels, start=1):
        x = list(df[x_key])
        err = dict(type="data", array=[v / 2 for v in df[err_key]], thickness=1) if err_key else None
        fig.add_scatter(x=x, y=mem, mode="markers", text=labels, error_x=err,
                        marker=dict(size=9, color="#1f77b4"), name="setting",
                        legendgroup="setting", showlegend=col == 1,
                        hovertemplate="%{text}<br>%{x:.4g}, %{y:.4g} " + unit + "<extra></extra>",
                        row=1, col=col)
        front = pareto(x, mem)
        fig.add_scatter(x=[x[i] for i in front], y=[mem[i] for i in front],
                        mode="lines+markers+text", text=[labels[i] for i in front],
                        textposition="top right", textfont=dict(size=10),
                        marker=dict(size=13, symbol="star", color="#d62728"),
                        line=dict(color="#d62728", dash="dash"), name="Pareto frontier",
                        legendgroup="pareto", showlegend=col == 1, hoverinfo="skip",
                        row=1, col=col)
        fig.update_xaxes(title_text=title, row=1, col=col)
    fig.update_yaxes(title_text=f"{what} per rank ({unit})", rangemode="tozero", row=1, col=1)
    fig.update_layout(title=f"Trade-off: {what} memory vs compute, one point per setting",
                      height=420, legend=dict(orientation="h", y=-0.2), margin=dict(r=20))
    return fig


def report_figure(df, cfg):
    """One plotly figure for the report: the table, the trade-off, memory per setting, loss."""
    from plotly.subplots import make_subplots

    labels = _settings(df)
    unit, size = byte_unit(max(df["peak_bytes"].max(), df["activation_bytes"].max()))
    fig = make_subplots(
        rows=4, cols=2, vertical_spacing=0.07, horizontal_spacing=0.08,
        row_heights=[0.22, 0.26, 0.26, 0.26],
        specs=[[{"type": "table", "colspan": 2}, None], [{}, {}], [{}, {}], [{"colspan": 2}, None]],
        subplot_titles=("", "activations vs recompute (FLOPs)", "activations vs step time (IQR)",
                        "Memory per rank vs checkpoint segments", "Step time per setting",
                        "Loss per step (identical curves: checkpointing changes memory, "
                        "not the maths)"))
    fig.add_table(header=dict(values=["setting", "final loss", "step ms (median)", "IQR ms",
                                      "activations", "predicted", "peak", "FLOP ratio"],
                              align="left"),
                  cells=dict(values=[labels, [f"{v:.4f}" for v in df.final_loss],
                                     [f"{v:.2f}" for v in df.step_time_ms],
                                     [f"{v:.2f}" for v in df.step_time_iqr_ms],
                                     [fmt_bytes(v) for v in df.activation_bytes],
                                     [fmt_bytes(v) for v in df.predicted_activation_bytes],
                                     [fmt_bytes(v) for v in df.peak_bytes],
                                     [f"{v:.3f}" for v in df.recompute_flops_ratio]],
                             align="left"), row=1, col=1)
    for trace in tradeoff(df).data:
        fig.add_trace(trace, row=2, col=1 if trace.xaxis in (None, "x") else 2)
    fig.update_xaxes(title_text="FLOPs / no checkpointing", row=2, col=1)
    fig.update_xaxes(title_text="step time (ms)", row=2, col=2)
    fig.update_yaxes(title_text=f"activations ({byte_unit(df.activation_bytes.max())[0]})",
                     rangemode="tozero", row=2, col=1)
    fig.add_bar(x=labels, y=df.activation_bytes / size, name="activations, measured",
                marker_color="#1f77b4", row=3, col=1)
    fig.add_scatter(x=labels, y=df.predicted_activation_bytes / size, mode="markers+lines",
                    name="activations, predicted", line=dict(color="#7f7f7f", dash="dash"),
                    row=3, col=1)
    fig.add_scatter(x=labels, y=df.peak_bytes / size, mode="markers+lines", name="peak, measured",
                    line=dict(color="#ff7f0e"), row=3, col=1)
    fig.update_yaxes(title_text=unit, row=3, col=1)
    fig.add_bar(x=labels, y=df.step_time_ms, error_y=dict(array=df.step_time_iqr_ms / 2),
                name="step time (median ± IQR/2)", marker_color="#2ca02c", row=3, col=2)
    fig.update_yaxes(title_text="ms", row=3, col=2)
    for label, res in zip(labels, df.result):
        fig.add_scatter(y=res.per_rank("loss", 0), name=f"loss, {label}", mode="lines",
                        row=4, col=1)
    fig.update_xaxes(title_text="optimizer step", row=4, col=1)
    fig.update_yaxes(title_text="loss (rank 0)", row=4, col=1)
    fig.update_layout(title=f"ddpkit demo: {cfg.model}, {cfg.n_blocks} blocks, width {cfg.width},"
                            f" {cfg.world_size} ranks, micro_batch {cfg.micro_batch} x accum "
                            f"{cfg.accum_steps}, {cfg.steps} steps per setting",
                      height=1500, legend=dict(orientation="h", y=-0.04))
    return fig


def write_html(df, cfg, path):
    """The report as one figure, written by plotly (``to_html``, plotly.js inlined) atomically."""
    import plotly.io as pio

    doc = pio.to_html(report_figure(df, cfg), full_html=True, include_plotlyjs=True,
                      default_width="100%")
    atomic_write_bytes(path, doc.encode("utf-8"))
    return path


def summary_text(df):
    """The sweep as a text table in human units (what the demo prints)."""
    shown = df.drop(columns=["result"]).copy()
    for col in ("activation_bytes", "predicted_activation_bytes", "peak_bytes"):
        shown[col] = [fmt_bytes(v) for v in shown[col]]
    shown = shown.rename(columns={"activation_bytes": "activations",
                                  "predicted_activation_bytes": "predicted",
                                  "peak_bytes": "peak", "recompute_flops_ratio": "FLOP ratio",
                                  "step_time_iqr_ms": "IQR ms"})
    return shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def demo(out="ddpkit-report.html", steps=DEMO_STEPS, segments=SEGMENTS, progress=True,
         **overrides):
    """Run the demo sweep, print its table, write the HTML report; returns the DataFrame."""
    cfg = TrainConfig(**{**DEMO, "steps": steps, **overrides})
    print(f"ddpkit demo: {cfg.model}, {cfg.n_blocks} blocks, width {cfg.width}, "
          f"{cfg.world_size} ranks ({cfg.backend or 'auto'}), micro_batch {cfg.micro_batch} x "
          f"accum {cfg.accum_steps}, {steps} steps per setting, checkpoint segments {segments}",
          flush=True)
    t0 = time.monotonic()
    df = sweep(cfg, checkpoint=list(segments), progress=progress)
    print(summary_text(df))
    path = write_html(df, cfg, out)
    print(f"\n{len(df)} runs in {time.monotonic() - t0:.1f} s; report: {os.path.abspath(path)}")
    return df
