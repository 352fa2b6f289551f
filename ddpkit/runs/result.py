"""`TrainResult`: a run's records (one per rank per optimizer step), read: the summary, the
timeline of its probed steps, exposed communication, swimlanes, DDP's own statistics.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..config import TrainConfig
from ..predict.estimate import estimate
from .figures import predicted_swimlane_figure, swimlane_figure
from .timeline import ddp_frame, link_label, overlap, timeline_frame


@dataclass
class TrainResult:
    """``metrics``: one record per rank per optimizer step. ``state_dict``: rank 0's final
    weights on CPU, keys without DDP's ``module.`` prefix."""
    config: TrainConfig
    metrics: list
    state_dict: dict | None
    run: object = field(repr=False, default=None)
    findings: list = field(default_factory=list)
    """What `ddpkit.doctor` found in this config before launch (empty for a clean one)."""
    prediction: object = field(default=None, repr=False)
    """The step time and peak predicted beside the run (`predicted.Prediction`), or None where
    none was (``train(predict=...)``)."""

    def per_rank(self, key, rank=0):
        return [m[key] for m in self.metrics if m["rank"] == rank]

    def summary(self):
        """Medians over steps (after the first, which pays one-off costs) of rank 0; where the
        run was predicted, ``predicted_step_s`` beside ``step_time_s`` and
        ``predicted_peak_bytes`` beside ``peak_bytes`` (or ``prediction_note``: why not)."""
        p = self.prediction
        if p is not None:
            p.fill()  # a prediction that came after the run: its records too
        out = summarize(self.metrics)
        if p is not None and p.step_time is not None:
            out.update(predicted_step_s=p.seconds, predicted_peak_bytes=p.peak_bytes)
        elif p is not None:
            out["prediction_note"] = p.note()
        return out

    # --- [timeline] what DDP did in each probed step (`timeline.py`)
    @property
    def timeline(self):
        """A pandas DataFrame, one row per event per rank on the probed steps
        (``TrainConfig.timeline_every``): ``rank, step, micro_step, kind, name, start_s,
        end_s, bytes`` (and ``bucket``); kinds forward, backward, recompute, allreduce,
        optimizer; seconds on one clock shared by the ranks."""
        return timeline_frame(self.metrics)

    def overlap(self):
        """One row per rank and probed step: ``compute_s``, ``comm_s``, ``exposed_comm_s``
        (all-reduce time with no compute under it) and ``overlap`` (hidden fraction, 0..1)."""
        return overlap(self.timeline)

    def swimlanes(self, step=None, predicted=False):
        """A plotly figure of one probed step (the last by default): one lane per rank with
        forward, backward per block, recompute and the optimizer, and each bucket's
        all-reduce; a simulated link is named in its title. ``predicted=True``: the predicted
        step (``estimate(cfg).step_time().timeline``, the heaviest rank's) below it, hatched,
        on the same time axis (the run's own prediction where it made one; else predicted now,
        calibrating this machine first where it has no calibration)."""
        if not predicted:
            return swimlane_figure(self.timeline, step, link_label(self.config))
        p = self.prediction
        if p is not None and p.step_time is None and p.error is None:
            p.wait()
        if p is not None and p.step_time is not None:
            st = p.step_time
        else:
            st = estimate(self.config).step_time()
        return predicted_swimlane_figure(self.timeline, st, step, link_label(self.config))

    @property
    def ddp_stats(self):
        """DDP's own runtime statistics (``_get_ddp_logging_data()``) per rank and synced
        iteration, on the timeline's clock: what `timeline` is checked against."""
        return ddp_frame(self.metrics)

    def __repr__(self):
        s = self.summary()
        predicted = (f", predicted_step_s={s['predicted_step_s']:.4f}"
                     if "predicted_step_s" in s else "")
        return (f"TrainResult(steps={self.config.steps}, world_size={self.config.world_size}, "
                f"final_loss={s['final_loss']:.4f}, step_time_s={s['step_time_s']:.4f}"
                f"{predicted})")


def summarize(metrics):
    """A run's records in a few figures: medians over rank 0's steps after the first (which
    pays one-off costs), the final loss over all ranks, the highest peak of any rank. Shared by
    `TrainResult.summary` and the Lab's history."""
    m0 = [m for m in metrics if m["rank"] == 0]
    steady = m0[1:] or m0
    peaks = [m["peak_bytes"] for m in metrics if "peak_bytes" in m]  # every rank's: the answer
    out = {"final_loss": statistics.fmean(m["loss"] for m in metrics
                                          if m["step"] == m0[-1]["step"]),
           "step_time_s": statistics.median(m["step_time_s"] for m in steady),
           "step_time_iqr_s": _iqr([m["step_time_s"] for m in steady])}
    stamped = [m["predicted_step_s"] for m in m0 if "predicted_step_s" in m]
    if stamped:  # the run's prediction, on its probed records (`predicted.py`)
        out["predicted_step_s"] = stamped[-1]
    for key in ("activation_bytes", "allreduce_calls", "allreduce_bytes", "optimizer_bytes",
                "comm_bytes"):
        if key in m0[0] and m0[0][key] is not None:
            out[key] = statistics.median(m[key] for m in steady)
    if "comm_by_op" in m0[-1]:
        out["comm_by_op"] = m0[-1]["comm_by_op"]  # the last step's: the steady state
    if peaks:
        out["peak_bytes"] = max(peaks)
    predicted = [m["predicted_peak_bytes"] for m in metrics if "predicted_peak_bytes" in m]
    if predicted:
        out["predicted_peak_bytes"] = max(predicted)
    return out


def _iqr(values):
    """Interquartile range (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]
