"""``ddpkit demo``: a small sweep on the embedded default (CPU, gloo, 2 ranks), each setting's
step time and peak predicted beside its run, printed as a table and written as one
self-contained HTML report (`report.py`, which also draws `tradeoff`)."""
from __future__ import annotations

import html
import os
import time

from ..config import TrainConfig
from ..devices import resolve_devices
from ..predict.calibrate import cache_path, cached, calibrate
from ..predict.units import fmt_bytes
from .report import pareto, tradeoff, write_html  # noqa: F401  (ddpkit.tradeoff, pareto: here)
from .sweep import sweep

DEMO = dict(model="gpt", n_blocks=8, width=64, seq_len=32, world_size=2, micro_batch=4,
            accum_steps=2, optimizer="adamw", lr=3e-3)
SEGMENTS = [None, 2, 4, 8]
DEMO_STEPS = 40  # the step-time medians are over steps 1..39: a 4-step median was noise


def summary_text(df):
    """The sweep as a text table in human units (what the demo prints)."""
    shown = df.drop(columns=["result", "comm_by_op"]).copy()
    for col in ("activation_bytes", "predicted_activation_bytes", "peak_bytes",
                "predicted_peak_bytes"):
        shown[col] = [fmt_bytes(v) for v in shown[col]]
    shown = shown.rename(columns={"step_time_ms": "step ms", "predicted_step_ms": "predicted ms",
                                  "step_time_iqr_ms": "IQR ms", "activation_bytes": "activations",
                                  "predicted_activation_bytes": "predicted acts",
                                  "peak_bytes": "peak", "predicted_peak_bytes": "predicted peak",
                                  "recompute_flops_ratio": "FLOP ratio"})
    return shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def demo(out="ddpkit-report.html", steps=DEMO_STEPS, segments=SEGMENTS, progress=True,
         predict=True, **overrides):
    """Run the demo sweep, print its table, write the HTML report; returns the DataFrame.

    predict: each setting's step time and peak predicted beside its run (`ddpkit.train`'s
    ``predict``). True (the default) calibrates this machine first where it has no calibration
    (30-60 s once, then cached: a report without the predictions would lack half of what it
    compares); None predicts only where one is cached; False never. Runs on GPUs are not
    predicted here (``sweep(cfg, predict=True)`` calibrates this machine's GPUs and does)."""
    cfg = TrainConfig(**{**DEMO, "steps": steps, **overrides})
    print(f"ddpkit demo: {cfg.model}, {cfg.n_blocks} blocks, width {cfg.width}, "
          f"{cfg.world_size} ranks ({cfg.backend or 'auto'}), micro_batch {cfg.micro_batch} x "
          f"accum {cfg.accum_steps}, {steps} steps per setting, checkpoint segments {segments}",
          flush=True)
    predict, step = _calibration(cfg, predict, progress)
    t0 = time.monotonic()
    df = sweep(cfg, checkpoint=list(segments), progress=progress, predict=predict)
    print(summary_text(df))
    how = how_text(df, cfg, step)
    print("\n" + _plain(how))
    path = write_html(df, cfg, out, how)
    print(f"\n{len(df)} runs in {time.monotonic() - t0:.1f} s; report: {os.path.abspath(path)}")
    return df


STEP = ("step time, <code>ddpkit.estimate(cfg).step_time()</code>, the rank's step simulated "
        "on fake tensors and played on the calibration of ")


def _calibration(cfg, predict, progress):
    """(the sweep's ``predict``, what the report says of the predicted step time): this machine
    calibrated first where ``predict=True`` asks and none is cached (said, with its seconds)."""
    if predict is False:
        return False, "step time not predicted (predict=False)"
    if resolve_devices(cfg.world_size, cfg.backend, cfg.device)[1] != "cpu":
        return False, ("step time not predicted (the ranks run on GPUs: the demo predicts CPU "
                       "ranks; <code>sweep(cfg, predict=True)</code> calibrates the GPUs)")
    machine = cached()
    if machine is not None:
        return predict, STEP + f"{html.escape(machine.name)}, cached"
    if not predict:
        return None, ("step time not predicted (this machine has no calibration: "
                      "<code>ddpkit.calibrate()</code> makes one)")
    print("calibrating this machine for the step-time predictions (once; cached in "
          f"{os.path.dirname(cache_path('-'))})", flush=True)
    t0 = time.monotonic()
    machine = calibrate(progress=progress)
    took = time.monotonic() - t0
    print(f"calibrated in {took:.0f} s", flush=True)
    return predict, STEP + f"{html.escape(machine.name)}, measured before the runs in {took:.0f} s"


def how_text(df, cfg, step):
    """What measured and predicted mean in the report (HTML), with the step time's error;
    ``step``: what the predicted step time is (or why there is none)."""
    peak = ("peak, <code>estimate(cfg).peak()</code>, the heaviest rank's; "
            if df.predicted_peak_bytes.notna().any() else "")
    out = [f"<b>Measured</b>: step time, rank 0's median over steps 1..{cfg.steps - 1} (the "
           f"first pays one-off costs), IQR its spread; peak, the highest of any rank's probed "
           f"steps. <b>Predicted</b>: {step}; {peak}activations, "
           f"<code>estimate(cfg).activations</code>."]
    both = df[["step_time_ms", "predicted_step_ms"]].dropna()
    if len(both):
        err = (100 * (both.predicted_step_ms - both.step_time_ms).abs() / both.step_time_ms)
        out.append(f"The step time's prediction is off by {err.mean():.1f}% on average (at "
                   f"most {err.max():.1f}%) over {len(both)} settings.")
    return " ".join(out)


def _plain(text):
    """The report's HTML sentence as plain text (for the terminal)."""
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", text))
