"""A large model's op stream from small ones: the ops of a step of N identical blocks, from the
steps of the same model cut to 3 and to 4 blocks (`streams.extend` aligns them and repeats the
stretch one more block adds). What the step-time prediction (`steptime`) plays for a large model
whose setting is alike on every block (none, or every block checkpointed); its bytes are
composed from per-block pieces (`compose`), whatever the setting.

The first and the last block are ends (block 0 may differ: T5's relative position bias; FSDP
prefetches the next block's parameters while a block runs, except at the ends), so the rate is
taken where a middle block is added: with 3 and 4 blocks.
"""
from __future__ import annotations

from .streams import extend
from .trace import SCALE_ABOVE


def scalable(cfg):
    """Is ``cfg``'s stream extended from 3 and 4 blocks? A large model of one stack, a setting
    alike on every block."""
    setting = cfg.checkpoint
    uniform = setting.value is None or setting.value == "full" or all(setting.mask) or \
        not any(setting.mask)
    return uniform and not setting.several and cfg.n_blocks > 4 and \
        cfg.info.n_params > SCALE_ABOVE


def streamed(simulate, cfg, rank):
    """The op stream of ``cfg``'s rank ``rank``, from ``simulate(cfg, rank, keep=3)`` and
    ``keep=4``'s."""
    setting = "full" if any(cfg.checkpoint.mask) else None
    three = simulate(cfg.replace(checkpoint=setting), rank, keep=3)
    four = simulate(cfg.replace(checkpoint=setting), rank, keep=4)
    return extend(three.stream, four.stream, cfg.n_blocks)
