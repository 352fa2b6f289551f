"""Small helpers shared by the benchmarks."""
import os
import platform
import statistics

import torch


def machine():
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def summary(values):
    """median and spread (min-max) of a list of seconds, as a short string."""
    med = statistics.median(values)
    return med, f"{med:.3f} s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ab_ratios(rounds, base, resamples=400, seed=0):
    """Step-time ratios of interleaved A/B rounds against the variant ``base``.

    ``rounds``: one dict per round, variant -> that round's step times; ``base``: the name of
    the variant to compare with, or a function of a variant's name giving it (each variant
    against the plain steps that ran beside it). Returns, per variant, ``(pooled, lo, hi)``:
    ``pooled`` is the median of all the variant's steps over the median of all of its base's
    (every round weighs alike, so drift hits both sides); ``lo``-``hi`` a 90% bootstrap interval
    of it, resampling whole rounds (a second run of the benchmark should land inside it)."""
    import random

    rng = random.Random(seed)
    base_of = base if callable(base) else (lambda name: base)

    def pooled(sample, name):
        a = statistics.median([t for r in sample for t in r[name]])
        return a / statistics.median([t for r in sample for t in r[base_of(name)]])

    out = {}
    for name in rounds[0]:
        boot = sorted(pooled([rng.choice(rounds) for _ in rounds], name) for _ in range(resamples))
        out[name] = (pooled(rounds, name), boot[int(0.05 * resamples)],
                     boot[int(0.95 * resamples) - 1])
    return out
