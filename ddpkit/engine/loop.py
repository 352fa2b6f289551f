"""`train_rank(ctx, cfg)`: the training loop every rank runs, top to bottom.

The same function whether `ddpkit.launch` spawned the rank or torchrun started it
(`ddpkit.rank.entry`); it talks to whoever launched it only through ``ctx`` (``ctx.log`` for
records, ``ctx.sync_controls`` for settings changed mid-run). One record per optimizer step.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from . import saving, strategies
from .data import RankBatches, make_dataset
from .policies import CheckpointPolicy
from .memory import PeakProbe
from .probes import ActivationProbe, StepTimer, state_bytes
from .spec import build_model
from .step import train_step, zero_grad


def _lr_lambda(warmup):
    return lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0


def train_rank(ctx, cfg, live=False, resume_from=None):
    """Train ``cfg`` on this rank; log one record per optimizer step; rank 0 returns weights.

    live=True: settings sent from the kernel (``RunHandle.send_control``) are read on rank 0
    and broadcast (about every 0.1 s), so a change lands on every rank at the same step.
    resume_from: a save_dir (its latest complete checkpoint) or a checkpoint folder.
    """
    probes = cfg.probes
    # before anything is built: on CPU it starts c10's count of live allocations
    peak = PeakProbe(ctx.device) if "peak" in probes else None
    model = build_model(cfg)[0].to(ctx.device)
    # the order that works for DDP and FSDP alike: checkpointing first, then wrap (strategies)
    CheckpointPolicy.from_config(cfg).apply(model, cfg.blocks_path)
    wrapped, optimizer, comm = strategies.wrap(cfg, model, ctx, count_comm="comm" in probes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup_steps))
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    fsdp = cfg.strategy == "fsdp"
    saved = wrapped if fsdp else model  # FSDP saves its shards (DCP); DDP the unwrapped module
    # built-in data keep their fixed order (sample i is the same for any world size); a
    # dataset of yours is shuffled by DistributedSampler, seeded, a new order each epoch
    # the dataset stays in host memory on a GPU run: left out of the peak
    with peak.leaving_out() if peak else nullcontext():
        dataset = make_dataset(cfg)
    data = RankBatches(dataset, ctx.rank, ctx.world_size, seed=cfg.seed, shuffle=not cfg.builtin)
    acts = ActivationProbe() if "activations" in probes else None
    timer = StepTimer(ctx.device)
    accum, setting, consumed, first = cfg.accum_steps, cfg.checkpoint, 0, 0
    if resume_from is not None:
        path = saving.latest(resume_from) or resume_from
        meta = saving.load(ctx, path, saved, optimizer, scheduler, fsdp)
        first, consumed = meta["step"] + 1, meta["consumed"]  # the sampler continues there too
    for step in range(first, cfg.steps):
        # mid-run changes from the Lab: the same on every rank, at this same step
        sent = ctx.sync_controls(step) if live else {}
        changed = []
        if "checkpoint" in sent and sent["checkpoint"] != setting:
            setting = sent["checkpoint"]
            CheckpointPolicy.from_config(cfg, setting).apply(model, cfg.blocks_path)
            changed.append("checkpoint")
        if "accum_steps" in sent and int(sent["accum_steps"]) != accum:
            accum = int(sent["accum_steps"])
            changed.append("accum_steps")
        batches = data.micro_batches(consumed, cfg.micro_batch, accum)
        consumed += ctx.world_size * cfg.micro_batch * accum  # samples this step took, all ranks
        if comm:
            comm.reset()
        # activation bytes are fixed by the setting and the batch's shapes, and model-state
        # bytes by the model and optimizer: measured at the first step, at the step a change
        # lands and every peak_every steps, and carried between (the activation probe's hook on
        # every saved tensor costs ~0.3 ms a micro-batch on a CPU rank)
        # on CPU the peak probe opens a profiler window that doubles the step it measures:
        # steps 0 (optimizer state is made) and 1 (DDP rebuilds its buckets), every peak_every
        # steps after, and the step a change lands (CUDA's counter is free: every step)
        probe_peak = peak is not None and (ctx.device.type == "cuda" or bool(changed) or
                                           step - first < 2 or (step - 1) % cfg.peak_every == 0)
        sample = step == first or bool(changed) or step % cfg.peak_every == 0 or probe_peak
        probe_acts = acts is not None and sample
        if probe_acts:
            acts.new_step()
        # static_graph + no_sync() on the very first iteration trips an internal assert in
        # DDP's reducer (a known torch bug): the first step syncs every micro-batch instead
        skip_sync = cfg.no_sync and not (cfg.static_graph and step == 0)
        watch = peak.step(model, optimizer, comm.bucket_buffers if comm else None,
                          acts if probe_acts else None) if probe_peak else nullcontext()
        with timer.time(), watch:
            loss = train_step(wrapped, optimizer, batches, accum_steps=accum, no_sync=skip_sync,
                              precision=cfg.precision, device=ctx.device, scaler=scaler,
                              activation_probe=acts if probe_acts else None, inner=model,
                              scheduler=scheduler, loss_fn=cfg.loss_fn,
                              phase=peak.phase if probe_peak else None)
        record = dict(step=step, loss=loss, step_time_s=timer.seconds,
                      samples_per_s=ctx.world_size * cfg.micro_batch * accum / timer.seconds,
                      accum_steps=accum, checkpoint=str(setting), changed=",".join(changed),
                      lr=scheduler.get_last_lr()[0])
        if sample:  # before zero_grad frees the gradients
            states = dict(zip(("param_bytes", "grad_bytes", "optimizer_bytes"),
                              state_bytes(model, optimizer)))
        record.update(states)
        if acts:
            record["activation_bytes"] = acts.max_bytes
        if probe_peak and peak.peak is not None:
            record.update(peak_bytes=peak.peak.bytes, peak_phase=peak.peak.phase,
                          peak_ledger=peak.peak.ledger, peak_by_phase=peak.peak.by_phase,
                          data_bytes=peak.data_bytes)
        if comm:
            record.update(allreduce_calls=comm.calls, allreduce_bytes=comm.bytes)
        zero_grad(optimizer)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            # collective: every rank writes its part, `latest` moves after a barrier
            saving.save(ctx, cfg, step, consumed, saved, optimizer, scheduler, cfg.save_dir, fsdp)
            record["saved"] = 1
        ctx.log(**record)
    weights = strategies.full_state_dict(cfg, wrapped, model)  # collective under FSDP
    return weights if ctx.is_main else None
