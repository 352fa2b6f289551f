"""`sweep`: one real run per combination of a grid of config values, as a table beside the
predictions (`ddpkit.predict`): measured and predicted activation bytes, the step's peak,
communication, recompute FLOPs.
"""
from __future__ import annotations

import itertools

from ..config import TrainConfig
from ..devices import resolve_devices
from ..predict.estimate import estimate, traced_flops
from ..runtime.launch import resolve_pool
from ..runtime.pool import Pool
from .train import train

NAN = float("nan")


def recompute_flops_ratio(cfg):
    """FLOPs of one micro-batch's forward+backward under cfg's policy over those without
    checkpointing, counted with FlopCounterMode (no clock noise) on the estimate's
    FakeTensorMode model (no memory)."""
    return traced_flops(cfg) / traced_flops(cfg, cfg.checkpoint.with_value(None))


SWEEP_COLUMNS = ("final_loss", "step_time_ms", "predicted_step_ms", "step_time_iqr_ms",
                 "activation_bytes", "predicted_activation_bytes", "peak_bytes",
                 "predicted_peak_bytes", "allreduce_calls", "comm_bytes", "comm_by_op",
                 "recompute_flops_ratio", "result")


def sweep(cfg: TrainConfig, pool="shared", progress=True, predict=None, **grid):
    """One run per combination of the grid's values, e.g.
    ``sweep(cfg, checkpoint=[None, 2, 4], accum_steps=[1, 2])``.

    Returns a ``pandas.DataFrame``, one row per setting in grid order: a column per grid field
    (``None`` shown as ``"none"``), then ``final_loss``; ``step_time_ms`` (median of rank 0's
    steps after the first), ``predicted_step_ms`` (``estimate(cfg).step_time()`` on this
    machine's calibration; NaN where the setting was not predicted) and ``step_time_iqr_ms``
    (their interquartile range: run more ``steps`` when it is wide); ``activation_bytes``
    (measured) and ``predicted_activation_bytes`` (`ddpkit.estimate`); ``peak_bytes`` and
    ``predicted_peak_bytes`` (``estimate(cfg).peak()``, with the step time's prediction: the
    same simulated step; else NaN); ``allreduce_calls``;
    ``comm_bytes`` (median bytes a rank sent per step, every collective) and ``comm_by_op``
    (the last step's, by collective);
    ``recompute_flops_ratio`` (FLOPs over those without checkpointing, counted, not timed); and
    ``result``, the run's `TrainResult` (``df.result[0].per_rank("loss")``).
    `ddpkit.tradeoff(df)` draws memory against recompute and step time.

    predict: as `ddpkit.train`'s, for each setting: None (the default) predicts where this
    machine's calibration is cached, True calibrates first where it is not, False never. Each
    setting's prediction runs beside its run, at the lowest CPU priority.

    progress: a ``tqdm.auto`` bar over every setting's steps (a widget in a notebook, a text bar
    on stderr elsewhere); False for none. pool: ``"shared"`` (the default) runs every setting
    on the kernel's warm pools; ``"fresh"`` launches ranks for each; a `ddpkit.Pool` serves
    the settings of its world size, backend and device (the others run on the shared pools).
    """
    import pandas as pd

    for name, values in grid.items():
        if name not in cfg.to_dict():
            raise ValueError(f"sweep: {name!r} is not a TrainConfig field")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"sweep: {name}= needs a non-empty list of values, got {values!r}")
    combos = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]
    configs = [cfg.replace(**c) for c in combos]  # all checked before anything runs
    pool = resolve_pool(pool)
    given = {}  # a pool passed in serves its (world size, backend, device); the rest run on
    if isinstance(pool, Pool):  # the kernel's shared pools
        given[(pool.world_size, pool.backend, pool.device)], pool = pool, "shared"
    rows = []
    bar = _sweep_bar(progress, sum(c.steps for c in configs))
    try:
        for combo, c in zip(combos, configs):
            key = (c.world_size, *resolve_devices(c.world_size, c.backend, c.device))
            run_on = given.get(key, pool)
            label = ", ".join(f"{k}={_label(k, v, c)}" for k, v in combo.items())
            if bar is not None:  # a new setting: no loss shown until its own first step lands
                bar.set_postfix_str("", refresh=False)
                bar.set_description(label)
            res = train(c, pool=run_on, on_metric=_bar_updater(bar), predict=predict)
            s = res.summary()
            rows.append({**{k: _label(k, v, c) for k, v in combo.items()},
                         "final_loss": s["final_loss"],
                         "step_time_ms": 1000 * s["step_time_s"],
                         "predicted_step_ms": 1000 * s.get("predicted_step_s", NAN),
                         "step_time_iqr_ms": 1000 * s["step_time_iqr_s"],
                         "activation_bytes": int(s.get("activation_bytes", 0)),
                         "predicted_activation_bytes": estimate(c).activations,
                         "peak_bytes": int(s.get("peak_bytes", 0)),
                         "predicted_peak_bytes": s.get("predicted_peak_bytes", NAN),
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
    setting in its one text form ('2', '2 per stack' on a model of several stacks, 'full',
    '1,0,1,0,': `CheckpointSetting.parse` reads it back)."""
    if name == "checkpoint":
        return str(cfg.checkpoint)
    return "none" if v is None else (str(v) if not isinstance(v, (int, float)) else v)
