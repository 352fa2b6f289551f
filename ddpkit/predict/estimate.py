"""Predicted bytes per rank, before any rank starts: from first principles for the built-in
models, and for any other model by tracing one forward under torch's ``FakeTensorMode``.

**Your model** (`ddpkit.predict.trace`): one micro-batch traced under ``FakeTensorMode`` with
the checkpoint policy the ranks install and the `ActivationProbe` they measure with, so the
prediction equals the measurement; per block (`Estimate.blocks`) what each keeps plain, what
its input costs checkpointed, and its forward FLOPs. A large model is traced cut to 3 blocks
and its figures carried to all (`trace`). The step's peak: `Estimate.peak()`.

**The built-in models**, from first principles: what each op keeps for backward.

``estimate(cfg)`` returns an `Estimate` (bytes per rank). Parameter, gradient and optimizer bytes
are exact counts from the architecture. Activation bytes, for one micro-batch, follow from which
tensors each op saves (fp32):

* MLP block (pre-norm, hidden h = mlp_ratio*D), per sample: LayerNorm keeps its input (D) and
  mean/rstd (2); fc1 its input (D); GELU its input (h); fc2 its input (h): ``2D + 2h + 2``.
* GPT block, per token: ln1 input + stats (D + 2); qkv input (D); attention keeps q, k, v (one
  3D buffer), its output (D; proj's input is a view of it, heads merged back without a copy)
  and log-sum-exp (one per head); ln2 input + stats (D + 2); fc1 input (D); GELU input (h);
  fc2 input (h): ``8D + 2h + 4 + heads`` on CPU. What attention itself makes and keeps (output,
  log-sum-exp, on CUDA an RNG state and paddings) is the kernel's own: `attention` says which
  kernel the run's device picks and what it keeps; on CUDA's efficient kernel (fp32) that is
  16 bytes more per block and log-sum-exp rounded up to 32 tokens. Where CUDA would run its
  math kernel, the estimate traces the model instead.
* A checkpointed segment keeps only its input (D per sample or token), whatever its length; a
  plain block keeps all of the above. Segments are counted as `CheckpointSetting.segments` lays
  them out (the last segment of an int setting is never checkpointed).

Under bf16 autocast the matmul inputs are saved as bf16 copies: the prediction is then rougher
(it is tested for fp32). Dropout masks are not counted: the prediction is for ``dropout=0``.
ZeRO-1's optimizer bytes are the mean per rank: ZeroRedundancyOptimizer assigns whole
parameters greedily, so the heaviest rank can hold more.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ..config import TrainConfig
from ..spec.setting import CheckpointSetting
from ..engine.strategies import mixed_dtype
from . import attention
from .fits import fits, largest_micro_batch
from .gpus import card_target, is_card
from .peak import predicted_peak
from .steptime import step_time
from .trace import (as_real_for_transformers, as_setting, on_device,  # noqa: F401 (the API)
                    run_target, trace_activations, traced, traced_flops)
from .units import human_bytes

F32, I64 = 4, 8


@dataclass(frozen=True)
class BlockCost:
    """One block: activation bytes it keeps when plain, bytes its checkpoint keeps instead (its
    input), and its forward FLOPs (what recomputing it costs)."""
    name: str
    keeps: int
    boundary: int
    flops: int

    @property
    def saves(self):
        """Bytes freed by checkpointing this block alone."""
        return self.keeps - self.boundary


@dataclass
class Estimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    activation_per_block: int
    boundary: int
    blocks: list = field(default_factory=list, repr=False)
    """One `BlockCost` per block."""
    method: str = "formula"
    """'formula' (built-in models, first principles) or 'traced' (FakeTensorMode)."""
    config: object = field(default=None, repr=False, compare=False)
    assumed: tuple = ()
    """What sized each data-dependent op of the traced forward and backward (the batch's values,
    the routing assumed, an upper bound: `ddpkit.predict.datadep`), one line each."""

    def peak(self, step=None, rank=None, device=None):
        """The step's predicted peak per rank, a `ddpkit.engine.memory.Peak` (``bytes``,
        ``phase``, ``ledger``: bytes by kind at that moment), from the rank's own step simulated
        on fake tensors (`ddpkit.predict.peak`). ``step``: 0 (the optimizer state is made), any
        step number from 1 on or 'steady' (all the steady state: DDP's rebuild of its buckets at
        step 1 frees as much as it allocates), None: the higher. ``rank``: None is the heaviest
        rank. ``device``: a card's name ('H100'): the rank simulated as the CUDA rank it would be
        on that card (as `fits` does), whatever device the config runs on here."""
        if device is not None and not is_card(device):
            raise ValueError(f"peak(device={device!r}): pass a card's name such as 'H100' (its "
                             f"CUDA rank is simulated), or None for the config's own device")
        return predicted_peak(self.config, step, rank, card_target(device) if device else None)

    def step_time(self, device=None, link=None, rank=None):
        """The predicted time of one optimizer step, a `steptime.StepTime` (``seconds``,
        ``ledger`` by kind, ``comm_s``, ``overlap``, ``tokens_per_s``, ``mfu``, ``timeline``):
        the rank's own step simulated on fake tensors, played on this machine's measured rates
        (``device=None``; calibrated on first use, then cached) or on a named device's
        roofline (``device="H100"``, with ``link`` the network between nodes)."""
        return step_time(self.config, device=device, link=link, rank=rank)

    def fits(self, gpu, allowance=None):
        """`plan.Fit` (truthy if it fits) of the step's peak on a GPU name ('T4', 'A100-80GB',
        'H100': see `ddpkit.predict.gpus.GPUS`) or a byte count, with this config's setting and
        the allocator's allowance (``allowance``: a fraction of your own, 0 for none)."""
        return fits(self.config, gpu, allowance)

    def largest_micro_batch(self, gpu, allowance=None):
        """The largest micro-batch with which this config fits ``gpu`` (0: none)."""
        return largest_micro_batch(self.config, gpu, allowance=allowance)

    def blocks_table(self):
        """The per-block figures as a pandas DataFrame, best savings per FLOP first."""
        import pandas as pd

        rows = [dict(block=b.name, keeps_bytes=b.keeps, boundary_bytes=b.boundary,
                     saves_bytes=b.saves, recompute_flops=b.flops,
                     saves_per_mflop=b.saves / max(b.flops / 1e6, 1e-9)) for b in self.blocks]
        return pd.DataFrame(rows)

    @property
    def total(self):
        """Model states plus one micro-batch's activations: a sum of parts, not the step's
        peak (which adds DDP's buckets and the step's temporaries, and may sit in the
        optimizer step): for "will it fit", `peak()`."""
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self):
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("blocks", "config")}
        return {**out, "total": self.total}

    def __repr__(self):
        mib = human_bytes
        said = f"; {len(self.assumed)} data-dependent op(s) sized by .assumed" \
            if self.assumed else ""
        return (f"Estimate(params={mib(self.params)}, grads={mib(self.grads)}, "
                f"optimizer={mib(self.optimizer)}, activations={mib(self.activations)}; "
                f"the step's peak: .peak(){said})")


