"""`plan`: what to use under a memory budget, by the least recompute (``objective="memory"``,
`plan.py`) or by the shortest step (``objective="time"``, here).

The time objective searches what trades memory for time at the same global batch:

* the strategy: ddp, ddp_zero1 (with a stateful optimizer), zero2, fsdp;
* the micro-batch, with accumulation making up the rest of the batch (powers of 2 from the
  config's micro-batch times its accumulation down to 1);
* checkpointing: none where the step fits without it (checkpointing only adds recompute),
  else the fewest checkpointed segments that fit (a binary search over 2, 3, 4, 6, 8...
  segments, then every block: each look one simulated step);
* DDP's bucket size: torch's default, 1, 4 or 100 MiB (it changes only when the all-reduces
  start, so the step is simulated once and played for each).

Each candidate's step is simulated once (memoised: the same as ``estimate(cfg).peak()``), its
peak checked against the budget and its time played on the machine (`steptime`). For each
strategy the micro-batches are tried from the largest down, and the first that fits without
checkpointing ends that strategy's search (a smaller one only adds micro-steps). The answer is
the fastest candidate that fits, with every candidate it weighed and the frontier (the
candidates no other beats on both the peak and the time).
"""
from __future__ import annotations

import dataclasses

from ..config import TrainConfig
from . import hardware
from .gpus import allocator_allowance, budget_bytes, card_target, gpu_name, is_card
from .peak import predicted_peak
from .plan import plan as memory_plan
from .steptime import step_time
from .units import fmt_bytes

STRATEGIES = ("ddp", "ddp_zero1", "zero2", "fsdp")
BUCKETS_MB = (None, 1, 4, 100)


@dataclasses.dataclass
class Candidate:
    """One setting weighed: ``changes`` to the config, its predicted ``peak`` (a `Peak`) and
    ``time`` (a `StepTime`), and whether the peak fits the budget."""
    changes: dict
    config: object = dataclasses.field(repr=False)
    peak: object = dataclasses.field(repr=False)
    time: object = dataclasses.field(repr=False)
    fits: bool = False

    @property
    def seconds(self):
        return self.time.seconds

    @property
    def label(self):
        return ", ".join(f"{k}={v}" for k, v in self.changes.items())


@dataclasses.dataclass
class TimePlan:
    """``plan(..., objective="time")``'s answer: ``choice`` (the fastest `Candidate` that
    fits, or None), ``candidates`` (every one weighed) and ``frontier`` (those no other beats on
    both peak and time, fastest first)."""
    budget: int
    choice: Candidate | None
    candidates: list = dataclasses.field(repr=False)
    config: object = dataclasses.field(repr=False, default=None)
    reason: str = ""

    @property
    def fits(self):
        return self.choice is not None

    @property
    def frontier(self):
        out, best = [], None
        for c in sorted(self.candidates, key=lambda c: (c.seconds, c.peak.bytes)):
            if best is None or c.peak.bytes < best:
                out.append(c)
                best = c.peak.bytes
        return out

    def apply(self, cfg=None):
        """The config with the chosen setting."""
        if self.choice is None:
            raise ValueError(f"nothing fits the budget: {self.reason}")
        return (cfg or self.config).replace(**self.choice.changes)

    def table(self):
        """Every candidate: its changes, predicted peak and step time, whether it fits, whether
        it is on the frontier and whether it is the choice (fastest first)."""
        import pandas as pd

        front = {id(c) for c in self.frontier}
        rows = [dict(c.changes, peak_bytes=c.peak.bytes, step_ms=1e3 * c.seconds, fits=c.fits,
                     frontier=id(c) in front, chosen=c is self.choice)
                for c in sorted(self.candidates, key=lambda c: c.seconds)]
        return pd.DataFrame(rows)

    def __repr__(self):
        if self.choice is None:
            return f"TimePlan(nothing fits {fmt_bytes(self.budget)}: {self.reason})"
        c = self.choice
        return (f"TimePlan({c.label}: {1e3 * c.seconds:.2f} ms a step, peak "
                f"{fmt_bytes(c.peak.bytes)} of {fmt_bytes(self.budget)}; "
                f"{len(self.candidates)} weighed)")


