"""`plan`: which blocks to checkpoint so one rank's step fits a memory budget at the least
recompute (`fits` and `largest_micro_batch`, in `fits.py`: will a config fit a named GPU).

Every answer is about the step's **peak** per rank (`ddpkit.predict.peak`: the rank's own step
simulated on fake tensors; every live byte at the highest moment of forward, backward and
optimizer step, DDP's buckets included), never about a sum of parts.

Checkpointing lowers only what the forward saves for backward. So `plan` first simulates the
step with every block checkpointed, the fewest activations any choice keeps: when even that
step peaks above the budget, and at the height of the step without checkpointing, the peak is
where no activations are left to free (in the optimizer step, or at the end of the backward;
with AdamW it often is: parameters, gradients, DDP's bucket copy of them, two moments and the
update's temporaries). No checkpoint choice can lower it: the plan says so and lists, each with
its predicted peak, what can: ``gradient_as_bucket_view=True`` (the gradients live in DDP's
buckets: one copy fewer), ZeRO-1, FSDP, a smaller micro-batch with more accumulation.

Otherwise the choice is searched on the per-block trade-off. From the estimate's per-block
figures (what each block keeps when plain, what its boundary keeps when checkpointed) and each
block's recompute FLOPs (``FlopCounterMode`` on the FakeTensorMode model: the step with that
block alone checkpointed, minus the step with none), a selective mask costs

* activations after forward: ``A(none) - sum(keeps_i - boundary_i for checkpointed i)``
  (exact: the saved storages of one block do not depend on another block's checkpointing);
* the backward's activation peak: the larger of that and, for each checkpointed region (a
  segment of one or more blocks, recomputed at once), what the blocks before it hold plus the
  whole inside of its blocks, which comes back while its backward runs (the blocks after it
  are freed by then; the head's tensors are counted as still held): so the peak grows with a
  segment's length, as ``checkpoint_sequential``'s does;
* FLOPs: ``F(none) + sum(recompute_i for checkpointed i)``.

The masks on the Pareto frontier of (FLOPs, activation peak) are enumerated exactly (every mask
up to 16 blocks, every count per group of identical blocks beyond; this is the knapsack
torch's ``torch.distributed._tools.sac_ilp`` solves with an ILP per operator). Each mask's step
peak is first placed by the simulated step without checkpointing (its forward and backward
phases lower by what the mask saves, its optimizer phase stays): the search's key, which can be
optimistic by a few percent (a region's recompute comes back inside the backward, above where
the placing puts it). So no row's bytes are placed ones: each mask on that placed frontier is
simulated itself when its peak is first asked for (`Choice.total`: `peak.predicted_peak`, what
``estimate(cfg).peak()`` answers; composed from per-block pieces for a large model, so a row
costs arithmetic). The choice is the cheapest row whose simulated peak fits (every cheaper row
simulated and above the budget), and the table (`Plan.frontier_table`) shows every row
simulated, kept on those simulated peaks.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..config import TrainConfig
from ..engine import strategies
from ..engine.memory import TIE
from ..spec.setting import CheckpointSetting
from .estimate import estimate, traced_flops
from .gpus import Allowance, allocator_allowance, budget_bytes, card_target
from .peak import predicted_peak
from .units import fmt_bytes

@dataclass
class Choice:
    """One point of the trade-off: a per-block mask and what it costs per rank. ``peak``: its
    simulated step peak, once simulated (`plan` simulates every row it shows)."""
    mask: tuple
    activations: int
    peak_activations: int
    states: int
    flops: int
    flops_ratio: float
    setting: object = field(default=None, repr=False, compare=False)
    """The `CheckpointSetting` (its regions: an int setting's segments are several blocks)."""
    placed: int = 0
    """The step peak placed from the simulated step without checkpointing (the search's key)."""
    peak: object = None
    config: object = field(default=None, repr=False, compare=False)
    """The config whose row this is: its peak is simulated when first asked for (`total`)."""
    target: object = field(default=None, repr=False, compare=False)
    """The card whose CUDA rank is simulated (`gpus.card_target`), or None: the config's own."""

    @property
    def total(self):
        """Predicted bytes per rank at the step's peak: its simulated step's (simulated on first
        use where the row has its config; else placed)."""
        if self.peak is None and self.config is not None:
            self.peak = predicted_peak(self.config.replace(checkpoint=self.checkpoint),
                                       target=self.target)
        return self.peak.bytes if self.peak is not None else self.placed

    @property
    def checkpoint(self):
        """The plain value for TrainConfig.checkpoint (None when nothing is checkpointed)."""
        return self.setting.plain


@dataclass
class Plan:
    """``ddpkit.plan``'s answer. ``choice`` is None when nothing fits; then ``reason`` says
    why and ``alternatives`` what would (each with its predicted peak). ``budget``: the
    highest step peak the memory given leaves once the allocator's allowance is set aside."""
    budget: int
    choice: Choice | None
    frontier: list = field(repr=False)
    alternatives: list = field(default_factory=list)
    config: object = field(default=None, repr=False)
    reason: str = ""
    unchecked: object = field(default=None, repr=False)
    """The simulated peak without checkpointing (where the step peaks)."""
    allowance: Allowance = Allowance(0.0, "")
    """The allocator's share budgeted beside the peak (`gpus.allocator_allowance`)."""
    memory: int = 0
    """The memory given; ``budget`` is what it leaves the step's peak beside the allowance."""

    @property
    def fits(self):
        return self.choice is not None

    @property
    def checkpoint(self):
        return self.choice.checkpoint if self.choice else None

    def apply(self, cfg=None):
        """The config with the planned checkpoint setting."""
        if self.choice is None:
            raise ValueError("nothing fits the budget: see plan.alternatives")
        return (cfg or self.config).replace(checkpoint=self.checkpoint)

    def frontier_table(self):
        """The frontier: each mask's activations, simulated step peak and FLOP ratio (every row
        simulated, and kept where no other row has both fewer FLOPs and a lower peak)."""
        import pandas as pd

        return pd.DataFrame([dict(checkpointed=sum(c.mask), mask=str(c.setting.with_value(c.mask)),
                                  activation_bytes=c.activations, peak_bytes=c.total,
                                  simulated=c.peak is not None, flops_ratio=round(c.flops_ratio, 4),
                                  chosen=self.choice is not None and c.mask == self.choice.mask)
                             for c in frontier(self.frontier)])

    def __repr__(self):
        gib = fmt_bytes
        if self.choice is None:
            alts = "; ".join(f"{a['change']}: {gib(a['predicted'])}{' (fits)' if a['fits'] else ''}"
                             for a in self.alternatives)
            return (f"Plan(nothing fits {gib(self.budget)} ({self.memory_note}): {self.reason}; "
                    f"instead: {alts or 'nothing tried'})")
        c = self.choice
        return (f"Plan(checkpoint={c.checkpoint}, the step peaks at {gib(c.total)} per rank in "
                f"the {c.peak.phase} of {gib(self.budget)} ({self.memory_note}), FLOP ratio "
                f"{c.flops_ratio:.3f})")

    @property
    def memory_note(self):
        """The memory given and the allocator's allowance beside the budget, in words."""
        if not self.allowance.fraction:
            return str(self.allowance)
        return f"{fmt_bytes(self.memory)} given, {self.allowance}"


# ----------------------------------------------------------------------------- the figures
@dataclass
class _Blocks:
    saves: list      # bytes freed by checkpointing block i
    keeps: list      # bytes inside block i (back during its recompute)
    recompute: list  # FLOPs recomputing block i adds to the step
    base_acts: int   # activations with no checkpointing
    base_flops: int  # FLOPs of the step with no checkpointing
    states: int      # params + grads + optimizer state per rank
    none: object     # no checkpointing, on the model's stacks (each setting is made from it)


def _figures(cfg):
    est = estimate(cfg.replace(checkpoint=None))
    n, none = cfg.n_blocks, cfg.checkpoint.with_value(None)
    base_flops = traced_flops(cfg, none)
    recompute, by_signature = [], {}
    for i, b in enumerate(est.blocks):
        sig = (b.keeps, b.boundary, b.flops)  # identical blocks recompute identically
        if sig not in by_signature:
            alone = none.with_value([j == i for j in range(n)])
            by_signature[sig] = traced_flops(cfg, alone) - base_flops
        recompute.append(by_signature[sig])
    return _Blocks([b.keeps - b.boundary for b in est.blocks], [b.keeps for b in est.blocks],
                   recompute, est.activations, base_flops, est.params + est.grads + est.optimizer,
                   none)


def _choice(fig, setting, flops=None):
    """What ``setting`` (a `CheckpointSetting`) costs: each checkpointed segment one region.
    ``flops``: the step's counted FLOPs when known (else the sum of the blocks' recomputes)."""
    mask, regions = setting.mask, setting.regions
    # a region keeps its first block's input (its boundary) in place of all its blocks' insides
    freed = {a: sum(fig.keeps[a:b]) - (fig.keeps[a] - fig.saves[a]) for a, b in regions}
    acts = fig.base_acts - sum(freed.values())
    # backward runs the regions last to first: when one is recomputed, the blocks after it have
    # been freed, and its blocks' whole inside comes back on top of what the blocks before hold
    peak, after, stop = acts, 0, len(mask)
    for a, b in reversed(regions):
        after += sum(fig.keeps[b:stop])  # the plain blocks between this region and the next
        peak = max(peak, acts - after + freed[a])
        after += fig.keeps[a] - fig.saves[a]  # what the region held: its boundary
        stop = a
    if flops is None:
        flops = fig.base_flops + sum(r for r, on in zip(fig.recompute, mask) if on)
    return Choice(tuple(mask), acts, peak, fig.states, flops, flops / fig.base_flops, setting)


def cost(cfg, setting=None):
    """`Choice` of ``setting`` (a `CheckpointSetting`; the config's when not given): activation
    bytes after forward, the backward's activation peak (a checkpointed segment's recompute
    brings its whole inside back at once), model states, the step's FLOPs, counted, and its
    simulated step peak (``total``)."""
    setting = cfg.checkpoint if setting is None else setting
    choice = _choice(_figures(cfg), setting, traced_flops(cfg, setting))
    choice.peak = predicted_peak(cfg.replace(checkpoint=setting))
    return choice


def _place(choice, fig, unchecked):
    """The step peak of ``choice`` placed from the simulated step without checkpointing: the
    forward peaks with its saved activations (lower by what the mask saves), the backward
    with its activation peak (lower by as much), the optimizer step as it was."""
    by = unchecked.by_phase
    none = _choice(fig, fig.none)
    choice.placed = max(by.get("forward", 0) - (none.activations - choice.activations),
                        by.get("backward", 0) - (none.peak_activations - choice.peak_activations),
                        by.get("optimizer", 0))
    return choice


def _masks(fig, limit=1_000_000):
    n = len(fig.saves)
    if n <= 16:
        yield from itertools.product((False, True), repeat=n)
        return
    groups = {}
    for i, sig in enumerate(zip(fig.saves, fig.keeps, fig.recompute)):
        groups.setdefault(sig, []).append(i)
    members = list(groups.values())
    combos = 1
    for g in members:
        combos *= len(g) + 1
    if combos <= limit:
        for counts in itertools.product(*(range(len(g) + 1) for g in members)):
            mask = [False] * n
            for g, k in zip(members, counts):
                for i in g[:k]:
                    mask[i] = True
            yield tuple(mask)
        return
    order = sorted(range(n), key=lambda i: -fig.saves[i] / max(fig.recompute[i], 1))
    mask = [False] * n
    yield tuple(mask)
    for i in order:  # greedy: bytes freed per recomputed FLOP, best first
        mask[i] = True
        yield tuple(mask)


def frontier(choices, by="total"):
    """The Pareto-optimal choices: none other has both fewer FLOPs and a lower peak (``by``:
    'total', the simulated peak; 'placed', the search's key, simulating nothing)."""
    best, out = None, []
    for c in sorted(choices, key=lambda c: (c.flops, getattr(c, by))):
        if best is None or getattr(c, by) < best:
            out.append(c)
            best = getattr(c, by)
    return out


def plan(cfg, memory_budget, allowance=None):
    """The per-block checkpoint choice whose step peak per rank (simulated: every live byte at
    the step's highest moment, DDP's buckets included) fits ``memory_budget`` (bytes, a string
    like '12GiB', or a GPU name from `gpus.GPUS`) at the least recompute, beside the allocator's
    allowance (`gpus.allocator_allowance`; ``allowance``: a fraction of your own, 0 for none).
    Against a card's name every peak is that card's CUDA rank's (`gpus.card_target`), as `fits`
    simulates it."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"plan() takes a ddpkit.TrainConfig, got {type(cfg).__name__}")
    given, target = budget_bytes(memory_budget), card_target(memory_budget)
    allowed = allocator_allowance(cfg, memory_budget, allowance)
    budget = allowed.room(given)  # what the step's tensors may peak at
    fig = _figures(cfg)
    unchecked = predicted_peak(cfg.replace(checkpoint=None), target=target)
    front = frontier((_place(_choice(fig, CheckpointSetting.from_mask(m, fig.none.stacks)), fig,
                             unchecked) for m in _masks(fig)), by="placed")
    for c in front:  # each row's peak: its own simulated step, on first use
        c.config, c.target = cfg, target
    # every block checkpointed keeps the fewest activations: what checkpointing can reach
    lowest = unchecked if not front[1:] else predicted_peak(cfg.replace(checkpoint="full"),
                                                            target=target)
    if min(lowest.bytes, unchecked.bytes) > budget:
        return Plan(budget, None, front, _alternatives(cfg, budget, target), cfg,
                    _out_of_reach(unchecked, lowest), unchecked, allowed, given)
    # the cheapest row whose simulated peak fits (the rows cheaper than it: simulated, above)
    choice = next((c for c in front if c.total <= budget), None)
    if choice is not None:
        return Plan(budget, choice, front, [], cfg, "", unchecked, allowed, given)
    reason = ("no checkpoint choice brings the step's peak within the budget (the lowest is "
              f"{fmt_bytes(min(c.total for c in front))})")
    return Plan(budget, None, front, _alternatives(cfg, budget, target), cfg, reason, unchecked,
                allowed, given)


def _out_of_reach(unchecked, lowest):
    """Why no checkpoint choice fits: the peak is where no activations are left to free (it
    does not move with checkpointing), or it moves, but not far enough."""
    if lowest.bytes >= unchecked.bytes * (1 - TIE):
        return (f"the step peaks where no activations are left to free (in the "
                f"{lowest.phase}, {fmt_bytes(lowest.bytes)}: parameters, gradients, optimizer "
                f"state, DDP's buckets and temporaries), which checkpointing cannot lower: it "
                f"frees activations, and those are gone by then")
    return (f"with every block checkpointed the step still peaks at {fmt_bytes(lowest.bytes)} "
            f"in the {lowest.phase}: no checkpoint choice brings it within the budget")


def _alternatives(cfg, budget, target=None):
    """What would fit when no checkpoint choice does, each with its predicted step peak (the
    lower of no checkpointing and every block checkpointed): gradients in DDP's buckets,
    ZeRO-1, FSDP, and a smaller micro-batch with more accumulation (same global batch)."""
    tries = []
    fsdp = strategies.is_fsdp(cfg.strategy)  # zero2, fsdp, hsdp: FSDP2, no DDP buckets
    if not fsdp and not cfg.gradient_as_bucket_view:
        tries.append(("gradient_as_bucket_view=True (gradients live in DDP's buckets: one "
                      "copy fewer)", dict(gradient_as_bucket_view=True)))
    if cfg.strategy == "ddp" and cfg.optimizer != "sgd":
        tries.append(("strategy='ddp_zero1' (optimizer state sharded)",
                      dict(strategy="ddp_zero1", optimizer="adamw")))
    if cfg.strategy != "fsdp" and cfg.strategy != "hsdp":
        tries.append(("strategy='fsdp' (params, grads, optimizer sharded)",
                      dict(strategy="fsdp", optimizer="adamw" if cfg.optimizer == "zero1"
                           else cfg.optimizer)))
    mb, acc = cfg.micro_batch, cfg.accum_steps
    while mb > 1:
        mb, acc = mb // 2, acc * 2
        tries.append((f"micro_batch={mb}, accum_steps={acc} (same global batch)",
                      dict(micro_batch=mb, accum_steps=acc)))
    out, smaller_fits = [], False
    for what, change in tries:
        if smaller_fits and "micro_batch" in change:
            continue  # the largest micro-batch that fits is enough of that kind
        try:
            other = cfg.replace(**change)
        except ValueError:
            continue
        best, setting = predicted_peak(other.replace(checkpoint=None), target=target), None
        if best.bytes > budget and best.phase != "optimizer":  # checkpointing can help there
            full = predicted_peak(other.replace(checkpoint="full"), target=target)
            if full.bytes < best.bytes:
                best, setting = full, "full"
        out.append(dict(change=what, predicted=best.bytes, fits=best.bytes <= budget,
                        checkpoint=setting, phase=best.phase))
        smaller_fits |= best.bytes <= budget and "micro_batch" in change
    return out
