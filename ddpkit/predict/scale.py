"""Real sizes from small ones: the step of a model with N identical blocks, from the steps of
the same model cut to 3 and to 4 blocks.

A step of N blocks is made of parts whose bytes grow with N at a fixed rate: the blocks'
forward (each block adds its saved activations), the head and loss, the start of the backward,
the blocks' backward (each block trades its activations for its gradients and DDP's bucket
copy, at the same rate at every block, so its highest moment is at one end, the same end for
every N), the stem's backward (the embedding's gradient) and the optimizer step (each block
adds its parameters' state; the update's temporaries are the largest parameter's). The
simulation (`simulate.simulate`) cuts the step there (`simulate._watch_blocks`): each part's highest
moment, and its ledger, at 3 and 4 blocks give the line through them, and at N blocks::

    part(N) = part(4) + (N - 4) * (part(4) - part(3))

The first and the last block are ends (block 0 may differ: T5's relative position bias; FSDP
prefetches the next block's parameters while a block runs, except at the ends), so the rate is
taken where a middle block is added: with 2 and 3 blocks FSDP's backward read wrong, with 3 and
4 (and 4 and 5) exactly. Exact for models whose middle blocks are alike (tested against the
full simulation to the byte: the built-in GPT, Llama, FSDP):
ddpkit simulates the whole model where that is affordable and scales only above
`SCALE_ABOVE` parameters, and only settings alike on every block (none, or every block
checkpointed); other settings are placed from those two (`plan`).
"""
from __future__ import annotations

from ..engine.memory import KINDS, PHASES, Peak, phase_of
from .simulate import Simulation
from .streams import extend
from .trace import SCALE_ABOVE


def scalable(cfg):
    """Is ``cfg`` simulated from 3 and 4 blocks? A large model, a setting alike on every block."""
    setting = cfg.checkpoint
    uniform = setting.value is None or setting.value == "full" or all(setting.mask) or \
        not any(setting.mask)
    return uniform and cfg.n_blocks > 4 and cfg.info.n_params > SCALE_ABOVE


def _line(at3, at4, n):
    return at4 + (n - 4) * (at4 - at3)


def scaled(simulate, cfg, rank):
    """A `simulate.Simulation` of ``cfg``'s rank ``rank``, from ``simulate(cfg, rank, keep=3)`` and
    ``keep=4``."""
    n = cfg.n_blocks
    setting = "full" if any(cfg.checkpoint.mask) else None
    three = simulate(cfg.replace(checkpoint=setting), rank, keep=3)
    four = simulate(cfg.replace(checkpoint=setting), rank, keep=4)
    peaks, segments = [], []
    for seg3, seg4 in zip(three.segments, four.segments):
        parts = {}
        for name, (bytes4, ledger4) in seg4.items():
            bytes3, ledger3 = seg3.get(name, (bytes4, ledger4))
            parts[name] = (_line(bytes3, bytes4, n),
                           {k: _line(ledger3[k], ledger4[k], n) for k in KINDS})
        segments.append(parts)
        peaks.append(_peak_of(parts))
    loads = [_line(a, b, n) for a, b in zip(three.loads, four.loads)]
    return Simulation(rank, peaks, loads, segments, how="scaled from 3 and 4 blocks",
                      stream=extend(three.stream, four.stream, n))


def _peak_of(parts):
    """The `Peak` of a step from its parts: the highest moment of each phase, then the peak."""
    by_phase = {}
    for name, (value, _) in parts.items():
        phase = next(p for p in PHASES if name.startswith(p))
        by_phase[phase] = max(by_phase.get(phase, 0), value)
    by_phase = {p: by_phase[p] for p in PHASES if p in by_phase}
    phase = phase_of(by_phase)
    value, ledger = max((v for name, v in parts.items() if name.startswith(phase)),
                        key=lambda v: v[0])
    return Peak(value, phase, ledger, by_phase)
