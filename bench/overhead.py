"""Step time of ddpkit.train against a plain hand-written DDP loop, and the cost of each probe.

    python -m bench.overhead [--rounds 12] [--steps 22] [--device cuda]

Same model, batch, data and checkpointing on 2 CPU ranks (gloo), all in one warm pool and
interleaved round by round (the order reversed every other round), so machine noise hits every
variant alike; each variant's ratio to the plain loop is taken per round, and the median and IQR
of those ratios are reported. The plain loop uses
torch's own checkpoint_sequential and no ddpkit code in its step. Target: ddpkit with every
probe on <= 1.03x the plain loop. ``--device cuda`` runs both on the GPUs, over the backend
ddpkit picks (NCCL with 2+ GPUs, gloo on one shared GPU).
"""
import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint_sequential

import ddpkit
from bench._common import machine, table
from ddpkit.engine.models import SyntheticData, build_model

SKIP = 2  # first steps pay one-off costs (allocator growth, profiler start-up)


def plain_loop(ctx, cfg):
    """What a user would write by hand (nanoGPT-style)."""
    model = build_model(cfg).to(ctx.device)
    cuda = ctx.device.type == "cuda"
    blocks = torch.nn.Sequential(*model.blocks)
    if cfg.checkpoint:
        model.run_blocks = lambda h: checkpoint_sequential(blocks, cfg.checkpoint, h,
                                                           use_reentrant=cfg.use_reentrant)
    ddp = DDP(model, device_ids=[ctx.device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    data = SyntheticData(cfg)
    times, G = [], cfg.global_batch
    for step in range(cfg.steps):
        if cuda:
            torch.cuda.synchronize()  # as ddpkit's StepTimer: queued kernels count
        t0 = time.perf_counter()
        for k, (x, y) in enumerate(data.micro_batches(step * G, ctx.rank, ctx.world_size,
                                                      cfg.micro_batch, cfg.accum_steps)):
            with ddp.no_sync() if k < cfg.accum_steps - 1 else nullcontext():
                loss = ddp(x.to(ctx.device), y.to(ctx.device)) / cfg.accum_steps  # scale for accumulation
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


VARIANTS = {
    "plain hand-written DDP loop": None,
    "ddpkit, probes off": False,
    "ddpkit, activation probe only": ["activations"],
    "ddpkit, all-reduce counter only": ["comm"],
    "ddpkit, peak-memory probe only": ["peak"],
    "ddpkit, all probes on": True,
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=64, seq_len=32, world_size=2,
                             micro_batch=4, accum_steps=2, checkpoint=2, steps=args.steps,
                             device=args.device)
    backend, _ = ddpkit.devices.resolve_devices(2, None, args.device)
    # the peak probe runs at step 1 and every cfg.peak_every (10) steps: the mean shows its cost
    samples = {name: [] for name in VARIANTS}
    ratios = {name: [] for name in VARIANTS}  # per round: this variant's median / plain's
    order = list(VARIANTS.items())
    with ddpkit.Pool(world_size=2, device=args.device) as pool:
        for i in range(args.rounds):
            medians = {}
            for name, measure in (order if i % 2 == 0 else order[::-1]):
                if measure is None:
                    times = pool.launch(plain_loop, cfg).returns[0]
                else:
                    times = ddpkit.train(cfg.replace(measure=measure), pool=pool,
                                         check=False).per_rank("step_time_s")
                samples[name] += times[SKIP:]
                medians[name] = statistics.median(times[SKIP:])
            for name in VARIANTS:
                ratios[name].append(medians[name] / medians["plain hand-written DDP loop"])
    rows = []
    for name, vals in samples.items():
        med = statistics.median(vals)
        q = statistics.quantiles(vals, n=4)
        r = ratios[name]
        rq = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
        rows.append((name, f"{1000 * med:.2f}", f"{1000 * q[0]:.2f}-{1000 * q[2]:.2f}",
                     f"{1000 * statistics.fmean(vals):.2f}",
                     f"{statistics.median(r):.3f}x ({rq[0]:.3f}-{rq[2]:.3f})"))
    ratio = statistics.median(ratios["ddpkit, all probes on"])
    off = statistics.median(ratios["ddpkit, probes off"])
    flag = "" if args.device == "cpu" else f" --device {args.device}"
    text = (f"### Step overhead vs a hand-written DDP loop (`python -m bench.overhead --rounds "
            f"{args.rounds} --steps {args.steps}{flag}`)\n\n"
            f"Median step time of rank 0, {cfg.model} {cfg.n_blocks} blocks width {cfg.width}, "
            f"micro_batch {cfg.micro_batch} x accum {cfg.accum_steps}, checkpoint={cfg.checkpoint}, "
            f"2 ranks {backend} on {args.device}; {args.rounds} rounds x {args.steps - SKIP} steps. Machine: {machine()}\n\n"
            + table(["variant", "median ms", "IQR ms", "mean ms",
                     "vs plain, per round: median (IQR)"], rows)
            + f"\n\nprobes off / plain = {off:.3f}; all probes on / plain = {ratio:.3f} "
              f"(target <= 1.03): {'met' if ratio <= 1.03 else 'MISSED'}. The CPU peak probe "
              f"runs every {cfg.peak_every} steps: the mean shows its cost.\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
