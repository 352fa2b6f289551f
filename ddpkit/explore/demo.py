"""``ddpkit demo``: a small sweep on the embedded default (CPU, gloo, 2 ranks), printed as a table
and written as one self-contained HTML file with plotly figures (plotly.js inlined, so it opens
offline): activation and peak memory vs segments, step time vs segments, loss curves."""
from __future__ import annotations

import html
import os
import time

from ..config import TrainConfig
from .estimate import estimate
from ..engine.saving import atomic_write_bytes

DEMO = dict(model="gpt", n_blocks=8, width=64, seq_len=32, world_size=2, micro_batch=4,
            accum_steps=2, optimizer="adamw", lr=3e-3)
SEGMENTS = [None, 2, 4, 8]


def figures(table):
    import plotly.graph_objects as go

    rows = list(table)
    x = [str(r["checkpoint"]) for r in rows]
    mem = go.Figure()
    mem.add_bar(x=x, y=[r["activation_bytes"] / 2**20 for r in rows], name="activations, measured")
    mem.add_scatter(x=x, y=[r["predicted_activation_bytes"] / 2**20 for r in rows],
                    name="activations, predicted", mode="markers+lines")
    mem.add_scatter(x=x, y=[r["peak_bytes"] / 2**20 for r in rows], name="peak, measured",
                    mode="markers+lines")
    mem.update_layout(title="Memory per rank vs checkpoint segments", xaxis_title="checkpoint",
                      yaxis_title="MiB")
    tim = go.Figure()
    tim.add_bar(x=x, y=[r["step_time_ms"] for r in rows], name="step time (ms, median)")
    tim.add_scatter(x=x, y=[r["recompute_flops_ratio"] for r in rows], yaxis="y2",
                    name="FLOPs / no checkpointing", mode="markers+lines")
    tim.update_layout(title="Time vs checkpoint segments", xaxis_title="checkpoint",
                      yaxis=dict(title="ms"), yaxis2=dict(title="FLOP ratio", overlaying="y",
                                                          side="right"))
    loss = go.Figure()
    for r in rows:
        res = r["_result"]
        loss.add_scatter(y=res.per_rank("loss", 0), name=f"checkpoint={r['checkpoint']}, rank 0")
    loss.update_layout(title="Loss per step (identical curves: checkpointing changes memory, "
                             "not the maths)", xaxis_title="optimizer step", yaxis_title="loss")
    return mem, tim, loss


def write_html(table, cfg, path):
    mem, tim, loss = figures(table)
    parts = [mem.to_html(full_html=False, include_plotlyjs=True)]
    parts += [f.to_html(full_html=False, include_plotlyjs=False) for f in (tim, loss)]
    est = estimate(cfg)
    body = (f"<h1>ddpkit demo</h1><p>{html.escape(repr(cfg))}</p>"
            f"<p>Model states per rank (predicted): {html.escape(repr(est))}</p>"
            f"{table._repr_html_()}" + "".join(parts))
    doc = f"<!doctype html><html><head><meta charset='utf-8'><title>ddpkit demo</title></head>" \
          f"<body>{body}</body></html>"
    atomic_write_bytes(path, doc.encode("utf-8"))
    return path


def demo(out="ddpkit-report.html", steps=4, segments=SEGMENTS, **overrides):
    """Run the demo sweep, print its table, write the HTML report; returns the Table."""
    from .api import sweep

    cfg = TrainConfig(**{**DEMO, "steps": steps, **overrides})
    print(f"ddpkit demo: {cfg.model}, {cfg.n_blocks} blocks, width {cfg.width}, "
          f"{cfg.world_size} ranks ({cfg.backend or 'auto'}), micro_batch {cfg.micro_batch} x "
          f"accum {cfg.accum_steps}, checkpoint segments {segments}", flush=True)
    t0 = time.monotonic()
    table = sweep(cfg, checkpoint=list(segments))
    print(table.to_markdown())
    path = write_html(table, cfg, out)
    print(f"\n{len(table)} runs in {time.monotonic() - t0:.1f} s; report: {os.path.abspath(path)}")
    return table
