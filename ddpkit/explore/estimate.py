"""Predicted bytes per rank, before any rank starts: from first principles for the built-in
models, and for any other model by tracing one forward under torch's ``FakeTensorMode``.

**Your model** (`trace`): the model is built under ``FakeTensorMode`` (no memory), the
checkpoint policy installed exactly as the ranks install it, and one micro-batch's forward run
with the same `ActivationProbe` the ranks measure with (each storage once, parameters left out).
What autograd saves is the same set of tensors with or without real data, so the prediction
equals the measurement. Per block (`Estimate.blocks`): the bytes each block keeps when it runs
plain, the bytes its input costs when it is checkpointed instead, and its forward FLOPs (what a
recompute costs), from one uncheckpointed trace with ``FlopCounterMode``.

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

import contextlib
import functools
import sys
import threading
from dataclasses import dataclass, field, fields

import torch

from ..engine.policies import CheckpointSetting
from . import attention
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

    def peak(self, step=None, rank=None):
        """The step's predicted peak per rank, a `ddpkit.engine.memory.Peak` (``bytes``,
        ``phase``, ``ledger``: bytes by kind at that moment), from the rank's own step simulated
        on fake tensors (`ddpkit.explore.peak`). ``step``: 0 (the optimizer state is made), 1
        or 'steady' (every step after: DDP's rebuild of its buckets at step 1 frees as much as it
        allocates), None: the higher. ``rank``: None is the heaviest rank."""
        from .peak import predicted_peak

        return predicted_peak(self.config, step, rank)

    def fits(self, gpu):
        """`plan.Fit` (truthy if it fits) of the step's peak on a GPU name ('T4', 'A100-80GB',
        'H100': see `ddpkit.explore.plan.GPUS`) or a byte count, with this config's setting."""
        from .plan import fits

        return fits(self.config, gpu)

    def largest_micro_batch(self, gpu):
        """The largest micro-batch with which this config fits ``gpu`` (0: none)."""
        from .plan import largest_micro_batch

        return largest_micro_batch(self.config, gpu)

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
        return (f"Estimate(params={mib(self.params)}, grads={mib(self.grads)}, "
                f"optimizer={mib(self.optimizer)}, activations={mib(self.activations)}; "
                f"the step's peak: .peak())")


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
    setting = _setting(cfg, setting)
    if not _by_formula(cfg):
        return trace_activations(cfg, setting)
    ends, block, boundary = activation_parts(cfg)
    total = ends
    for start, stop, on in setting.segments:
        total += boundary if on else (stop - start) * block
    return total


def _setting(cfg, setting):
    if setting is None:
        return cfg.checkpointing
    if not isinstance(setting, CheckpointSetting):
        raise TypeError(f"pass a CheckpointSetting (CheckpointSetting.of({setting!r}, "
                        f"{cfg.n_blocks})), or nothing for the config's own setting")
    return setting


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _target(cfg):
    """The GPU cfg's rank 0 computes attention on, or None for CPU ranks (`attention`)."""
    return attention.run_target(cfg.world_size, cfg.backend, cfg.device)


def _attention_bytes(cfg):
    """What the built-in GPT's SDPA makes and keeps, one block, on the kernel the run's device
    picks; None where that is CUDA's math kernel (no fixed set: traced instead)."""
    B, T, D, H = cfg.micro_batch, cfg.seq_len, cfg.width, cfg.n_heads
    x = torch.empty(B, T, 3 * D, dtype=_DTYPES[cfg.precision], device="meta")
    q, k, v = x.view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # as models.Attention does
    target = _target(cfg)
    kernel = "cpu_flash" if target is None else attention.cuda_kernel(
        q, k, v, target, is_causal=True, dropout_p=cfg.dropout)
    return attention.saved_bytes(kernel, q, k, v)


