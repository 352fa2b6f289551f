"""What a collective costs a CPU rank *inside a step*, beyond its time alone.

`rates.collective_points` times each collective alone, back to back, the ranks doing nothing
else. In a step it is issued while the rank computes (DDP's buckets during the backward,
FSDP2's all-gathers and reduce-scatters between blocks), and two costs appear that it does not
see, both measured on the ranks with it (`rates.rank_figures`) and played by `player.py`:

* **its CPU** (`fit`: `Machine.comm_in_step`). Where the ranks fill the cores (CPU ranks: a
  thread a core), every CPU second gloo's threads and the call spend is a second the rank's
  compute does not get: the call's cost (waking gloo's worker, the issue, the work object)
  and its bytes' (copies into and out of its buffers, the sums, the loopback's copies in the
  kernel). `rates.collective_points` reads it with each collective's time, for nothing: the
  process's CPU seconds (every thread) per call; `fit` makes of it a cost per call and per
  byte, by kind and rank count. It replaces one share of a collective's time alone for every
  size (`calibrate.fit_share`, fitted on the reference steps' walls: 1.0 in bench/results.md's
  first run, 0.7 in a calibration at 22:07 the same day), which a 1 MiB all-reduce (its CPU most of its time alone) and a 64 MiB one
  (its CPU a part: the rest is waiting on the loopback) cannot share.
* **its wake-up** (`wake_points`: `Machine.comm_wake`). Issued after the rank computed, a
  collective finds gloo's worker asleep, the peers' too, its buffers out of cache, and the
  ranks arriving apart; back to back it finds them awake. The player adds it to a collective
  that finds the transport idle (FSDP2's all-gathers, each waited on before its block; each
  synced micro-step's buckets), not to one queued behind another (ZeRO-1's broadcasts).
"""
from __future__ import annotations

import time

import torch


def fit(cpu):
    """{"kind": [per_call_s, per_byte_s]} from a rank's CPU seconds per call by size
    ({"kind/world": [(bytes, cpu_s)...]}): the smallest size's as the cost per call, and the
    rest's least squares line through it, per byte (neither below 0)."""
    out = {}
    for key, rows in cpu.items():
        rows = sorted(rows)
        per_call = max(0.0, rows[0][1])
        rest = [(b, c - per_call) for b, c in rows[1:]]
        squares = sum(b * b for b, _ in rest)
        per_byte = max(0.0, sum(b * c for b, c in rest) / squares) if squares else 0.0
        out[key.split("/")[0]] = [per_call, per_byte]
    return out


WAKE_SIZES = (2**16, 2**20, 2**22)
"""Payload bytes the wake-up latency is measured at (64 KiB, 1 MiB, 4 MiB)."""


def wake_points(world, make, clocked, kinds=("allreduce", "allgather", "reduce_scatter",
                                              "broadcast"), sizes=WAKE_SIZES, rounds=9, tick=None):
    """{"kind/world": [(payload bytes, seconds)...]}: what a collective issued after the rank
    computed takes beyond one issued right after the last (`rates.collective_points` times
    them back to back): gloo's worker and the peers' asleep, caches cold, the ranks arriving
    apart. The median over ``rounds`` of a call after a compute chunk (a few ms of matrix
    products, every rank alike), less the median of calls back to back; never below 0.
    ``make(kind, nbytes, world)``: a function running one collective; ``clocked(run, n)``:
    seconds a call of ``n`` back to back (`rates`)."""
    import statistics

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = {}
    for kind in kinds:
        rows = []
        for nbytes in sizes:
            run = make(kind, nbytes, world)
            run()
            hot = statistics.median(clocked(run, 3) for _ in range(3))
            cold = []
            for _ in range(rounds):
                for _ in range(8):  # ~2 ms on one core
                    torch.mm(a, b)
                start = time.perf_counter()
                run()
                cold.append(time.perf_counter() - start)
            rows.append((nbytes, max(0.0, statistics.median(cold) - hot)))
            if tick:
                tick()
        out[f"{kind}/{world}"] = rows
    return out
