"""The step's peak, answered: `predicted_peak` (what ``estimate(cfg).peak()`` returns) from the
rank's step simulated on fake tensors (`simulate`), or, for a large model, composed from the
pieces of the model cut to a few blocks (`compose`: one `compose.Library` per config and rank,
whatever its checkpoint setting, so a new setting costs no simulation); memoised per
memory-relevant setting, one simulation per setting at a time.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

from . import scale
from .compose import Library, composable
from .simulate import simulate
from .trace import SCALE_ABOVE
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
    same question often), or for a large model composed (`compose`: its ``stream`` is None;
    `streamed` gives one). One simulation per setting at a time: a thread that asks while
    another simulates the same (the Lab's read-out and a cell's ``estimate(cfg).peak()``)
    waits for its answer instead of simulating it again. ``target``: simulate it as a CUDA
    rank on that GPU (`simulate.simulate`'s ``target``; part of the memo's key)."""
    if cfg.strategy == "ddp" and cfg.optimizer != "zero1" and rank:
        # plain DDP: every rank runs the same step on a batch of the same shapes (the template
        # is the rank's first batch, whatever the rank), so rank 0's simulation is every rank's
        return dataclasses.replace(simulated(cfg, 0, target), rank=rank)
    if composable(cfg, SCALE_ABOVE):
        return _memoised(cfg, _key(cfg, rank) + (target,), lambda: library(
            cfg, rank, target).compose(cfg.checkpoint))
    return _memoised(cfg, _key(cfg, rank) + (target,), lambda: simulate(cfg, rank, target=target))


def streamed(cfg, rank, target=None):
    """A `Simulation` of ``cfg``'s rank with its op stream (what `steptime` plays): `simulated`'s
    where it simulated the whole model; for a composed one, the stream of the model cut to 3 and
    4 blocks extended to all (`scale.streamed`) where the setting is alike on every block, else
    the whole model simulated (its peaks are the composed ones)."""
    sim = simulated(cfg, rank, target)
    if sim.stream is not None:
        return sim
    if cfg.strategy == "ddp" and cfg.optimizer != "zero1" and rank:
        return dataclasses.replace(streamed(cfg, 0, target), rank=rank)

    def make():
        run = functools.partial(simulate, target=target)
        whole = scale.streamed(run, cfg, rank) if scale.scalable(cfg) else run(cfg, rank).stream
        return dataclasses.replace(sim, stream=whole)
    return _memoised(cfg, _key(cfg, rank) + (target, "stream"), make)


def _memoised(cfg, key, make):
    """``make()`` memoised under ``key`` (of ``cfg``), one maker at a time per key."""
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
        sim = make()
        with _MEMO_LOCK:
            if len(_MEMO) > 64:
                _MEMO.clear()
            _MEMO[key] = (cfg, sim)
        return sim
    finally:
        with _MEMO_LOCK:
            del _RUNNING[key]
        running.set()


_LIBRARIES = {}


def library(cfg, rank, target=None):
    """The `compose.Library` of ``cfg``'s rank ``rank`` (as a CUDA rank on ``target``, where
    given): one per config less its checkpoint setting (the pieces of every setting, simulated
    as settings ask for them)."""
    key = _key(cfg.replace(checkpoint=None), rank) + (target,)
    with _MEMO_LOCK:
        hit = _LIBRARIES.get(key)
        if hit is None or hit.cfg.model is not cfg.model or hit.cfg.data is not cfg.data:
            if len(_LIBRARIES) > 16:
                _LIBRARIES.clear()
            hit = _LIBRARIES[key] = Library(cfg, rank, simulate, target)
        return hit


def predicted_peak(cfg, step=None, rank=None, target=None):
    """The predicted `Peak` of ``cfg``'s step ``step`` on rank ``rank`` (None: the heaviest: the
    rank whose optimizer updates the most parameters, rank 0 on a tie). ``step``: 0 (the first
    step, which makes the optimizer state); any step from 1 on, or 'steady' (every step from 1
    on is the steady state: the simulation of step 1 answers them all, so a record's own step
    number can be passed as it is); None: the higher of step 0 and the steady state.
    ``target``: an `attention.CudaTarget`: the rank simulated as a CUDA rank on that GPU (a
    named card's: `gpus.card_target`), whatever device the config runs on here."""
    number = isinstance(step, int) and not isinstance(step, bool)
    steady = (isinstance(step, str) and step == "steady") or (number and step >= 1)
    if not (step is None or steady or (number and step == 0)):
        raise ValueError(f"peak(step={step!r}): pass 0 (the first step, which makes the "
                         f"optimizer state), a step number from 1 on or 'steady' (every step "
                         f"from 1 on is the steady state), or None (the higher)")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < cfg.world_size):
        raise ValueError(f"peak(rank={rank!r}): pass a rank in 0..{cfg.world_size - 1} or None "
                         f"(the heaviest)")
    sim = simulated(cfg, heaviest_rank(cfg, target) if rank is None else rank, target)
    if step is None:
        return max(sim.peaks, key=lambda p: p.bytes)
    return sim.peaks[1 if steady else 0]


def heaviest_rank(cfg, target=None):
    """The rank whose optimizer updates the most parameters (rank 0 on a tie): ZeRO-1's greedy
    partition and FSDP's dim-0 chunks can load one rank more than the others."""
    loads = simulated(cfg, 0, target).loads
    return max(range(cfg.world_size), key=lambda r: (loads[r], -r))