def _by_formula(cfg):
    """Does the first-principles formula cover cfg? The built-in models, unless CUDA would run
    the GPT's attention on its math kernel."""
    return cfg.builtin and (cfg.model == "mlp" or _attention_bytes(cfg) is not None)


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
    from ..config import TrainConfig

    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"estimate() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                        f"build one with ddpkit.TrainConfig(model=..., ...)")
    shards = state_shards(cfg)
    if _by_formula(cfg):
        n = param_count(cfg)
        _, block, boundary = activation_parts(cfg)
        costs = [BlockCost(f"blocks.{i}", block, boundary, f)
                 for i, f in enumerate(_traced(cfg).block_flops)]
        return Estimate(params=n * F32 // shards, grads=n * F32 // shards,
                        optimizer=optimizer_bytes(cfg, n), activations=activation_bytes(cfg),
                        activation_per_block=block, boundary=boundary, blocks=costs, config=cfg)
    t = _traced(cfg)
    costs = [BlockCost(name, keeps, boundary, flops) for name, keeps, boundary, flops
             in zip(t.block_names, t.block_keeps, t.block_boundary, t.block_flops)]
    return Estimate(params=t.param_bytes // shards, grads=t.trainable_bytes // shards,
                    optimizer=optimizer_bytes(cfg, t.trainable_bytes // F32),
                    activations=trace_activations(cfg), blocks=costs, method="traced",
                    activation_per_block=max(t.block_keeps), boundary=max(t.block_boundary),
                    config=cfg)


# ----------------------------------------------------------------------------- FakeTensorMode
class _Traced:
    """A config's model built under FakeTensorMode, with one fake micro-batch (cached)."""

    def __init__(self, cfg):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..engine.blocks import block_names, resolve_blocks
        from ..engine.data import first_batch, make_dataset
        from .fakeworld import fake_model

        self.cfg = cfg
        self.target = _target(cfg)  # a CUDA run: attention keeps what its CUDA kernel keeps
        self.mode = FakeTensorMode()
        self.lock, self.memo = threading.RLock(), {}
        real_batch = first_batch(cfg, make_dataset(cfg, n_samples=cfg.micro_batch))
        with self.mode, torch.random.fork_rng(devices=[]):
            self.model = fake_model(cfg)
        self.batch = torch.utils._pytree.tree_map(
            lambda t: self.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, real_batch)
        self.blocks = resolve_blocks(self.model, cfg.blocks_path)
        self.block_names = block_names(cfg.blocks_path, self.blocks)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # gradients and optimizer state exist for trainable parameters only (LoRA: adapters)
        self.trainable_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()
                                   if p.requires_grad)
        self._per_block()

    def forward_bytes(self, setting, probe=None):
        """Activation bytes one forward saves under ``setting`` (a `CheckpointSetting`,
        memoised per setting)."""
        from ..engine.probes import ActivationProbe
        from ..engine.spec import compute_loss
        from ..engine.step import autocast_for

        key = str(setting)
        if probe is None and key in self.memo:
            return self.memo[key]
        probe = probe or ActivationProbe()
        # one FakeTensorMode is not for two threads at once (the lab's plots and sliders)
        with self.lock:
            self.cfg.checkpoint_policy(setting).apply(self.model, self.cfg.blocks_path)
            with self.mode, _as_real_for_transformers(self.batch), probe.forward(self.model), \
                    autocast_for(self.cfg.precision, "cpu"), _on_device(self.target):
                compute_loss(self.model, self.batch, self.cfg.loss_fn)
        self.memo[key] = probe.bytes
        return probe.bytes

    def _per_block(self):
        from torch.utils.flop_counter import FlopCounterMode

        from ..engine.probes import ActivationProbe, storage

        probe, inputs = ActivationProbe(), {}

        def enter(i, module, args, kwargs):
            probe.owner = i
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            inputs[i] = storage(first)[1] if first is not None else 0
        hooks = [b.register_forward_pre_hook(functools.partial(enter, i), with_kwargs=True)
                 for i, b in enumerate(self.blocks)]
        hooks += [b.register_forward_hook(lambda *a: setattr(probe, "owner", None))
                  for b in self.blocks]
        try:
            with FlopCounterMode(display=False) as counter:
                self.forward_bytes(CheckpointSetting(None, len(self.blocks)), probe)
        finally:
            for h in hooks:
                h.remove()
        counts = counter.get_flop_counts()
        root = type(self.model).__name__
        self.block_keeps = [probe.by_owner.get(i, 0) for i in range(len(self.blocks))]
        self.block_boundary = [inputs.get(i, 0) for i in range(len(self.blocks))]
        self.block_flops = [sum(counts.get(f"{root}.{n}", {}).values()) for n in self.block_names]