def plan(cfg, memory_budget, objective="memory", device=None, link=None, allowance=None):
    """The setting for ``cfg`` whose step's peak per rank fits ``memory_budget`` (bytes, a
    string like '12GiB', or a GPU name) beside the allocator's allowance
    (`gpus.allocator_allowance`; ``allowance``: a fraction of your own, 0 for none):
    ``objective="memory"`` the per-block checkpoint choice with the least recompute
    (`plan.Plan`); ``objective="time"`` the fastest setting of strategy, micro-batch and
    accumulation, checkpointing and bucket size at the same global batch (a `TimePlan`, whose
    ``budget`` is what the allowance leaves the peak; ``device``/``link`` as
    `estimate(cfg).step_time` takes them). Against a card's name the peaks are that card's CUDA
    rank's (`gpus.card_target`, as `fits` simulates it); on time, a named ``device``'s rank's,
    and a card the catalogue has (`hardware.DEVICES`) is the ``device`` when none is named."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"plan() takes a ddpkit.TrainConfig, got {type(cfg).__name__}")
    if objective == "memory":
        return memory_plan(cfg, memory_budget, allowance)
    if objective != "time":
        raise ValueError(f"plan(objective={objective!r}): pass 'memory' (the least recompute "
                         f"that fits) or 'time' (the fastest step that fits)")
    room = allocator_allowance(cfg, memory_budget, allowance).room(budget_bytes(memory_budget))
    if device is None and is_card(memory_budget) and gpu_name(memory_budget) in hardware.DEVICES:
        device = gpu_name(memory_budget)  # the card's own step time, beside its own peak
    target = hardware.target(device) if device is not None else card_target(memory_budget)
    return fastest(cfg, room, device, link, target)


def _micro_batches(cfg):
    total = cfg.micro_batch * cfg.accum_steps
    out, mb = [], total
    while mb >= 1:
        if total % mb == 0:
            out.append(mb)
        mb //= 2
    return out


def _strategies(cfg):
    out = []
    for s in STRATEGIES:
        opt = cfg.optimizer
        if s == "ddp_zero1" and opt == "sgd":
            continue  # plain SGD keeps no state to shard
        if s in ("zero2", "fsdp") and opt == "zero1":
            opt = "adamw"
        out.append((s, opt))
    return out


def fastest(cfg, budget, device=None, link=None, target=None):
    """The fastest fitting candidate (see the module's note); ``target``: the CUDA rank whose
    peaks are simulated (None: the config's own device's)."""
    candidates = []
    for strategy, optimizer in _strategies(cfg):
        for mb in _micro_batches(cfg):  # the largest first
            changes = dict(strategy=strategy, optimizer=optimizer, micro_batch=mb,
                           accum_steps=cfg.micro_batch * cfg.accum_steps // mb)
            try:
                base = cfg.replace(**changes, checkpoint=None, bucket_cap_mb=None)
            except ValueError:
                continue  # a combination the config refuses (e.g. a comm hook with FSDP)
            setting, peak = _checkpoint_that_fits(base, budget, target)
            if peak is None:
                continue
            run = base.replace(checkpoint=setting)
            caps = BUCKETS_MB if strategy in ("ddp", "ddp_zero1") else (None,)
            for cap in caps:
                candidates.append(Candidate(
                    {**changes, "checkpoint": setting, "bucket_cap_mb": cap},
                    run.replace(bucket_cap_mb=cap), peak,
                    step_time(run, device=device, link=link, bucket_cap_mb=cap), True))
            if setting is None:
                break  # a smaller micro-batch fits too, and only adds micro-steps
    if not candidates:
        return TimePlan(budget, None, candidates, cfg,
                        "no strategy, micro-batch or checkpoint setting brings the step's "
                        "peak within the budget")
    return TimePlan(budget, min(candidates, key=lambda c: (c.seconds, c.peak.bytes)),
                    candidates, cfg)


def _ladder(cfg):
    """Checkpoint settings from the least recompute to the most: segment counts 2, 3, 4, 6,
    8... up to one per block, then every block."""
    n = min(b - a for a, b in cfg.checkpoint.spans)
    counts = sorted({s for s in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, n) if 2 <= s <= n})
    return [*counts, "full"]


def _checkpoint_that_fits(cfg, budget, target=None):
    """(setting, peak): None when the step fits without checkpointing, else the setting of
    the least recompute on `_ladder` that fits (a binary search: each look is one simulated
    step); (None, None) when not even every block checkpointed fits."""
    peak = predicted_peak(cfg, target=target)
    if peak.bytes <= budget:
        return None, peak
    ladder = _ladder(cfg)
    # the least recompute first: a budget the unchecked step misses by little (the common
    # case) is met by its first rung, one look instead of the search's three or four
    first = predicted_peak(cfg.replace(checkpoint=ladder[0]), target=target)
    if first.bytes <= budget:
        return ladder[0], first
    lo, hi, found = 1, len(ladder) - 1, None
    while lo <= hi:  # the peak falls along the ladder (more blocks checkpointed, less kept)
        mid = (lo + hi) // 2
        p = predicted_peak(cfg.replace(checkpoint=ladder[mid]), target=target)
        if p.bytes <= budget:
            found, hi = (ladder[mid], p), mid - 1
        else:
            lo = mid + 1
    return found if found else (None, None)
