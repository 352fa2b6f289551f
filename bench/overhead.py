"""Time per training step of ddpkit against a plain hand-written DDP loop, and each probe's cost.

    python -m bench.overhead [--rounds 12] [--steps 62] [--device cuda]

Same model, batch, data and checkpointing (the plain loop: torch's checkpoint_sequential) on 2
ranks of one warm pool. The two loops run **step by step in turn in the same processes**: ddpkit's
loop (`train_rank`, as `ddpkit.train` runs it) calls a hook with each record it sends, and the hook
runs one step of the plain loop, on its own model and DDP wrapper, before ddpkit's next step. A
ddpkit step is timed from the end of the plain step before it to its record (so all it does per
step counts: records, probes, bookkeeping), a plain step from start to end; wall time and the
rank's CPU time (every thread of the process). Machine drift, scheduler noise and a shared host's
stolen time hit both sides of each pair alike, which rounds of whole runs in turn could not
achieve on 2 cores (two runs of that design disagreed by up to 9%).

Like with like: both loops run in the same rank processes, so under the same glibc malloc
settings whatever they are (glibc's dynamic mmap threshold, or the one a CPU rank fixes at
its start when ``DDPKIT_MMAP_THRESHOLD`` or glibc's ``MALLOC_MMAP_THRESHOLD_`` says so:
`ddpkit.rank.heap`); the header says which was in force.
The same holds for what ddpkit switches on for the process while its run lasts: while a
variant counts collectives (``comm``), the plain loop's all-reduce passes through the counting
kernel too (uncounted, ~40 us a call); at the run's end it is taken off again
(`ddpkit.engine.measure.Measure.running`), so it never reaches a variant without it.

Per variant (probes on or off) the ratio is median(ddpkit steps) / median(plain steps), all
rounds pooled, with a 90% bootstrap interval that resamples whole rounds: the spread a second
run of the benchmark can show. An A/A row (the plain loop against itself) shows the floor.
Target: every probe on <= 1.03x the plain loop, and the timeline (at its default rate, every
10th step probed: hooks on those steps only) <= 1.03x. ``--device cuda`` runs both on the GPUs, over
the backend ddpkit picks (NCCL with 2+ GPUs, gloo on one shared GPU).
"""
import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint_sequential

import ddpkit
from bench._common import ab_ratios, machine, table
from ddpkit.engine.loop import train_rank
from ddpkit.engine.data import SyntheticData
from ddpkit.spec.model import build_model

SKIP = 2  # first steps pay one-off costs (allocator growth, profiler start-up)


def _now():
    return time.perf_counter(), time.process_time()


class PlainLoop:
    """What a user would write by hand (nanoGPT-style), one optimizer step per call."""

    def __init__(self, ctx, cfg):
        self.cfg, self.ctx = cfg, ctx
        model = build_model(cfg.rank_plan())[0].to(ctx.device)
        self.cuda = ctx.device.type == "cuda"
        segments = cfg.checkpoint.segment_count  # the bench's setting: a count of segments
        if segments:  # the built-in models call model.blocks (an nn.Sequential) as a whole
            blocks = model.blocks
            blocks.forward = lambda h: checkpoint_sequential(blocks, segments, h,
                                                             use_reentrant=cfg.use_reentrant)
        self.ddp = DDP(model, device_ids=[ctx.device.index] if self.cuda else None)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=cfg.lr)
        self.data = SyntheticData(cfg.rank_plan())
        self.step_index = 0

    def step(self):
        cfg, ctx, ddp = self.cfg, self.ctx, self.ddp
        start = self.step_index * cfg.global_batch
        self.step_index += 1
        for k, (x, y) in enumerate(self.data.micro_batches(start, ctx.rank, ctx.world_size,
                                                           cfg.micro_batch, cfg.accum_steps)):
            with ddp.no_sync() if k < cfg.accum_steps - 1 else nullcontext():
                loss = ddp(x.to(ctx.device), y.to(ctx.device)) / cfg.accum_steps  # scale for accumulation
                loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()  # as ddpkit's loss.item() each step


def paired(ctx, cfg, against="ddpkit"):
    """Steps of ddpkit's loop (or, for the A/A row, of a second plain loop) and of the plain
    loop, in turn. Returns [((wall, cpu) of the step, (wall, cpu) of the plain step after it)]."""
    plain, pairs = PlainLoop(ctx, cfg), []
    last = [_now()]

    def after_step():
        done = _now()
        plain.step()
        end = _now()
        pairs.append((tuple(a - b for a, b in zip(done, last[0])),
                      tuple(a - b for a, b in zip(end, done))))
        last[0] = _now()

    if against == "plain":
        other = PlainLoop(ctx, cfg)
        for _ in range(cfg.steps):
            other.step()
            after_step()
        return pairs
    log = ctx.log

    def hook(**record):
        log(**record)  # sent to the kernel, as in every run
        after_step()

    ctx.log = hook
    try:
        train_rank(ctx, cfg.rank_plan())
    finally:
        ctx.log = log
    return pairs


PLAIN = "plain hand-written DDP loop"
TIMELINE = ddpkit.TrainConfig().timeline_every  # the default rate
# variant -> (measure, timeline_every); "all probes on" is the default config
VARIANTS = {
    "plain loop again (A/A: the noise floor)": "plain",
    "ddpkit, probes off": (False, 0),
    "ddpkit, activation probe only": (["activations"], 0),
    "ddpkit, all-reduce counter only": (["comm"], 0),
    "ddpkit, peak-memory probe only": (["peak"], 0),
    f"ddpkit, timeline on (every {TIMELINE} steps)": (False, TIMELINE),
    "ddpkit, all probes on": (True, TIMELINE),
}


