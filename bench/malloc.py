"""What glibc's dynamic mmap threshold does to a CPU rank: resident memory beside the tensors, and
what fixing the threshold at 128 KiB (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_=131072`` would:
what ddpkit's CPU ranks do under ``DDPKIT_MMAP_THRESHOLD=131072``, `ddpkit.rank.heap`) costs in
step time.

    python -m bench.malloc [--rounds 4] [--steps 9] [--rows gpt2,gpt2_512,gpt]
    python -m bench.malloc --rows gpt256 --rounds 2 --steps 10 --thresholds dynamic,131072,1048576,4194304

glibc serves a block of at least its mmap threshold (128 KiB at first) with its own mapping and
unmaps it when freed; after such a block is freed it raises the threshold to that block's size
(up to 32 MiB), so later blocks of that size come from the heap, which keeps freed memory
resident. A fixed threshold (any ``MALLOC_MMAP_THRESHOLD_``) turns the raising off: every large
block is mapped and unmapped again, its pages zeroed by the kernel at each first touch.

Each round runs every row twice on 2 fresh gloo ranks, in turn (the order alternates from round
to round): ranks started with ``DDPKIT_MMAP_THRESHOLD=dynamic`` (glibc's own) and with 131072
(the forkserver is started again under each). Step time: each run's median over its
unprobed steps from step 2 on (the peak probe's profiler window lengthens the steps it reads);
the ratio (fixed / dynamic) of the medians of the runs, with a 90% bootstrap interval resampling
rounds. Memory: ``process_peak_bytes / peak_bytes`` over the probed steps from step 2 on, both
ranks (the rank's resident high-water mark over the step, its own memory less the bytes live
before the model was built, over the tensors' peak).
"""
import argparse
import os
import random
import statistics
import time

import ddpkit
from bench._common import machine, table
from bench.peak import gpt2_small
from ddpkit import devices

VAR = devices.MMAP_ENV  # DDPKIT_MMAP_THRESHOLD: what CPU ranks fix glibc's threshold at
FIXED = str(devices.MMAP_TIGHT)
PEAK_EVERY = 3  # probed: steps 0, 1, 4, 7, ...; timed: 2, 3, 5, 6, 8, ...


def rows(steps):
    run = dict(world_size=2, steps=steps, peak_every=PEAK_EVERY, optimizer="adamw",
               backend="gloo", device="cpu")
    return {"gpt2": ("GPT-2 small s128 b1 AdamW", dict(model=gpt2_small, seq_len=128,
                                                        micro_batch=1, **run)),
            "gpt2_512": ("GPT-2 small s512 b1 AdamW", dict(model=gpt2_small, seq_len=512,
                                                            micro_batch=1, **run)),
            "gpt256": ("gpt 4 blocks width 256 s128 b4 AdamW (bench.step_time's)",
                       dict(model="gpt", n_blocks=4, width=256, seq_len=128, vocab=256,
                            micro_batch=4, **run)),
            "gpt": ("gpt 4 blocks width 64 (bench.overhead's)",
                    dict(model="gpt", n_blocks=4, width=64, seq_len=32, micro_batch=4,
                         accum_steps=2, checkpoint=2, **{**run, "optimizer": "sgd"}))}


def timed_train(ctx, cfg):
    """`train_rank`, each record also carrying the rank's CPU time (every thread, page faults'
    system time included) since the record before it."""
    from ddpkit.engine.loop import train_rank

    log, last = ctx.log, [time.process_time()]

    def with_cpu(**record):
        now = time.process_time()
        log(cpu_s=now - last[0], **record)
        last[0] = time.process_time()

    ctx.log = with_cpu
    try:
        return train_rank(ctx, cfg.rank_plan(), return_weights=False)
    finally:
        ctx.log = log


def _run(cfg, fixed):
    """One run with the threshold fixed at 128 KiB (``fixed`` True), dynamic (False), or at
    ``fixed`` itself where it is a `DDPKIT_MMAP_THRESHOLD` value (a string)."""
    old = os.environ.pop(VAR, None)
    os.environ[VAR] = fixed if isinstance(fixed, str) else FIXED if fixed else devices.MMAP_DYNAMIC
    try:
        res = ddpkit.launch(timed_train, cfg, world_size=cfg.world_size, backend=cfg.backend,
                            device=cfg.device)
    finally:
        os.environ.pop(VAR, None)
        if old is not None:
            os.environ[VAR] = old
    steady = [m for m in res.metrics if m["step"] >= 2 and "peak_bytes" not in m]
    wall = statistics.median(m["step_time_s"] for m in steady if m["rank"] == 0)
    cpu = statistics.median(m["cpu_s"] for m in steady)  # both ranks
    grown = [m["process_peak_bytes"] / m["peak_bytes"] for m in res.metrics
             if m["step"] >= 2 and "process_peak_bytes" in m]
    return (wall, cpu), grown


