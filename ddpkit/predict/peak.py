"""The step's peak, answered: `predicted_peak` (what ``estimate(cfg).peak()`` returns) from the
rank's step simulated on fake tensors (`simulate`), or, for a large model with a setting alike
on every block, composed from the simulations of 3 and 4 blocks (`scale`); memoised per
memory-relevant setting, one simulation per setting at a time.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

from . import scale
from .simulate import simulate
_MEMO, _MEMO_LOCK = {}, threading.Lock()
_RUNNING = {}  # key -> threading.Event: a simulation under way, set when it ends
_NOT_MEMORY = ("steps", "lr", "warmup_steps", "seed", "measure", "save_every", "save_dir",
               "peak_every", "stall_timeout_s")


def _key(cfg, rank):
    d = cfg.to_dict()
    return rank, tuple((k, v if isinstance(v, (str, int, float, bool, type(None))) else
                        (id(v) if callable(v) else repr(v)))
                       for k, v in d.items() if k not in _NOT_MEMORY)


def simulated(cfg, rank, target=None):
    """`simulate(cfg, rank)`, memoised per memory-relevant setting (the Lab and `plan` ask the
    same question often). One simulation per setting at a time: a thread that asks while
    another simulates the same (the Lab's read-out and a cell's ``estimate(cfg).peak()``)
    waits for its answer instead of simulating it again. ``target``: simulate it as a CUDA
    rank on that GPU (`simulate.simulate`'s ``target``; part of the memo's key)."""
    if cfg.strategy == "ddp" and cfg.optimizer != "zero1" and rank:
        # plain DDP: every rank runs the same step on a batch of the same shapes (the template
        # is the rank's first batch, whatever the rank), so rank 0's simulation is every rank's
        return dataclasses.replace(simulated(cfg, 0, target), rank=rank)
    key = _key(cfg, rank) + (target,)
    while True:
        with _MEMO_LOCK:
            hit = _MEMO.get(key)
            if hit is not None and hit[0].model is cfg.model and hit[0].data is cfg.data:
                return hit[1]
            running = _RUNNING.get(key)
            if running is None:
                running = _RUNNING[key] = threading.Event()
                break
        running.wait()  # then the memo has it (or it failed: this thread simulates itself)
    try:
        run = functools.partial(simulate, target=target)
        sim = scale.scaled(run, cfg, rank) if scale.scalable(cfg) else run(cfg, rank)
        with _MEMO_LOCK:
            if len(_MEMO) > 64:
                _MEMO.clear()
            _MEMO[key] = (cfg, sim)
        return sim
    finally:
        with _MEMO_LOCK:
            del _RUNNING[key]
        running.set()


def predicted_peak(cfg, step=None, rank=None):
    """The predicted `Peak` of ``cfg``'s step ``step`` (0: the optimizer state is made; 1 or
    'steady': every step after; None: the higher) on rank ``rank`` (None: the heaviest: the
    rank whose optimizer updates the most parameters, rank 0 on a tie)."""
    if step not in (None, 0, 1, "steady"):
        raise ValueError(f"peak(step={step!r}): pass 0 (the first step, which makes the "
                         f"optimizer state), 1 or 'steady' (every step after), or None (the higher)")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < cfg.world_size):
        raise ValueError(f"peak(rank={rank!r}): pass a rank in 0..{cfg.world_size - 1} or None "
                         f"(the heaviest)")
    sim = simulated(cfg, heaviest_rank(cfg) if rank is None else rank)
    if step is None:
        return max(sim.peaks, key=lambda p: p.bytes)
    return sim.peaks[0 if step == 0 else 1]


def heaviest_rank(cfg, target=None):
    """The rank whose optimizer updates the most parameters (rank 0 on a tie): ZeRO-1's greedy
    partition and FSDP's dim-0 chunks can load one rank more than the others."""
    loads = simulated(cfg, 0, target).loads
    return max(range(cfg.world_size), key=lambda r: (loads[r], -r))