def heap(device):
    """glibc's mmap threshold the ranks run with, in words (`ddpkit.rank.heap`)."""
    from ddpkit.devices import GLIBC_MMAP_ENV, mmap_threshold

    fixed = mmap_threshold() if device == "cpu" or os.environ.get(GLIBC_MMAP_ENV) else None
    return (f"glibc's mmap threshold fixed at {fixed} B" if fixed else
            "glibc's dynamic mmap threshold") + " in both loops (the same processes)"


def _beside(name):
    return f"{PLAIN}, beside {name}"


def _mean_cost(rounds, name, base):
    mean = lambda n: statistics.fmean(t for r in rounds for t in r[n])  # noqa: E731
    return mean(name) / mean(base)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=62)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=64, seq_len=32, world_size=2,
                             micro_batch=4, accum_steps=2, checkpoint=2, steps=args.steps,
                             device=args.device)
    backend, _ = ddpkit.devices.resolve_devices(2, None, args.device)
    # one dict per round and clock: variant -> its step times, and the plain steps beside them
    rounds = {"wall": [], "cpu": []}
    order = list(VARIANTS.items())
    with ddpkit.Pool(world_size=2, device=args.device) as pool:
        for i in range(args.rounds):
            got = {"wall": {}, "cpu": {}}
            for name, measure in (order if i % 2 == 0 else order[::-1]):
                against, c = ("plain", cfg) if measure == "plain" else \
                    ("ddpkit", cfg.replace(measure=measure[0], timeline_every=measure[1]))
                pairs = pool.launch(paired, c, against).returns[0][SKIP:]
                for k, clock in enumerate(("wall", "cpu")):
                    got[clock][name] = [p[0][k] for p in pairs]
                    got[clock][_beside(name)] = [p[1][k] for p in pairs]
                    got[clock].setdefault(PLAIN, []).extend(p[1][k] for p in pairs)
            for clock in rounds:
                rounds[clock].append(got[clock])
    stats = {clock: ab_ratios(r, lambda n: PLAIN if n.startswith(PLAIN) else _beside(n))
             for clock, r in rounds.items()}
    rows = []
    for name in [PLAIN, *VARIANTS]:
        row = [name]
        for clock in ("wall", "cpu"):
            vals = [t for r in rounds[clock] for t in r[name]]
            pooled, lo, hi = stats[clock][name]
            row += [f"{1000 * statistics.median(vals):.2f}", f"**{pooled:.3f}x** ({lo:.3f}-{hi:.3f})"]
        rows.append(row)
    cpu, wall = stats["cpu"]["ddpkit, all probes on"], stats["wall"]["ddpkit, all probes on"]
    tl = f"ddpkit, timeline on (every {TIMELINE} steps)"
    tcpu, twall = stats["cpu"][tl], stats["wall"][tl]
    flag = "" if args.device == "cpu" else f" --device {args.device}"
    text = (f"### Step overhead vs a hand-written DDP loop (`python -m bench.overhead --rounds "
            f"{args.rounds} --steps {args.steps}{flag}`)\n\n"
            f"Time per step of rank 0 (end of one iteration to the end of the next), "
            f"{cfg.model} {cfg.n_blocks} blocks width {cfg.width}, micro_batch {cfg.micro_batch} "
            f"x accum {cfg.accum_steps}, checkpoint={cfg.checkpoint} (the plain loop: torch's "
            f"checkpoint_sequential), 2 ranks {backend} on {args.device}; {args.rounds} rounds x "
            f"{args.steps - SKIP} steps of each variant, each step followed by a plain step in the "
            f"same processes; {heap(args.device)}. Ratios: medians of all steps pooled, with a 90% interval from "
            f"resampling whole rounds. Machine: {machine()}\n\n"
            + table(["variant", "wall ms", "wall vs plain (90%)", "CPU ms", "CPU vs plain (90%)"],
                    rows)
            + f"\n\nall probes on / plain: CPU time {cpu[0]:.3f} ({cpu[1]:.3f}-{cpu[2]:.3f}), wall "
              f"time {wall[0]:.3f} ({wall[1]:.3f}-{wall[2]:.3f}); target <= 1.03: "
              f"{'met' if cpu[0] <= 1.03 and wall[0] <= 1.03 else 'MISSED'}. Timeline on / plain: "
              f"CPU time {tcpu[0]:.3f} ({tcpu[1]:.3f}-{tcpu[2]:.3f}), wall time {twall[0]:.3f} "
              f"({twall[1]:.3f}-{twall[2]:.3f}); target <= 1.03: "
              f"{'met' if tcpu[0] <= 1.03 and twall[0] <= 1.03 else 'MISSED'}. The CPU peak probe "
              f"opens a profiler window on step 1 and every {cfg.peak_every} steps that lengthens "
              f"that step: a median does not show it (the peak probe's own row: mean cost "
              f"{_mean_cost(rounds['cpu'], 'ddpkit, peak-memory probe only', _beside('ddpkit, peak-memory probe only')):.3f}x in "
              f"CPU time).\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