def param_count(cfg):
    D, h, n = cfg.width, cfg.mlp_ratio * cfg.width, cfg.n_blocks
    ln = 2 * D
    mlp = (D * h + h) + (h * D + D)
    if cfg.model == "mlp":
        return (D * D + D) + n * (ln + mlp) + ln + (D + 1)
    attn = (D * 3 * D + 3 * D) + (D * D + D)
    return cfg.vocab * D + cfg.seq_len * D + n * (2 * ln + attn + mlp) + ln + D * cfg.vocab


def activation_parts(cfg):
    """(stem+head bytes, bytes per plain block, bytes per checkpoint boundary), one micro-batch."""
    B, D, h = cfg.micro_batch, cfg.width, cfg.mlp_ratio * cfg.width
    if cfg.model == "mlp":
        block = B * (2 * D + 2 * h + 2) * F32
        boundary = B * D * F32
        # stem keeps x; head: ln_f input + stats, out's input, mse keeps prediction and target
        ends = B * D * F32 + B * (2 * D + 2) * F32 + 2 * B * F32
        return ends, block, boundary
    T, V = cfg.seq_len, cfg.vocab
    tokens = B * T
    attn = _attention_bytes(cfg)  # attention's own output and log-sum-exp, and more on CUDA
    if attn is None:
        raise ValueError(f"this run's GPU would compute attention with torch's math kernel "
                         f"(head dim {D // cfg.n_heads}), which the formula does not count; "
                         f"estimate(cfg) traces the model instead")
    block = tokens * (7 * D + 2 * h + 4) * F32 + attn
    boundary = tokens * D * F32
    # token ids (embedding); head: ln_f input + stats, head's input, log-softmax output,
    # targets and nll_loss's scalar total weight
    ends = tokens * I64 + tokens * (2 * D + 2) * F32 + tokens * V * F32 + tokens * I64 + F32
    return ends, block, boundary


