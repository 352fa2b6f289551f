"""`RankPlan`: what one rank runs, as plain data.

The kernel makes it from a checked `TrainConfig` (`TrainConfig.rank_plan`), with what the config
derives already worked out (where the blocks are, the checkpoint setting bound to the model's
stacks, the probes it turns on), and sends it to the ranks; the engine reads nothing else. It
is frozen and pickles by value (the model, data and loss specs as the config holds them: a
name, an import path, or a function shipped like a launch job's).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .model import resolve
from .names import MODELS
from .setting import CheckpointSetting


@dataclass(frozen=True)
class RankPlan:
    # --- what is trained (`TrainConfig`'s fields of the same names)
    model: object
    data: object
    loss: object
    blocks: object  # where the blocks are, found or given: a dotted path, or a tuple of several
    n_blocks: int
    width: int
    mlp_ratio: int
    seq_len: int
    vocab: int
    n_heads: int
    dropout: float
    # --- how
    world_size: int
    micro_batch: int
    accum_steps: int
    no_sync: bool
    static_graph: bool
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    bucket_cap_mb: float | None
    strategy: str
    shard_size: int | None
    comm_hook: str | None
    powersgd_rank: int | None
    powersgd_start_iter: int
    checkpoint: CheckpointSetting  # bound to the model's stacks
    use_reentrant: bool
    preserve_rng_state: bool
    precision: str
    optimizer: str
    lr: float
    warmup_steps: int
    steps: int
    seed: int
    # --- what is measured and kept
    probes: frozenset
    peak_every: int
    timeline_every: int
    link_gbps: float | None
    link_latency_us: float
    memory_snapshot: str | None
    save_every: int
    save_dir: str | None
    n_params: int | None = None  # your model's parameter count (what a resume checks)
    # the config itself, for your ``data(cfg)`` only: the engine reads none of it
    config: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.checkpoint, CheckpointSetting) or \
                self.checkpoint.n_blocks != self.n_blocks:
            raise TypeError(f"RankPlan.checkpoint={self.checkpoint!r}: a CheckpointSetting of "
                            f"the model's {self.n_blocks} blocks; make plans with "
                            f"TrainConfig.rank_plan()")

    @property
    def builtin(self):
        """Is the model one of the built-in teaching models?"""
        return isinstance(self.model, str) and self.model in MODELS

    @property
    def global_batch(self):
        return self.world_size * self.micro_batch * self.accum_steps

    @property
    def loss_fn(self):
        """The loss callable (None: the conventions of `model.compute_loss`)."""
        return resolve(self.loss, "loss")

    def replace(self, **changes):
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        """Every field but the config, as a checkpoint's meta.json keeps them (the setting's
        text form, the probes as a sorted list)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {**d, "checkpoint": str(self.checkpoint), "probes": sorted(self.probes)}
