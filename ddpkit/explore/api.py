"""`train` and `sweep`: a real DDP training run per config, measured per rank and per step.

The kernel side of training: check the config (`preflight`, the doctor), launch
`ddpkit.engine.loop.train_rank` on the ranks (spawned, or a warm pool), and gather the records
into a `TrainResult`; `sweep` does that once per combination of a grid.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

import torch

from ..config import TrainConfig
from ..engine import rng, saving
from ..engine.data import make_dataset
from ..engine.loop import train_rank
from ..runtime.launch import launch
from ..runtime.pool import Pool, launch_shared


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

    def per_rank(self, key, rank=0):
        return [m[key] for m in self.metrics if m["rank"] == rank]

    def summary(self):
        """Medians over steps (after the first, which pays one-off costs) of rank 0."""
        return summarize(self.metrics)

    # --- [timeline] what DDP did in each probed step (explore/timeline.py)
    @property
    def timeline(self):
        """A pandas DataFrame, one row per event per rank on the probed steps
        (``TrainConfig.timeline_every``): ``rank, step, micro_step, kind, name, start_s,
        end_s, bytes`` (and ``bucket``); kinds forward, backward, recompute, allreduce,
        optimizer; seconds on one clock shared by the ranks."""
        from .timeline import timeline_frame

        return timeline_frame(self.metrics)

    def overlap(self):
        """One row per rank and probed step: ``compute_s``, ``comm_s``, ``exposed_comm_s``
        (all-reduce time with no compute under it) and ``overlap`` (hidden fraction, 0..1)."""
        from .timeline import overlap

        return overlap(self.timeline)

    def swimlanes(self, step=None):
        """A plotly figure of one probed step (the last by default): one lane per rank with
        forward, backward per block, recompute and the optimizer, and each bucket's
        all-reduce; a simulated link is named in its title."""
        from .timeline import link_label, swimlane_figure

        return swimlane_figure(self.timeline, step, link_label(self.config))

    @property
    def ddp_stats(self):
        """DDP's own runtime statistics (``_get_ddp_logging_data()``) per rank and synced
        iteration, on the timeline's clock: what `timeline` is checked against."""
        from .timeline import ddp_frame

        return ddp_frame(self.metrics)

    def __repr__(self):
        s = self.summary()
        return (f"TrainResult(steps={self.config.steps}, world_size={self.config.world_size}, "
                f"final_loss={s['final_loss']:.4f}, step_time_s={s['step_time_s']:.4f})")


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
    for key in ("activation_bytes", "allreduce_calls", "allreduce_bytes", "optimizer_bytes",
                "comm_bytes"):
        if key in m0[0] and m0[0][key] is not None:
            out[key] = statistics.median(m[key] for m in steady)
    if "comm_by_op" in m0[-1]:
        out["comm_by_op"] = m0[-1]["comm_by_op"]  # the last step's: the steady state
    if peaks:
        out["peak_bytes"] = max(peaks)
    return out