def activation_bytes(cfg, setting=None):
    """Predicted activation bytes of one micro-batch under ``setting`` (a `CheckpointSetting`;
    the config's when not given): first principles for the built-in models, a FakeTensorMode
    trace for yours."""
    setting = as_setting(cfg, setting)
    if not _by_formula(cfg):
        return trace_activations(cfg, setting)
    ends, block, boundary = activation_parts(cfg)
    total = ends
    for start, stop, on in setting.segments:
        total += boundary if on else (stop - start) * block
    return total


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _attention_bytes(cfg):
    """What the built-in GPT's SDPA makes and keeps, one block, on the kernel the run's device
    picks; None where that is CUDA's math kernel (no fixed set: traced instead)."""
    B, T, D, H = cfg.micro_batch, cfg.seq_len, cfg.width, cfg.n_heads
    x = torch.empty(B, T, 3 * D, dtype=_DTYPES[cfg.precision], device="meta")
    q, k, v = x.view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # as models.Attention does
    target = run_target(cfg)
    kernel = "cpu_flash" if target is None else attention.cuda_kernel(
        q, k, v, target, is_causal=True, dropout_p=cfg.dropout)
    return attention.saved_bytes(kernel, q, k, v)


def _by_formula(cfg):
    """Does the first-principles formula cover cfg? The built-in models, unless CUDA would run
    the GPT's attention on its math kernel, or FSDP's mixed precision computes in bf16/fp16
    (traced instead)."""
    return cfg.builtin and mixed_dtype(cfg.rank_plan()) is None and \
        (cfg.model == "mlp" or _attention_bytes(cfg) is not None)


def optimizer_bytes(cfg, n_params):
    if cfg.optimizer == "sgd":
        return 0  # plain SGD (no momentum) keeps no state
    adam = 2 * n_params * F32  # exp_avg and exp_avg_sq
    if cfg.strategy == "hsdp":
        return adam // cfg.shard_size
    sharded = cfg.optimizer == "zero1" or cfg.strategy in ("ddp_zero1", "zero2", "fsdp")
    return adam // cfg.world_size if sharded else adam


def state_shards(cfg):
    """Over how many ranks parameters and gradients are sharded (between steps)."""
    return {"zero2": cfg.world_size, "fsdp": cfg.world_size,
            "hsdp": cfg.shard_size}.get(cfg.strategy, 1)


def estimate(cfg) -> Estimate:
    """Predicted bytes per rank for ``cfg`` (a TrainConfig), with nothing allocated.

    Model states follow the ZeRO paper with this kit's dtypes (fp32 weights, fp32 gradients,
    two fp32 Adam moments: 4 + 4 + 8 = 16 bytes per parameter Psi): DDP keeps all 16 Psi on every
    rank; ZeRO-1 (``ddp_zero1``) shards the optimizer: 8 Psi + 8 Psi / N; FSDP (ZeRO-3) shards
    everything: 16 Psi / N; ZeRO-2 (``zero2``) as FSDP between steps (FSDP2 frees the gathered
    parameters after backward; the paper keeps them: 4 Psi more); HSDP: 16 Psi / shard_size (FSDP2 chunks each parameter along dim 0, so shards can be uneven by a
    few bytes: a 1-row weight lives whole on rank 0; they add up to exactly one copy).
    Activations: first principles for the built-in models, a FakeTensorMode trace for yours.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"estimate() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                        f"build one with ddpkit.TrainConfig(model=..., ...)")
    shards = state_shards(cfg)
    if _by_formula(cfg):
        n = param_count(cfg)
        _, block, boundary = activation_parts(cfg)
        costs = [BlockCost(f"blocks.{i}", block, boundary, f)
                 for i, f in enumerate(traced(cfg).block_flops)]
        return Estimate(params=n * F32 // shards, grads=n * F32 // shards,
                        optimizer=optimizer_bytes(cfg, n), activations=activation_bytes(cfg),
                        activation_per_block=block, boundary=boundary, blocks=costs, config=cfg)
    t = traced(cfg)
    costs = [BlockCost(name, keeps, boundary, flops) for name, keeps, boundary, flops
             in zip(t.block_names, t.block_keeps, t.block_boundary, t.block_flops)]
    activations = trace_activations(cfg)
    return Estimate(params=t.param_bytes // shards, grads=t.trainable_bytes // shards,
                    optimizer=optimizer_bytes(cfg, t.trainable_bytes // F32),
                    activations=activations, blocks=costs, method="traced",
                    activation_per_block=max(t.block_keeps), boundary=max(t.block_boundary),
                    config=cfg, assumed=tuple(t.datadep.lines()))


