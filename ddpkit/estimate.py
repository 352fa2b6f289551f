"""Predicted bytes from first principles: what each op of the built-in models keeps for backward.

``estimate(cfg)`` returns an `Estimate` (bytes per rank). Parameter, gradient and optimizer bytes
are exact counts from the architecture. Activation bytes, for one micro-batch, follow from which
tensors each op saves (fp32):

* MLP block (pre-norm, hidden h = mlp_ratio*D), per sample: LayerNorm keeps its input (D) and
  mean/rstd (2); fc1 its input (D); GELU its input (h); fc2 its input (h): ``2D + 2h + 2``.
* GPT block, per token: ln1 input + stats (D + 2); qkv input (D); attention keeps q, k, v (one
  3D buffer), its output (D; proj's input is a view of it, heads merged back without a copy)
  and log-sum-exp (one per head); ln2 input + stats (D + 2); fc1 input (D); GELU input (h);
  fc2 input (h): ``8D + 2h + 4 + heads``.
* A checkpointed segment keeps only its input (D per sample or token), whatever its length; a
  plain block keeps all of the above. Segments are counted as `policies.segments_for` lays them
  out (the last segment of an int setting is never checkpointed).

Under bf16 autocast the matmul inputs are saved as bf16 copies: the prediction is then rougher
(it is tested for fp32). Dropout masks are not counted: the prediction is for ``dropout=0``.
ZeRO-1's optimizer bytes are the mean per rank: ZeroRedundancyOptimizer assigns whole
parameters greedily, so the heaviest rank can hold more.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .policies import segments_for

F32, I64 = 4, 8


@dataclass
class Estimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    activation_per_block: int
    boundary: int

    @property
    def total(self):
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self):
        return {**asdict(self), "total": self.total}

    def __repr__(self):
        mib = lambda b: f"{b / 2**20:.2f} MiB"
        return (f"Estimate(params={mib(self.params)}, grads={mib(self.grads)}, "
                f"optimizer={mib(self.optimizer)}, activations={mib(self.activations)}, "
                f"total={mib(self.total)})")


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
    block = tokens * (8 * D + 2 * h + 4 + cfg.n_heads) * F32
    boundary = tokens * D * F32
    # token ids (embedding); head: ln_f input + stats, head's input, log-softmax output,
    # targets and nll_loss's scalar total weight
    ends = tokens * I64 + tokens * (2 * D + 2) * F32 + tokens * V * F32 + tokens * I64 + F32
    return ends, block, boundary


def activation_bytes(cfg, checkpoint="config"):
    setting = cfg.checkpoint if checkpoint == "config" else checkpoint
    ends, block, boundary = activation_parts(cfg)
    total = ends
    for start, stop, on in segments_for(setting, cfg.n_blocks):
        total += boundary if on else (stop - start) * block
    return total


def optimizer_bytes(cfg, n_params):
    if cfg.optimizer == "sgd":
        return 0  # plain SGD (no momentum) keeps no state
    adam = 2 * n_params * F32  # exp_avg and exp_avg_sq
    sharded = cfg.optimizer == "zero1" or cfg.strategy in ("ddp_zero1", "fsdp")
    return adam // cfg.world_size if sharded else adam


def estimate(cfg) -> Estimate:
    """Predicted bytes per rank for ``cfg`` (a TrainConfig).

    Model states follow the ZeRO paper with this kit's dtypes (fp32 weights, fp32 gradients,
    two fp32 Adam moments: 4 + 4 + 8 = 16 bytes per parameter Psi): DDP keeps all 16 Psi on every
    rank; ZeRO-1 (``ddp_zero1``) shards the optimizer: 8 Psi + 8 Psi / N; FSDP (ZeRO-3) shards
    everything: 16 Psi / N (FSDP2 chunks each parameter along dim 0, so shards can be uneven by a
    few bytes: a 1-row weight lives whole on rank 0; they add up to exactly one copy).
    """
    from .config import TrainConfig

    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"estimate() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                        f"build one with ddpkit.TrainConfig(...)")
    n = param_count(cfg)
    _, block, boundary = activation_parts(cfg)
    shards = cfg.world_size if cfg.strategy == "fsdp" else 1
    return Estimate(params=n * F32 // shards, grads=n * F32 // shards,
                    optimizer=optimizer_bytes(cfg, n), activations=activation_bytes(cfg),
                    activation_per_block=block, boundary=boundary)