def _interval(pairs, resamples=400, seed=0):
    rng = random.Random(seed)

    def ratio(sample):
        return (statistics.median(f for _, f in sample) / statistics.median(d for d, _ in sample))
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(resamples))
    return ratio(pairs), boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]


def _cell(pairs):
    ratio, lo, hi = _interval(pairs)
    return f"**{ratio:.3f}x** ({lo:.3f}-{hi:.3f})"


def sweep(chosen, values, rounds):
    """Each row at each threshold value, in turn (the order reversed every other round): both
    ranks' median CPU time per step, rank 0's median wall time, and the largest process /
    tensors, as a table."""
    out = []
    for key, (name, kw) in chosen.items():
        cfg = ddpkit.TrainConfig(**kw)
        got = {v: [] for v in values}
        for i in range(rounds):
            for v in (values if i % 2 == 0 else values[::-1]):
                got[v].append(_run(cfg, v))
        base = statistics.median(r[0][1] for r in got[values[0]])
        for v in values:
            cpu = statistics.median(r[0][1] for r in got[v])
            out.append([name, v, f"{1e3 * cpu:.1f}", f"{cpu / base:.3f}x",
                        f"{1e3 * statistics.median(r[0][0] for r in got[v]):.1f}",
                        f"{max(g for r in got[v] for g in r[1]):.3f}"])
    return table(["row", VAR, "CPU ms / step", f"CPU vs {values[0]}", "wall ms",
                  "process / tensors (max)"], out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--rows", default="gpt2,gpt2_512,gpt")
    ap.add_argument("--thresholds", default="",
                    help="comma-separated DDPKIT_MMAP_THRESHOLD values to sweep instead")
    args = ap.parse_args(argv)
    chosen = {k: v for k, v in rows(args.steps).items() if k in args.rows.split(",")}
    load = os.getloadavg()
    if args.thresholds:
        text = (f"{args.rounds} rounds, {machine()}, load average at the start {load[0]:.2f}\n\n"
                + sweep(chosen, args.thresholds.split(","), args.rounds) + "\n")
        print(text)
        return text
    out = []
    for key, (name, kw) in chosen.items():
        cfg = ddpkit.TrainConfig(**kw)
        walls, cpus, grown = [], [], {False: [], True: []}
        t0 = time.perf_counter()
        for i in range(args.rounds):
            got = {}
            for fixed in ((False, True) if i % 2 == 0 else (True, False)):
                got[fixed], g = _run(cfg, fixed)
                grown[fixed] += g
            walls.append((got[False][0], got[True][0]))
            cpus.append((got[False][1], got[True][1]))
            print(f"{name} round {i}: wall dynamic {got[False][0]:.3f} s, fixed "
                  f"{got[True][0]:.3f} s; CPU {got[False][1]:.3f} s, {got[True][1]:.3f} s; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        out.append([name, f"{statistics.median(d for d, _ in walls):.3f}",
                    f"{statistics.median(f for _, f in walls):.3f}", _cell(walls),
                    f"{statistics.median(d for d, _ in cpus):.3f}",
                    f"{statistics.median(f for _, f in cpus):.3f}", _cell(cpus),
                    f"{min(grown[False]):.3f}-{max(grown[False]):.3f}",
                    f"{min(grown[True]):.3f}-{max(grown[True]):.3f}",
                    f"{time.perf_counter() - t0:.0f}"])
    text = (f"### glibc's mmap threshold on CPU ranks (`python -m bench.malloc --rounds "
            f"{args.rounds} --steps {args.steps}`)\n\n"
            f"2 fresh gloo ranks per run, each row run with glibc's dynamic threshold "
            f"(`{VAR}=dynamic`) and with `{VAR}={FIXED}` in turn, {args.rounds} rounds. Step time: rank 0's wall-clock "
            f"median over unprobed steps from step 2, and both ranks' CPU time (every thread, "
            f"the kernel's page-zeroing included); ratios fixed / dynamic of the runs' medians, "
            f"90% interval resampling rounds. process / tensors: `process_peak_bytes / peak_bytes`, "
            f"probed steps from step 2, both ranks (min-max). Machine: {machine()}; load "
            f"average at the start {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}\n\n"
            + table(["row", "wall s, dynamic", "wall s, fixed", "wall, fixed / dynamic (90%)",
                     "CPU s, dynamic", "CPU s, fixed", "CPU, fixed / dynamic (90%)",
                     "process / tensors, dynamic", "process / tensors, fixed", "s"], out) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
