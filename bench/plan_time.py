"""`plan(..., objective="time")` against measured runs: does it pick the fastest?

A 12-block GPT on 2 gloo ranks, its memory budget midway between the peak with every block
checkpointed and the peak with none (so the plan must trade). ``ddpkit.plan`` weighs its
candidates (strategy, micro-batch with accumulation, checkpointing, bucket size) on this
machine's calibration; then every candidate that fits is run for real, in two rounds in
opposite orders (so a drift of the machine hits every candidate alike), and its measured step
time is the median of rank 0's steps after ``WARMUP`` over both rounds. Printed and written as
a section for bench/results.md: each candidate's predicted and measured time and peak, the
plan's choice and the measured fastest, how far apart they are, and the rank correlation of
predicted and measured times. Run it alone.

    python -m bench.plan_time     # about 4 minutes on 2 cores
"""
import statistics
import time

import ddpkit
from bench._common import machine, table

WARMUP, MEASURED = 3, 12
CFG = dict(model="gpt", n_blocks=12, width=64, seq_len=64, vocab=256, micro_batch=8,
           optimizer="adamw", world_size=2, backend="gloo", device="cpu")


def measure(cfg):
    res = ddpkit.train(cfg.replace(steps=WARMUP + MEASURED), check=False, predict=False)
    return [m["step_time_s"] for m in res.metrics if m["rank"] == 0 and m["step"] >= WARMUP], res


def ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r
    return out


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def main(argv=None):
    from ddpkit.predict.peak import predicted_peak

    cfg = ddpkit.TrainConfig(**CFG)
    ddpkit.calibrate(progress=False)
    none, full = (predicted_peak(cfg.replace(checkpoint=c)).bytes for c in (None, "full"))
    budget = (none + full) // 2
    t = time.perf_counter()
    plan = ddpkit.plan(cfg, budget, objective="time", allowance=0)  # the tensors' budget
    plan_s = time.perf_counter() - t
    fitting = [c for c in plan.candidates if c.fits]
    steps = {id(c): [] for c in fitting}
    peaks = {}
    for order in (fitting, fitting[::-1]):
        for c in order:
            times, res = measure(c.config)
            steps[id(c)] += times
            peaks[id(c)] = max(m.get("peak_bytes") or 0 for m in res.metrics)
    ddpkit.shutdown()
    measured = {id(c): statistics.median(steps[id(c)]) for c in fitting}
    fastest = min(fitting, key=lambda c: measured[id(c)])
    chosen = plan.choice
    rows = [(c.label + (" **chosen**" if c is chosen else ""), f"{1e3 * c.seconds:.1f}",
             f"{1e3 * measured[id(c)]:.1f}", f"{100 * (c.seconds / measured[id(c)] - 1):+.1f}%",
             f"{c.peak.bytes:,}", f"{peaks[id(c)]:,}")
            for c in sorted(fitting, key=lambda c: measured[id(c)])]
    rho = spearman([c.seconds for c in fitting], [measured[id(c)] for c in fitting])
    gap = measured[id(chosen)] / measured[id(fastest)] - 1
    text = (f"### The planner on time: chosen vs measured fastest (`python -m bench.plan_time`)"
            f"\n\n{machine()}; {cfg.n_blocks}-block GPT (width {cfg.width}, seq {cfg.seq_len}, "
            f"micro-batch {cfg.micro_batch}, AdamW), 2 gloo ranks; budget {budget:,} B, midway "
            f"between the peak with every block checkpointed ({full:,}) and with none "
            f"({none:,}). `plan(objective='time')` took {plan_s:.1f} s and weighed "
            f"{len(plan.candidates)} candidates, {len(fitting)} fitting; each fitting one run "
            f"twice (two rounds, opposite orders), {MEASURED} measured steps a run.\n\n"
            + table(["candidate", "predicted ms", "measured ms", "error", "predicted peak B",
                     "measured peak B"], rows)
            + f"\n\nChosen: {chosen.label}, measured {1e3 * measured[id(chosen)]:.1f} ms; "
            f"measured fastest: {fastest.label}, {1e3 * measured[id(fastest)]:.1f} ms "
            f"({'the same' if chosen is fastest else f'the choice is {100 * gap:.1f}% slower'}). "
            f"Rank correlation of predicted and measured times: {rho:.2f}.\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