def _iqr(values):
    """Interquartile range (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def train(cfg: TrainConfig, pool=None, on_metric=None, block=True, live=False, resume_from=None,
          check=True, **launch_kw):
    """Train ``cfg`` on ``cfg.world_size`` ranks.

    pool: None (the default) runs on the kernel's shared warm pool for these ranks (started on
    first use, a fresh launch while it is busy with another run; `ddpkit.shutdown` ends it);
    False launches fresh ranks for this run alone; a `ddpkit.Pool` runs on that pool.
    resume_from: a save_dir (resumes from its latest complete checkpoint) or a checkpoint
    folder; the run continues at the step after it, with the same data, RNG and optimizer.
    check: run `ddpkit.doctor` on the config first: the model built on this process and run
    once forward and backward at a micro-batch of at most 2 and at most 16 tokens (about 10 ms
    for the built-ins; building a large model is most of it: GPT-2 small takes 2.5 s and about
    500 MB here). Its warnings are warned about, and every finding (notes too) is kept in
    ``TrainResult.findings``; ``check=False`` skips it.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                        f"build one with ddpkit.TrainConfig(...)")
    kw = dict(on_metric=on_metric, block=block, stall_timeout_s=cfg.stall_timeout_s,
              seed=cfg.seed, **launch_kw)
    if pool is None or pool is True:
        # a port of your choosing is one launch's own: shared ranks already have theirs
        pool = False if "port" in launch_kw else None
    if pool is None or pool is False:
        kw.update(world_size=cfg.world_size, backend=cfg.backend, device=cfg.device)
    elif not isinstance(pool, Pool):
        raise TypeError(f"pool={pool!r}: pass None (the shared warm pool), False (fresh ranks) "
                        f"or a ddpkit.Pool")
    elif pool.world_size != cfg.world_size:
        raise ValueError(f"TrainConfig.world_size={cfg.world_size} but the pool has "
                         f"{pool.world_size} ranks; pass a matching pool or pool=None")
    else:
        from ..devices import resolve_devices

        backend, device = resolve_devices(cfg.world_size, cfg.backend, cfg.device)
        if (backend, device) != (pool.backend, pool.device):
            raise ValueError(f"TrainConfig asks for {backend} on {device}, the pool runs "
                             f"{pool.backend} on {pool.device}; pass a matching pool or pool=None")
    if resume_from is not None:  # refused here, before any rank starts, if it does not fit
        resume_from = str(saving.check_resume(cfg, resume_from))
    preflight(cfg)
    findings = check_config(cfg) if check else []
    if pool is None:
        run = launch_shared(train_rank, cfg, live=live, resume_from=resume_from, **kw)
    else:
        run = launch(train_rank, cfg, live=live, pool=pool or None, resume_from=resume_from, **kw)
    if not block:
        run.findings = findings
        return run
    return TrainResult(cfg, run.metrics, run.returns[0], run, findings)


def preflight(cfg):
    """What the kernel can check of your model before any rank starts: the data fill a global
    batch. (What ddpkit switches off on your model, its own checkpointing and its KV cache,
    `spec.prepare_for_training`, the doctor reports: a note, or a warning where the factory
    would crash in a trainer of your own.)"""
    from ..engine.data import check_length

    if cfg.builtin:
        return
    check_length(cfg, make_dataset(cfg))


def check_config(cfg):
    """`ddpkit.doctor` on the config's model: warns once per finding to act on (a note, what
    ddpkit already did about something, is only returned); returns every finding."""
    import warnings

    from ..pitfalls.doctor import doctor

    # the hazards are structural: a micro-batch of 2 (short sequences) finds them as well, and
    # the kernel's RNG is left as it was (building the model seeds it)
    small = cfg.replace(micro_batch=min(cfg.micro_batch, 2), seq_len=min(cfg.seq_len, 16))
    with rng.forked():
        findings = doctor(small)
    for f in findings.warnings:
        warnings.warn(f"ddpkit.doctor: {f!r}", stacklevel=3)
    return findings


def recompute_flops_ratio(cfg):
    """FLOPs of one micro-batch's forward+backward under cfg's policy over those without
    checkpointing, counted with FlopCounterMode (no clock noise) on the estimate's
    FakeTensorMode model (no memory)."""
    from .estimate import traced_flops

    return traced_flops(cfg) / traced_flops(cfg, cfg.setting(None))


SWEEP_COLUMNS = ("final_loss", "step_time_ms", "step_time_iqr_ms", "activation_bytes",
                 "predicted_activation_bytes", "peak_bytes", "allreduce_calls", "comm_bytes",
                 "comm_by_op", "recompute_flops_ratio", "result")


