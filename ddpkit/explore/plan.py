"""`plan`: which blocks to checkpoint so one rank fits a memory budget at the least recompute,
and `fits`: will a config fit a named GPU.

From the estimate's per-block figures (`Estimate.blocks`: what each block keeps when plain,
what its boundary keeps when checkpointed) and each block's recompute FLOPs (counted with
``FlopCounterMode`` on the estimate's FakeTensorMode model: the step with that block alone
checkpointed, minus the step with none), a selective setting ``mask`` costs

* activations after forward: ``A(none) - sum(keeps_i - boundary_i for checkpointed i)``
  (exact: the saved storages of one block do not depend on another block's checkpointing);
* the step's activation peak: the larger of that and, for each checkpointed region (a segment
  of one or more blocks, recomputed at once), what the blocks before it hold plus the whole
  inside of its blocks, which comes back while its backward runs (the blocks after it are
  freed by then; the head's tensors are counted as still held): so the peak grows with a
  segment's length, as ``checkpoint_sequential``'s does;
* FLOPs: ``F(none) + sum(recompute_i for checkpointed i)``.

The search is exact: every mask for up to 16 blocks, and for more, every count per group of
identical blocks (a transformer's blocks are one group, so n + 1 choices); past a million
combinations it falls back to adding blocks greedily by bytes freed per FLOP. This is the
selective-checkpointing knapsack torch's ``torch.distributed._tools.sac_ilp`` solves with an
ILP per operator; per block, enumeration is exact and needs no solver.

What the prediction leaves out, and says so: the CUDA context and allocator overhead (a stated
constant per GPU in `GPUS`), fragmentation, NCCL/gloo buffers, DDP's gradient buckets (one more
copy of the gradients, in buckets), and temporaries of the step's peak (a loss's logits and
their gradient, optimizer temporaries). On CPU the peak probe reads these too: the notebook and
the tests report how far it sits from the prediction.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from ..engine.policies import CheckpointSetting
from .units import GIB, KIB, MIB, TIB, human_bytes

# usable memory per GPU: the card's memory less what the CUDA context and the caching allocator
# take before a tensor is made (about 0.5 GiB context on recent drivers; we keep 5% more aside
# for the allocator's rounding and fragmentation). Stated here, not hidden in the figures.
CUDA_CONTEXT = 512 * MIB
ALLOCATOR_RESERVE = 0.05
GPUS = {
    "T4": 16 * GIB,
    "V100-16GB": 16 * GIB,
    "V100-32GB": 32 * GIB,
    "A10G": 24 * GIB,
    "L4": 24 * GIB,
    "A100-40GB": 40 * GIB,
    "A100-80GB": 80 * GIB,
    "H100": 80 * GIB,
    "H200": 141 * GIB,
}


def usable_bytes(gpu):
    """Bytes a training step can use on a named GPU (or a byte count given as is)."""
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"gpu={gpu!r} is not in ddpkit.explore.plan.GPUS ({', '.join(GPUS)}); pass "
                             f"one of those or a byte count such as 16 * 2**30")
        total = GPUS[gpu]
        return int((total - CUDA_CONTEXT) * (1 - ALLOCATOR_RESERVE))
    return parse_bytes(gpu, "gpu")


def parse_bytes(value, name="memory_budget"):
    """An int of bytes, or a string like '12GiB', '512 MiB', '1.5GB' (GB = 10**9)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass bytes (an int) or a string like '12GiB'")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", value, re.I)
        if m:
            unit = (m.group(2) or "B").upper()
            scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": TIB}[unit]
            return int(float(m.group(1)) * scale)
    raise ValueError(f"{name}={value!r}: pass bytes (an int > 0) or a string like '12GiB' or "
                     f"'512MiB'")


