"""`train_rank(ctx, cfg)`: the training loop every rank runs, top to bottom.

The same function whether `ddpkit.launch` spawned the rank or torchrun started it
(`ddpkit.rank.entry`); it talks to whoever launched it only through ``ctx`` (``ctx.log`` for
records, ``ctx.sync_controls`` for settings changed mid-run). One record per optimizer step.
What is measured, and when, is `measure.Measure`'s business.
"""
from __future__ import annotations

import torch

from . import saving, strategies
from .data import RankBatches, make_dataset
from .measure import Measure
from .spec import build_model
from .step import train_step, zero_grad
from .timeline import TimelineProbe


def _lr_lambda(warmup):
    return lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0


class LiveSettings:
    """What the Lab may change mid-run (the checkpoint setting, the accumulation steps), as in
    force on this rank; the checkpoint setting is installed on ``model`` when it changes."""

    def __init__(self, cfg, model):
        self.cfg, self.model = cfg, model
        self.accum, self.checkpoint = cfg.accum_steps, cfg.checkpointing
        self._install()

    def _install(self):
        self.cfg.checkpoint_policy(self.checkpoint).apply(self.model, self.cfg.blocks_path)

    def update(self, sent):
        """Apply the settings the kernel sent (the same on every rank, at the same step);
        returns the names of those that changed."""
        changed = []
        if "checkpoint" in sent:
            setting = self.cfg.setting(sent["checkpoint"])
            if setting != self.checkpoint:
                self.checkpoint = setting
                self._install()
                changed.append("checkpoint")
        if "accum_steps" in sent and int(sent["accum_steps"]) != self.accum:
            self.accum = int(sent["accum_steps"])
            changed.append("accum_steps")
        return changed


def train_rank(ctx, cfg, live=False, resume_from=None, return_weights=True):
    """Train ``cfg`` on this rank; log one record per optimizer step; rank 0 returns weights.

    live=True: settings sent from the kernel (``RunHandle.send_control``) are read on rank 0
    and broadcast (about every 0.1 s), so a change lands on every rank at the same step.
    resume_from: a save_dir (its latest complete checkpoint) or a checkpoint folder.
    return_weights=False (the same on every rank): nothing is gathered or copied at the end;
    under torchrun nobody receives them (an FSDP model's full gather to rank 0's memory would
    be for nothing).
    """
    # before anything is built: on CPU the peak probe starts c10's count of live allocations
    measure = Measure(cfg, ctx.device, ctx.rank)
    model = build_model(cfg)[0].to(ctx.device)
    # the order that works for DDP and FSDP alike: checkpointing first, then wrap (strategies)
    settings = LiveSettings(cfg, model)
    # [timeline] what each probed step did, and the simulated link: it watches the comm hook
    timeline = TimelineProbe.from_config(cfg, ctx)
    wrapped, optimizer, comm = strategies.wrap(cfg, model, ctx, count_comm="comm" in cfg.probes,
                                               watch=timeline.watch if timeline else None)
    if timeline:
        timeline.attach(wrapped)  # collective: aligns the ranks' clocks
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup_steps))
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    fsdp = strategies.is_fsdp(cfg.strategy)
    saved = wrapped if fsdp else model  # FSDP saves its shards (DCP); DDP the unwrapped module
    # built-in data keep their fixed order (sample i is the same for any world size); a
    # dataset of yours is shuffled by DistributedSampler, seeded, a new order each epoch
    data = RankBatches(measure.left_out(make_dataset, cfg), ctx.rank, ctx.world_size,
                       seed=cfg.seed, shuffle=not cfg.builtin)
    first = consumed = 0
    if resume_from is not None:
        meta = saving.load(ctx, saving.latest(resume_from) or resume_from, saved, optimizer,
                           scheduler, fsdp)
        first, consumed = meta["step"] + 1, meta["consumed"]  # the sampler continues there too
    measure.begin(comm, first, timeline)
    for step in range(first, cfg.steps):
        changed = settings.update(ctx.sync_controls(step) if live else {})
        accum = settings.accum
        batches = data.micro_batches(consumed, cfg.micro_batch, accum)
        consumed += ctx.world_size * cfg.micro_batch * accum  # samples this step took, all ranks
        # static_graph + no_sync() on the very first iteration trips an internal assert in
        # DDP's reducer (a known torch bug): the first step syncs every micro-batch instead
        skip_sync = cfg.no_sync and not (cfg.static_graph and step == 0)
        with measure.step(step, changed, model, optimizer) as acts:
            loss = train_step(wrapped, optimizer, batches, accum_steps=accum, no_sync=skip_sync,
                              precision=strategies.autocast_precision(cfg), device=ctx.device,
                              scaler=scaler,
                              activation_probe=acts, inner=model, scheduler=scheduler,
                              loss_fn=cfg.loss_fn, phase=measure.phase)
        record = dict(step=step, loss=loss, step_time_s=measure.seconds,
                      samples_per_s=ctx.world_size * cfg.micro_batch * accum / measure.seconds,
                      accum_steps=accum, checkpoint=settings.checkpoint.plain,
                      changed=",".join(changed), lr=scheduler.get_last_lr()[0],
                      **measure.read(model, optimizer))  # before zero_grad frees the gradients
        zero_grad(optimizer)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            # collective: every rank writes its part, `latest` moves after a barrier
            saving.save(ctx, cfg, step, consumed, saved, optimizer, scheduler, cfg.save_dir, fsdp)
            record["saved"] = 1
        ctx.log(**record)
    if not return_weights:
        return None
    weights = strategies.full_state_dict(cfg, wrapped, model)  # collective under FSDP
    return weights if ctx.is_main else None