def sweep(cfg: TrainConfig, pool=None, progress=True, **grid):
    """One run per combination of the grid's values, e.g.
    ``sweep(cfg, checkpoint=[None, 2, 4], accum_steps=[1, 2])``.

    Returns a ``pandas.DataFrame``, one row per setting in grid order: a column per grid field
    (``None`` shown as ``"none"``), then ``final_loss``; ``step_time_ms`` (median of rank 0's
    steps after the first) and ``step_time_iqr_ms`` (their interquartile range: run more
    ``steps`` when it is wide); ``activation_bytes`` (measured) and
    ``predicted_activation_bytes`` (`ddpkit.estimate`); ``peak_bytes``; ``allreduce_calls``;
    ``comm_bytes`` (median bytes a rank sent per step, every collective) and ``comm_by_op``
    (the last step's, by collective);
    ``recompute_flops_ratio`` (FLOPs over those without checkpointing, counted, not timed); and
    ``result``, the run's `TrainResult` (``df.result[0].per_rank("loss")``).
    `ddpkit.tradeoff(df)` draws memory against recompute and step time.

    progress: a ``tqdm.auto`` bar over every setting's steps (a widget in a notebook, a text bar
    on stderr elsewhere); False for none. pool: None (the default) runs every setting on the
    kernel's shared warm pools; False launches fresh ranks for each; a `ddpkit.Pool` serves the
    settings of its world size, backend and device.
    """
    import pandas as pd

    from .estimate import estimate
    from ..devices import resolve_devices

    for name, values in grid.items():
        if name not in cfg.to_dict():
            raise ValueError(f"sweep: {name!r} is not a TrainConfig field")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"sweep: {name}= needs a non-empty list of values, got {values!r}")
    combos = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]
    configs = [cfg.replace(**c) for c in combos]  # all checked before anything runs
    given = {}  # a pool passed in serves its (world size, backend, device); the rest run on
    if isinstance(pool, Pool):  # the kernel's shared pools (or fresh ranks with pool=False)
        given[(pool.world_size, pool.backend, pool.device)] = pool
    rows = []
    bar = _sweep_bar(progress, sum(c.steps for c in configs))
    try:
        for combo, c in zip(combos, configs):
            key = (c.world_size, *resolve_devices(c.world_size, c.backend, c.device))
            run_on = given.get(key, False if pool is False else None)
            label = ", ".join(f"{k}={_label(k, v, c)}" for k, v in combo.items())
            if bar is not None:  # a new setting: no loss shown until its own first step lands
                bar.set_postfix_str("", refresh=False)
                bar.set_description(label)
            res = train(c, pool=run_on, on_metric=_bar_updater(bar))
            s = res.summary()
            rows.append({**{k: _label(k, v, c) for k, v in combo.items()},
                         "final_loss": s["final_loss"],
                         "step_time_ms": 1000 * s["step_time_s"],
                         "step_time_iqr_ms": 1000 * s["step_time_iqr_s"],
                         "activation_bytes": int(s.get("activation_bytes", 0)),
                         "predicted_activation_bytes": estimate(c).activations,
                         "peak_bytes": int(s.get("peak_bytes", 0)),
                         "allreduce_calls": int(s.get("allreduce_calls", 0)),
                         "comm_bytes": int(s.get("comm_bytes", 0)),
                         "comm_by_op": s.get("comm_by_op", {}),
                         "recompute_flops_ratio": round(recompute_flops_ratio(c), 4),
                         "result": res})
    finally:
        if bar is not None:
            bar.close()
    return pd.DataFrame(rows, columns=[*grid, *SWEEP_COLUMNS])


def _sweep_bar(progress, total):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", leave=True)


def _bar_updater(bar):
    """on_metric for a sweep's bar: one tick per optimizer step of rank 0 (drain thread)."""
    if bar is None:
        return None

    def tick(record):
        if record["rank"] == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
    return tick


def _label(name, v, cfg):
    """A grid value as the table shows it: numbers as numbers, None as 'none', a checkpoint
    setting in its one text form ('full', '1,0,1,0,')."""
    if name == "checkpoint" and not isinstance(v, int):
        return str(cfg.checkpointing)
    return "none" if v is None else (str(v) if not isinstance(v, (int, float)) else v)