@dataclass
class Fit:
    """Does a config fit? Truthy when it does. Figures per rank, in bytes."""
    predicted: int
    usable: int
    where: str

    def __bool__(self):
        return self.predicted <= self.usable

    @property
    def headroom(self):
        return self.usable - self.predicted

    def __repr__(self):
        verdict = "fits" if self else "does not fit"
        gib = lambda n: human_bytes(n, "GiB", 2)  # noqa: E731
        return (f"Fit({verdict} {self.where}: {gib(self.predicted)} predicted of "
                f"{gib(self.usable)} usable; not counted: fragmentation, NCCL buffers, "
                f"DDP buckets, the step's temporaries)")


@dataclass
class Choice:
    """One point of the trade-off: a per-block mask and what it costs per rank."""
    mask: tuple
    activations: int
    peak_activations: int
    states: int
    flops: int
    flops_ratio: float
    setting: object = field(default=None, repr=False, compare=False)
    """The `CheckpointSetting` (its regions: an int setting's segments are several blocks)."""

    @property
    def total(self):
        """Predicted bytes per rank at the step's peak."""
        return self.states + self.peak_activations

    @property
    def checkpoint(self):
        """The setting for TrainConfig.checkpoint (None when nothing is checkpointed)."""
        return (self.setting or CheckpointSetting.from_mask(self.mask)).plain


@dataclass
class Plan:
    """``ddpkit.plan``'s answer. ``choice`` is None when nothing fits; then ``alternatives``
    says what would (with predicted figures)."""
    budget: int
    choice: Choice | None
    frontier: list = field(repr=False)
    alternatives: list = field(default_factory=list)
    config: object = field(default=None, repr=False)

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
        import pandas as pd

        return pd.DataFrame([dict(checkpointed=sum(c.mask), mask=str(CheckpointSetting.from_mask(c.mask)),
                                  activation_bytes=c.activations, peak_bytes=c.total,
                                  flops_ratio=round(c.flops_ratio, 4),
                                  chosen=self.choice is not None and c.mask == self.choice.mask)
                             for c in self.frontier])

    def __repr__(self):
        gib = lambda n: human_bytes(n, "GiB", 3)  # noqa: E731
        if self.choice is None:
            alts = "; ".join(f"{a['change']}: {gib(a['predicted'])}" for a in self.alternatives)
            return f"Plan(nothing fits {gib(self.budget)}; would fit: {alts or 'nothing tried'})"
        c = self.choice
        return (f"Plan(checkpoint={c.checkpoint}, {gib(c.total)} of {gib(self.budget)} per rank, "
                f"FLOP ratio {c.flops_ratio:.3f})")


# ----------------------------------------------------------------------------- the figures
@dataclass
class _Blocks:
    saves: list      # bytes freed by checkpointing block i
    keeps: list      # bytes inside block i (back during its recompute)
    recompute: list  # FLOPs recomputing block i adds to the step
    base_acts: int   # activations with no checkpointing
    base_flops: int  # FLOPs of the step with no checkpointing
    states: int      # params + grads + optimizer state per rank


def _figures(cfg):
    from .estimate import estimate, traced_flops

    est = estimate(cfg.replace(checkpoint=None))
    n = cfg.n_blocks
    base_flops = traced_flops(cfg, CheckpointSetting(None, n))
    recompute, by_signature = [], {}
    for i, b in enumerate(est.blocks):
        sig = (b.keeps, b.boundary, b.flops)  # identical blocks recompute identically
        if sig not in by_signature:
            alone = CheckpointSetting.from_mask([j == i for j in range(n)])
            by_signature[sig] = traced_flops(cfg, alone) - base_flops
        recompute.append(by_signature[sig])
    return _Blocks([b.keeps - b.boundary for b in est.blocks], [b.keeps for b in est.blocks],
                   recompute, est.activations, base_flops, est.params + est.grads + est.optimizer)


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
    bytes after forward, the step's activation peak (a checkpointed segment's recompute brings
    its whole inside back at once), model states, and the step's FLOPs, counted."""
    from .estimate import traced_flops

    setting = cfg.checkpointing if setting is None else setting
    return _choice(_figures(cfg), setting, traced_flops(cfg, setting))


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


def frontier(choices):
    """The Pareto-optimal choices: none other is both smaller and cheaper."""
    best, out = None, []
    for c in sorted(choices, key=lambda c: (c.flops, c.total)):
        if best is None or c.total < best:
            out.append(c)
            best = c.total
    return out


