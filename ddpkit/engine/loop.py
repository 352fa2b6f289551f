"""`train_rank(ctx, plan)`: the training loop every rank runs, top to bottom, from a `RankPlan`.

The same function whether `ddpkit.launch` spawned the rank or torchrun started it
(`ddpkit.rank.entry`); it talks to whoever launched it only through ``ctx`` (``ctx.log`` for
records, ``ctx.sync_controls`` for settings changed mid-run). One record per optimizer step.
What is measured, and when, is `measure.Measure`'s business.
"""
from __future__ import annotations

import torch

from ..spec.model import build_model
from . import saving, strategies
from .data import RankBatches, make_dataset
from .measure import Measure
from .policies import install
from .step import train_step, zero_grad
from .timeline import TimelineProbe


def _lr_lambda(warmup):
    return lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0


class LiveSettings:
    """What the Lab may change mid-run, as in force on this rank: ``plan``, the run's plan with
    the changes the kernel sent (the checkpoint setting, the accumulation steps); ``policy``,
    the checkpoint policy installed on ``model``, made again when the setting changes."""

    def __init__(self, plan, model):
        self.plan, self.model = plan, model
        self.policy = install(plan, model)

    def update(self, sent):
        """Apply the settings the kernel sent (the same on every rank, at the same step), each a
        field of the plan; returns the names of those that changed."""
        changed = [k for k, v in sent.items() if getattr(self.plan, k) != v]
        if changed:
            self.plan = self.plan.replace(**{k: sent[k] for k in changed})
        if "checkpoint" in changed:
            self.policy = install(self.plan, self.model)
        return changed


def train_rank(ctx, plan, live=False, resume_from=None, return_weights=True):
    """Train ``plan`` on this rank; log one record per optimizer step; rank 0 returns weights.

    live=True: settings sent from the kernel (``RunHandle.send_control``) are read on rank 0
    and broadcast (about every 0.1 s), so a change lands on every rank at the same step.
    resume_from: a save_dir (its latest complete checkpoint) or a checkpoint folder.
    return_weights=False (the same on every rank): nothing is gathered or copied at the end;
    under torchrun nobody receives them (an FSDP model's full gather to rank 0's memory would
    be for nothing).
    """
    # before anything is built: on CPU the peak probe starts c10's count of live allocations
    measure = Measure(plan, ctx.device, ctx.rank)
    model = build_model(plan)[0].to(ctx.device)
    # the order that works for DDP and FSDP alike: checkpointing first, then wrap (strategies)
    settings = LiveSettings(plan, model)
    # [timeline] what each probed step did, and the simulated link: it watches the comm hook
    timeline = TimelineProbe.from_plan(plan, ctx)
    wrapped, optimizer, comm = strategies.wrap(plan, model, ctx, count_comm="comm" in plan.probes,
                                               watch=timeline.watch if timeline else None)
    if timeline:
        timeline.attach(wrapped)  # collective: aligns the ranks' clocks
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(plan.warmup_steps))
    scaler = torch.amp.GradScaler("cuda") if plan.precision == "fp16" else None
    fsdp = strategies.is_fsdp(plan.strategy)
    saved = wrapped if fsdp else model  # FSDP saves its shards (DCP); DDP the unwrapped module
    # built-in data keep their fixed order (sample i is the same for any world size); a
    # dataset of yours is shuffled by DistributedSampler, seeded, a new order each epoch
    data = RankBatches(measure.left_out(make_dataset, plan), ctx.rank, ctx.world_size,
                       seed=plan.seed, shuffle=not plan.builtin)
    first = consumed = 0
    if resume_from is not None:
        meta = saving.load(ctx, saving.latest(resume_from) or resume_from, saved, optimizer,
                           scheduler, fsdp)
        first, consumed = meta["step"] + 1, meta["consumed"]  # the sampler continues there too
    with measure.running(comm, first, timeline):
        for step in range(first, plan.steps):
            changed = settings.update(ctx.sync_controls(step) if live else {})
            accum = settings.plan.accum_steps
            batches = data.micro_batches(consumed, plan.micro_batch, accum)
            # the samples this step took, all ranks
            consumed += ctx.world_size * plan.micro_batch * accum
            # static_graph + no_sync() on the very first iteration trips an internal assert in
            # DDP's reducer (a known torch bug): the first step syncs every micro-batch instead
            skip_sync = plan.no_sync and not (plan.static_graph and step == 0)
            with measure.step(step, changed, model, optimizer, settings.policy) as acts:
                loss = train_step(wrapped, optimizer, batches, accum_steps=accum,
                                  no_sync=skip_sync, precision=strategies.autocast_precision(plan),
                                  device=ctx.device, scaler=scaler, activation_probe=acts,
                                  inner=model, scheduler=scheduler, loss_fn=plan.loss_fn,
                                  phase=measure.phase)
            record = dict(step=step, loss=loss, step_time_s=measure.seconds,
                          samples_per_s=ctx.world_size * plan.micro_batch * accum / measure.seconds,
                          accum_steps=accum, checkpoint=str(settings.plan.checkpoint),
                          changed=",".join(changed), lr=scheduler.get_last_lr()[0],
                          **measure.read(model, optimizer))  # before zero_grad frees the gradients
            zero_grad(optimizer)
            if plan.save_every and (step + 1) % plan.save_every == 0:
                # collective: every rank writes its part, `latest` moves after a barrier
                saving.save(ctx, plan, step, consumed, saved, optimizer, scheduler,
                            plan.save_dir, fsdp)
                record["saved"] = 1
            ctx.log(**record)
    if not return_weights:
        return None
    weights = strategies.full_state_dict(plan, wrapped, model)  # collective under FSDP
    return weights if ctx.is_main else None