def _on_device(target):
    """Attention as the run's device computes it: CPU's kernels as they are; on a CUDA
    target, the kernel CUDA picks, saving what it saves (`attention.on_cuda`)."""
    return contextlib.nullcontext() if target is None else attention.on_cuda(target)


@contextlib.contextmanager
def _as_real_for_transformers(batch):
    """transformers takes a FakeTensor for a compile trace (``is_tracing``): it then cannot read
    the mask data, so it builds an explicit causal mask instead of SDPA's ``is_causal=True``,
    which sends attention down another kernel than the real run takes (another set of saved
    tensors). For a batch with neither ``attention_mask`` nor ``position_ids`` the real run's
    decisions need no data (no padding, positions 0..T-1, nothing packed), so during the trace
    they are made as the run makes them. Other batches keep transformers' traced decisions."""
    masking = sys.modules.get("transformers.masking_utils")
    names = ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    plain = isinstance(batch, dict) and not {"attention_mask", "position_ids"} & set(batch)
    if masking is None or not plain or not all(hasattr(masking, n) for n in names):
        yield
        return
    real = {n: getattr(masking, n) for n in names}

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None and isinstance(q_offset, int) and local_attention_size is None:
            return q_length == 1 or kv_length == q_length
        return real["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset,
                                                kv_offset, local_attention_size)

    masking._ignore_causal_mask_sdpa = ignore
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for n, fn in real.items():
            setattr(masking, n, fn)


_TRACES = {}
_TRACES_LOCK = threading.Lock()


def _trace_key(cfg):
    d = cfg.to_dict()
    keep = ("model", "data", "loss", "blocks", "n_blocks", "width", "mlp_ratio", "seq_len", "vocab",
            "n_heads", "dropout", "micro_batch", "seed", "precision", "use_reentrant")
    return tuple((k, d[k] if isinstance(d[k], (str, int, float, type(None))) else id(d[k]))
                 for k in keep) + (_target(cfg),)


def _traced(cfg):
    key = _trace_key(cfg)
    with _TRACES_LOCK:
        hit = _TRACES.get(key)
        if hit is None or hit.cfg.model is not cfg.model or hit.cfg.data is not cfg.data:
            if len(_TRACES) > 16:
                _TRACES.clear()
            hit = _TRACES[key] = _Traced(cfg)
        return hit


def traced_flops(cfg, setting=None):
    """FLOPs of one micro-batch's forward and backward under ``setting`` (a `CheckpointSetting`;
    the config's when not given), counted under FakeTensorMode."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..engine.spec import compute_loss

    setting = _setting(cfg, setting)
    t = _traced(cfg)
    with t.lock:
        cfg.checkpoint_policy(setting).apply(t.model, cfg.blocks_path)
        with t.mode, _as_real_for_transformers(t.batch), FlopCounterMode(display=False) as counter:
            compute_loss(t.model, t.batch, cfg.loss_fn).backward()
    return counter.get_total_flops()


def trace_activations(cfg, setting=None):
    """Activation bytes of one micro-batch under ``setting`` (a `CheckpointSetting`; the
    config's when not given), traced (no memory)."""
    return _traced(cfg).forward_bytes(_setting(cfg, setting))