def plan(cfg, memory_budget):
    """The per-block checkpoint choice that keeps the predicted per-rank memory (params + grads
    + optimizer state + activations at the step's peak) within ``memory_budget`` (bytes, a
    string like '12GiB', or a GPU name from `GPUS`) at the least recompute."""
    from ..config import TrainConfig

    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"plan() takes a ddpkit.TrainConfig, got {type(cfg).__name__}")
    budget = usable_bytes(memory_budget) if isinstance(memory_budget, str) and \
        memory_budget in GPUS else parse_bytes(memory_budget)
    fig = _figures(cfg)
    front = frontier(_choice(fig, CheckpointSetting.from_mask(m)) for m in _masks(fig))
    fitting = [c for c in front if c.total <= budget]
    choice = min(fitting, key=lambda c: (c.flops, c.total)) if fitting else None
    alternatives = [] if choice else _alternatives(cfg, budget)
    return Plan(budget, choice, front, alternatives, cfg)


def _alternatives(cfg, budget):
    """What would fit when no checkpoint choice does, each with its predicted figures: a
    smaller micro-batch with more accumulation (same global batch), ZeRO-1, FSDP."""
    out = []
    tries = []
    mb, acc = cfg.micro_batch, cfg.accum_steps
    while mb > 1:
        mb, acc = mb // 2, acc * 2
        tries.append((f"micro_batch={mb}, accum_steps={acc} (same global batch)",
                      dict(micro_batch=mb, accum_steps=acc)))
    if cfg.strategy == "ddp":
        opt = {"optimizer": "adamw"} if cfg.optimizer == "sgd" else {}
        tries.append(("strategy='ddp_zero1' (optimizer state sharded)", dict(strategy="ddp_zero1", **opt)))
    if cfg.strategy != "fsdp":
        tries.append(("strategy='fsdp' (params, grads, optimizer sharded)",
                      dict(strategy="fsdp", optimizer="adamw" if cfg.optimizer == "zero1" else cfg.optimizer)))
    smaller_fits = False
    for what, change in tries:
        if smaller_fits and "micro_batch" in change:
            continue  # the largest micro-batch that fits is enough of that kind
        try:
            other = cfg.replace(**change)
        except ValueError:
            continue
        fig = _figures(other)
        best = min((_choice(fig, CheckpointSetting.from_mask(m)) for m in _masks(fig)),
                   key=lambda c: c.total)
        out.append(dict(change=what, predicted=best.total, fits=best.total <= budget,
                        checkpoint=best.checkpoint, flops_ratio=round(best.flops_ratio, 4)))
        smaller_fits |= best.total <= budget and "micro_batch" in change
    return out


def fits(cfg, gpu):
    """`Fit` of ``cfg`` as it is (its own checkpoint setting) on a GPU name or a byte count."""
    from .estimate import estimate

    est = estimate(cfg)
    mask = cfg.checkpointing.mask
    keeps = [b.keeps for b, on in zip(est.blocks, mask) if on]
    predicted = est.params + est.grads + est.optimizer + est.activations + max(keeps, default=0)
    where = gpu if isinstance(gpu, str) else f"{human_bytes(parse_bytes(gpu, 'gpu'), 'GiB', 2)}"
    return Fit(predicted, usable_bytes(gpu), where)


def largest_micro_batch(cfg, gpu, limit=4096):
    """The largest micro-batch with which ``cfg`` (its checkpoint setting) fits ``gpu``; 0 if
    none does. Activations grow linearly with the micro-batch: two traces give the line, and
    the answer is checked with a trace of its own."""
    one, two = fits(cfg.replace(micro_batch=1), gpu), fits(cfg.replace(micro_batch=2), gpu)
    if not one:
        return 0
    per_sample = max(two.predicted - one.predicted, 1)
    guess = min(limit, 1 + (one.usable - one.predicted) // per_sample)
    while guess > 1 and not fits(cfg.replace(micro_batch=int(guess)), gpu):
        guess -= 1
    return int(guess)
