"""`train`: a real DDP training run of a config, measured per rank and per step.

The kernel side of training: check the config (`preflight`, the doctor), launch
`ddpkit.engine.loop.train_rank` on the ranks (spawned, or a warm pool), and gather the records
into a `TrainResult` (`result.py`); `sweep.py` does that once per combination of a grid.
"""
from __future__ import annotations

import warnings

from ..config import TrainConfig
from ..devices import resolve_devices
from ..engine import saving
from ..engine.data import check_length, make_dataset
from ..engine.loop import train_rank
from ..pitfalls.doctor import doctor
from ..runtime.launch import check_pool, launch, resolve_pool
from ..runtime.pool import Pool
from ..spec import rng
from . import predicted
from .result import TrainResult


def train(cfg: TrainConfig, pool="shared", on_metric=None, block=True, live=False,
          resume_from=None, check=True, predict=None, **launch_kw):
    """Train ``cfg`` on ``cfg.world_size`` ranks.

    pool: ``"shared"`` (the default) runs on the kernel's warm pool for these ranks (started
    on first use, a fresh launch while it is busy with another run; `ddpkit.shutdown` ends it);
    ``"fresh"`` launches ranks for this run alone; a `ddpkit.Pool` runs on that pool.
    resume_from: a save_dir (resumes from its latest complete checkpoint) or a checkpoint
    folder; the run continues at the step after it, with the same data, RNG and optimizer.
    check: run `ddpkit.doctor` on the config first: the model built on this process and run
    once forward and backward at a micro-batch of at most 2 and at most 16 tokens (about 10 ms
    for the built-ins; building a large model is most of it: GPT-2 small takes 2.5 s and about
    500 MB here). Its warnings are warned about, and every finding (notes too) is kept in
    ``TrainResult.findings``; ``check=False`` skips it.
    predict: the step time and peak predicted beside the run, on a thread of the kernel at the
    lowest CPU priority (`predicted.py`): None (the default) where this machine's calibration
    is cached, the ranks are CPU ranks and the run is not live; True always, calibrating first
    where nothing is cached (CPU ranks: 30-60 s, once; GPUs: this machine's), False never. Probed records gain ``predicted_step_s`` (and
    ``predicted_peak_bytes`` beside ``peak_bytes``); ``TrainResult.prediction`` holds it (a
    non-blocking run's handle: ``run.prediction``).
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                        f"build one with ddpkit.TrainConfig(...)")
    pool = resolve_pool(pool)
    if pool == "shared" and "port" in launch_kw:
        pool = "fresh"  # a port of your choosing is one launch's own: shared ranks have theirs
    if isinstance(pool, Pool):  # refused here, before the doctor and any rank, if it does not fit
        check_pool(pool, cfg.world_size, *resolve_devices(cfg.world_size, cfg.backend,
                                                          cfg.device), named="TrainConfig.")
    kw = dict(on_metric=on_metric, block=block, stall_timeout_s=cfg.stall_timeout_s,
              seed=cfg.seed, world_size=cfg.world_size, backend=cfg.backend, device=cfg.device,
              pool=pool, **launch_kw)
    if resume_from is not None:  # refused here, before any rank starts, if it does not fit
        resume_from = str(saving.check_resume(cfg.rank_plan(), resume_from))
    preflight(cfg)
    findings = check_config(cfg) if check else []
    prediction = predicted.start(cfg, predict, live)  # after the doctor: the kernel is free
    if prediction is not None:
        kw["on_metric"] = prediction.watch(on_metric)
    run = launch(train_rank, cfg.rank_plan(), live=live, resume_from=resume_from, **kw)
    if not block:
        run.findings, run.prediction = findings, prediction
        return run
    if prediction is not None:  # the ranks are done: it has the cores now
        prediction.wait(predicted.WAIT_S)
        prediction.fill()
    return TrainResult(cfg, run.metrics, run.returns[0], run, findings, prediction)


def preflight(cfg):
    """What the kernel can check of your model before any rank starts: the data fill a global
    batch. (What ddpkit switches off on your model, its own checkpointing and its KV cache,
    `spec.model.prepare_for_training`, the doctor reports: a note, or a warning where the factory
    would crash in a trainer of your own.)"""
    if cfg.builtin:
        return
    plan = cfg.rank_plan()
    check_length(plan, make_dataset(plan))


def check_config(cfg):
    """`ddpkit.doctor` on the config's model: warns once per finding to act on (a note, what
    ddpkit already did about something, is only returned); returns every finding."""
    # the hazards are structural: a micro-batch of 2 (short sequences) finds them as well, and
    # the kernel's RNG is left as it was (building the model seeds it)
    small = cfg.replace(micro_batch=min(cfg.micro_batch, 2), seq_len=min(cfg.seq_len, 16))
    with rng.forked():
        findings = doctor(small)
    for f in findings.warnings:
        warnings.warn(f"ddpkit.doctor: {f!r}", stacklevel=3)
    return findings
