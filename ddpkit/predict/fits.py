"""`fits` and `largest_micro_batch`: will a config fit a named GPU (or a byte count)?

Every answer is about the step's **peak** per rank (`peak.predicted_peak`: the rank's own step
simulated on fake tensors; every live byte at the highest moment of forward, backward and
optimizer step, DDP's buckets included), never about a sum of parts, against what the card
leaves a step (`gpus.usable_bytes`), beside the allocator's allowance for that device
(`gpus.allocator_allowance`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .gpus import Allowance, allocator_allowance, card_target, gpu_name, is_card, usable_bytes
from .peak import predicted_peak
from .units import fmt_bytes


@dataclass
class Fit:
    """Does a config fit? Truthy when it does. ``peak``: the predicted step peak per rank (a
    `Peak`: bytes, phase, ledger); ``usable``: the bytes the card leaves a step; ``allowance``:
    the allocator's share budgeted beside the peak (`gpus.Allowance`; ``allowed``: its bytes)."""
    peak: object
    usable: int
    where: str
    allowance: Allowance = Allowance(0.0, "")

    @property
    def predicted(self):
        return self.peak.bytes

    @property
    def allowed(self):
        return self.allowance.of(self.predicted)

    @property
    def needed(self):
        """The predicted peak and the allocator's allowance: what is compared with ``usable``."""
        return self.predicted + self.allowed

    def __bool__(self):
        return self.needed <= self.usable

    @property
    def headroom(self):
        return self.usable - self.needed

    def __repr__(self):
        verdict = "fits" if self else "does not fit"
        extra = f" + {fmt_bytes(self.allowed)}" if self.allowed else ""
        return (f"Fit({verdict} {self.where}: the step peaks at {fmt_bytes(self.predicted)} per "
                f"rank in the {self.peak.phase}{extra} ({self.allowance}), of "
                f"{fmt_bytes(self.usable)} usable; not counted: NCCL's own buffers)")


def fits(cfg, gpu, allowance=None):
    """`Fit` of ``cfg`` as it is (its own checkpoint setting) on a GPU name or a byte count:
    the step's simulated peak per rank (the higher of the first step and the steady state,
    on the heaviest rank), with the allocator's allowance (`gpus.allocator_allowance`;
    ``allowance``: a fraction of your own, 0 for none), against what the card leaves a step.
    On a named card the rank is simulated as the CUDA rank it would be there
    (`gpus.card_target`), whatever device ``cfg`` runs on here; a budget in bytes is memory of
    ``cfg``'s own device."""
    usable, allowed = usable_bytes(gpu), allocator_allowance(cfg, gpu, allowance)
    where = gpu_name(gpu) if is_card(gpu) else fmt_bytes(usable)
    return Fit(predicted_peak(cfg, target=card_target(gpu)), usable, where, allowed)


def largest_micro_batch(cfg, gpu, limit=4096, allowance=None):
    """The largest micro-batch with which ``cfg`` (its checkpoint setting) fits ``gpu`` (as
    `fits` says, the allocator's allowance included); 0 if none does. Each phase's peak grows about linearly with the micro-batch (the optimizer
    step's not at all): two simulated steps give a first guess, and a search by simulated
    steps around it gives the answer (the answer fits; one more sample does not)."""
    usable = allocator_allowance(cfg, gpu, allowance).room(usable_bytes(gpu))
    peaks, target = {}, card_target(gpu)

    def peak(mb):
        if mb not in peaks:
            peaks[mb] = predicted_peak(cfg.replace(micro_batch=mb), target=target)
        return peaks[mb]

    def aim(lo, hi):
        """Where the first phase reaches the usable bytes, along its line through lo and hi."""
        out = limit
        for phase, at_lo in peak(lo).by_phase.items():
            slope = (peak(hi).by_phase.get(phase, at_lo) - at_lo) / (hi - lo)
            if slope > 0:
                out = min(out, lo + int((usable - at_lo) // slope))
        return out

    if peak(1).bytes > usable:
        return 0
    good, bad = 1, limit + 1  # fits / does not (limit + 1: nothing above is asked)
    guess = int(min(max(aim(1, 2), 1), limit))
    while bad - good > 1:  # each look moves good up or bad down
        # a fit: one more sample if the line says the edge is here, else the line's aim (at
        # most twice the fit); a miss: aim along the line from the last fit, else halve
        guess = min(max(guess, good + 1), bad - 1)
        if peak(guess).bytes <= usable:
            good, edge = guess, aim(1, guess)
            guess = guess + 1 if edge <= guess else min(2 * guess, edge)
        else:
            bad = guess
            # the line through the last fit and the miss; then the next one up, or halve
            guess = aim(good, bad)
            if guess <= good or guess >= bad:
                guess = (good + bad) // 2
            elif guess + 1 < bad and peak(guess).bytes <= usable:
                good, guess = guess, guess + 1
                continue
    return good
