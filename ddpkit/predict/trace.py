"""One micro-batch of your model, traced under ``FakeTensorMode``: what its forward saves for
backward (per setting and per block) and what its forward and backward cost in FLOPs.

The model is built without memory or initialisation (`spec.model.fake_model`), the checkpoint policy
installed exactly as the ranks install it, and the forward run with the same `ActivationProbe`
the ranks measure with (each storage once, parameters left out): what autograd saves is the
same set of tensors with or without real data, so the prediction equals the measurement. Per
block (`Traced.block_keeps` etc.): the bytes each block keeps when it runs plain, the bytes its
input costs when it is checkpointed instead, and its forward FLOPs (from one trace with
``FlopCounterMode``, which names every op's module).

**Real sizes.** Above `scale.SCALE_ABOVE` parameters the model is traced cut to its first
3 blocks and the figures are carried to all N (the middle block's for blocks 1 to N-2, the
last traced block's for block N-1): one micro-batch saves ``ends + sum of the plain blocks'
keeps + each checkpointed region's input``, and costs ``F(none) + each region's recompute``,
where ``F(none) = F(3 blocks) + (N - 3) * (one middle block's forward and backward)`` and a
region of L blocks recomputes the forward of its first L-1 blocks and as much of the last as a
block checkpointed alone does (non-reentrant checkpointing stops at the last op the backward
needs). Checked equal to the full trace, to the byte and the FLOP (tests/test_scale.py).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

from ..engine import strategies
from ..engine.data import first_batch, make_dataset
from ..engine.policies import install
from ..engine.probes import ActivationProbe, storage
from ..engine.step import autocast_for
from ..spec import rng
from ..spec.blocks import block_names, find_stacks, stack_sizes
from ..spec.empty import stage
from ..spec.model import compute_loss, describe_spec, fake_model
from ..spec.setting import CheckpointSetting
from . import attention
from .datadep import DataDependence

SCALE_ABOVE = 300_000_000
"""Parameters above which a model is traced cut to `TRACED_BLOCKS` blocks and its simulated
step composed from pieces of the model cut to a few blocks (`compose`)."""
TRACED_BLOCKS = 3
"""Blocks a large model is traced with (the first, one middle, the last)."""


class Traced:
    """A config's model under FakeTensorMode with one fake micro-batch (cached per config):
    ``keep=None`` the whole model, ``keep=k`` its first k blocks, its figures carried to all."""

    def __init__(self, cfg, keep=None):
        self.cfg, self.keep, self.n = cfg, keep, cfg.n_blocks
        self.plan = plan = cfg.rank_plan()  # what the rank's code reads
        self.target = run_target(cfg)  # a CUDA run: attention keeps what its CUDA kernel keeps
        self.mode = FakeTensorMode()
        self.lock, self.memo = threading.RLock(), {}
        real_batch = example_batch(cfg)
        # FSDP's mixed precision computes with bf16 parameters and casts float inputs to bf16
        dtype = strategies.mixed_dtype(plan)
        with rng.forked():
            self.model, self.how = fake_model(plan, self.mode, keep, dtype)
        cast = (lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        # data-dependent ops (a loss's label checks, MoE routing): sized from the batch's
        # values, the routing assumption or an upper bound, each noted (`datadep`)
        self.datadep = DataDependence(cfg.routing)
        self.batch = torch.utils._pytree.tree_map(
            lambda t: self.datadep.fake(self.mode, cast(t)) if isinstance(t, torch.Tensor) else t,
            real_batch)
        stacks = find_stacks(self.model, plan.blocks)
        self.blocks = [b for _, container in stacks for b in container]
        self.none = CheckpointSetting(None, stack_sizes(stacks))  # on the traced stacks
        # a cut model (one stack) is named as the whole one
        self.block_names = block_names([(p, self.n) for p, _ in stacks] if keep else stacks)
        self._per_block()
        if keep is not None:
            self._carry()

    def stage(self, name):
        """A failure in this stage of the trace becomes a `TraceError` naming it."""
        return stage(name, f"TrainConfig.model={describe_spec(self.cfg.model)}, built by "
                           f"{self.how}")

    @property
    def scaled(self):
        return self.keep is not None

    def forward_bytes(self, setting, probe=None):
        """Activation bytes one forward saves under ``setting`` (a `CheckpointSetting`,
        memoised per setting)."""
        key = (str(setting), setting.n_blocks)
        if probe is None and key in self.memo:
            return self.memo[key]
        if self.scaled and probe is None:
            self.memo[key] = self._carried_bytes(setting)
            return self.memo[key]
        probe = probe or ActivationProbe()
        # one FakeTensorMode is not for two threads at once (the lab's plots and sliders)
        with self.lock:
            with self.stage("installing the checkpoint policy"):
                probe.policy = install(self.plan, self.model, setting)
            with self.stage("the forward"), self.mode, self.datadep, \
                    as_real_for_transformers(self.batch), probe.forward(self.model), \
                    autocast_for(strategies.autocast_precision(self.plan), "cpu"), \
                    on_device(self.target):
                # held until the window closes, as a rank holds it for its backward: what
                # the loss itself saved is an activation too
                loss = compute_loss(self.model, self.batch, self.plan.loss_fn)
            del loss
        self.memo[key] = probe.bytes
        return probe.bytes

    def step_flops(self, setting):
        """FLOPs of one micro-batch's forward and backward under ``setting``."""
        if self.scaled:
            return self._carried_flops(setting)
        # memoised per setting and per torch's early-stop switch, the one global that changes
        # what a recompute runs (`torch.utils.checkpoint.set_checkpoint_early_stop`)
        key = ("flops", str(setting), setting.n_blocks,
               torch.utils.checkpoint._enable_checkpoint_early_stop)
        with self.lock:
            if key not in self.memo:
                self.memo[key] = self._counted_flops(setting)[0]
            return self.memo[key]

    def _counted_flops(self, setting):
        """(total FLOPs, {module name: FLOPs}) of forward and backward, counted."""
        with self.lock:
            with self.stage("installing the checkpoint policy"):
                install(self.plan, self.model, setting)
            with self.stage("the step"), self.mode, self.datadep, \
                    as_real_for_transformers(self.batch), \
                    FlopCounterMode(display=False, custom_mapping=MORE_FLOPS) as counter:
                compute_loss(self.model, self.batch, self.plan.loss_fn).backward()
        return counter.get_total_flops(), {k: sum(v.values()) for k, v in
                                           counter.get_flop_counts().items()}

    def _per_block(self):
        probe, inputs = ActivationProbe(), {}

        def enter(i, module, args, kwargs):
            probe.owner = i
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            inputs[i] = storage(first)[1] if first is not None else 0
        hooks = [b.register_forward_pre_hook(functools.partial(enter, i), with_kwargs=True)
                 for i, b in enumerate(self.blocks)]
        hooks += [b.register_forward_hook(lambda *a: setattr(probe, "owner", None))
                  for b in self.blocks]
        counter = BlockFlops(probe)
        try:
            with counter:
                self.forward_bytes(self.none, probe)
        finally:
            for h in hooks:
                h.remove()
        self.block_keeps = [probe.by_owner.get(i, 0) for i in range(len(self.blocks))]
        self.block_boundary = [inputs.get(i, 0) for i in range(len(self.blocks))]
        self.block_flops = [counter.by_owner.get(i, 0) for i in range(len(self.blocks))]
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # gradients and optimizer state exist for trainable parameters only (LoRA: adapters)
        self.trainable_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()
                                   if p.requires_grad)

    def _carry(self):
        """The traced blocks' figures carried to all N (the first, the middle one's, the last)."""
        k, n = len(self.blocks), self.n
        of = [0] + [1] * (n - 2) + [k - 1]  # block i of the model -> traced block of[i]
        plain = self.memo["none", k]
        self.ends = plain - sum(self.block_keeps)
        block_params = [sum(p.numel() * p.element_size() for p in b.parameters())
                        for b in self.blocks]
        self.param_bytes += (n - k) * block_params[1]
        self.trainable_bytes += (n - k) * sum(p.numel() * p.element_size()
                                              for p in self.blocks[1].parameters() if p.requires_grad)
        total, per_module = self._counted_flops(self.none)
        root, middle = type(self.model).__name__, self.block_names[1]
        self.plain_flops = total + (n - k) * per_module[f"{root}.{middle}"]
        self.alone = []  # recompute of traced block j checkpointed on its own
        for j in range(k):
            mask = [i == j for i in range(k)]
            self.alone.append(self._counted_flops(self.none.with_value(mask))[0] - total)
        # tensors every block uses are counted once, on the first block that saves them (the
        # first plain block, or the regions: Llama's rotary cos/sin, its position ids). The
        # sums above give them to block 0 when it runs plain; what they miss, two traces say:
        # ``regions`` (what only regions hold) with block 0 plain, ``first`` (what block 0
        # plain held) with block 0 checkpointed too
        tail = self.none.with_value([False] + [True] * (k - 1))
        full = self.none.with_value("full")
        self.regions_hold = self.forward_bytes(tail, ActivationProbe()) - self._carried_bytes(tail, k)
        self.first_holds = (self.forward_bytes(full, ActivationProbe()) - self._carried_bytes(full, k)
                            - self.regions_hold)
        self.block_keeps = [self.block_keeps[j] for j in of]
        self.block_boundary = [self.block_boundary[j] for j in of]
        self.block_flops = [self.block_flops[j] for j in of]
        self.alone = [self.alone[j] for j in of]

    def _carried_bytes(self, setting, traced_blocks=None):
        keeps = self.block_keeps[:traced_blocks] if traced_blocks else self.block_keeps
        out = self.ends + sum(keeps)
        for a, b in setting.regions:  # a region keeps its first block's input, no more
            out -= sum(keeps[a:b]) - self.block_boundary[a]
        if traced_blocks is None and setting.regions:
            out += self.regions_hold + (self.first_holds if setting.mask[0] else 0)
        return out

    def _carried_flops(self, setting):
        out = self.plain_flops
        for a, b in setting.regions:  # the forward of all its blocks but the last, again
            out += sum(self.block_flops[a:b - 1]) + self.alone[b - 1]
        return out


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs):
    """FLOPs of ``torch._grouped_mm`` (transformers' MoE experts), which torch's counter does not
    know: each row of the jagged operand meets one group's matrix."""
    if len(a) == 2 and len(b) == 3:  # (S, K) x (E, K, N): the forward, and the input's gradient
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # (K, S) x (S, N) cut by S: the weights' gradient
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[-1]  # batched


MORE_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


class BlockFlops(TorchDispatchMode):
    """Forward FLOPs by the block that ran them (``owner.owner``, the per-block trace's probe):
    torch's formulas (``flop_counter.flop_registry``), without its module tracker, which holds
    what a forward hook replaced (a router's top-k under a routing hook) alive."""

    def __init__(self, owner):
        super().__init__()
        self.owner, self.by_owner = owner, {}
        self.formulas = {**flop_registry, **{k: shape_wrapper(v) for k, v in MORE_FLOPS.items()}}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None and self.owner.owner is not None:
            n = formula(*args, **kwargs, out_val=out)
            self.by_owner[self.owner.owner] = self.by_owner.get(self.owner.owner, 0) + n
        return out


def on_device(target):
    """Attention as the run's device computes it: CPU's kernels as they are; on a CUDA
    target, the kernel CUDA picks, saving what it saves (`attention.on_cuda`)."""
    return contextlib.nullcontext() if target is None else attention.on_cuda(target)


@contextlib.contextmanager
def as_real_for_transformers(batch):
    """transformers takes a FakeTensor for a compile trace (``is_tracing``): it then cannot read
    the mask data, so it builds an explicit attention mask instead of SDPA's ``is_causal=True``
    (or no mask), which sends attention down another kernel than the real run takes (another
    set of saved tensors). For a batch with neither ``attention_mask`` nor ``position_ids`` the
    real run's decisions need no data: no padding (a padding mask the model makes itself, as
    BART's decoder makes ``torch.ones``, is all ones), positions 0..T-1, nothing packed. So
    during the trace they are made as the run makes them. Other batches keep transformers'
    traced decisions."""
    masking = sys.modules.get("transformers.masking_utils")
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa",
             "find_packed_sequence_indices")
    plain = isinstance(batch, dict) and not {"attention_mask", "position_ids"} & set(batch)
    if masking is None or not plain or not all(hasattr(masking, n) for n in names):
        yield
        return
    real = {n: getattr(masking, n) for n in names}
    def unpadded(mask):  # no mask, or one the model made without the batch's data: all ones
        return mask is None or is_fake(mask)

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if unpadded(padding_mask) and isinstance(q_offset, int) and local_attention_size is None:
            return q_length == 1 or kv_length == q_length or (q_offset == 0 and
                                                              padding_mask is None)
        return real["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset,
                                                kv_offset, local_attention_size)

    def ignore_bidirectional(padding_mask, kv_length, local_attention_size=None):
        if unpadded(padding_mask) and local_attention_size is None:
            return True
        return real["_ignore_bidirectional_mask_sdpa"](padding_mask, kv_length,
                                                       local_attention_size)

    masking._ignore_causal_mask_sdpa = ignore
    masking._ignore_bidirectional_mask_sdpa = ignore_bidirectional
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
            "n_heads", "dropout", "micro_batch", "seed", "precision", "use_reentrant", "routing")
    return tuple((k, d[k] if isinstance(d[k], (str, int, float, type(None))) else id(d[k]))
                 for k in keep) + (run_target(cfg), str(strategies.mixed_dtype(cfg.rank_plan())))


_BATCHES = {}
_BATCHES_LOCK = threading.Lock()  # its own: `traced` builds a Traced (which asks) under _TRACES_LOCK


def example_batch(cfg):
    """One micro-batch of ``cfg``'s data, as the ranks collate it (kept: a long synthetic
    sequence takes a while to make, and the estimate and the simulation both want one)."""
    key = _trace_key(cfg)
    with _BATCHES_LOCK:
        hit = _BATCHES.get(key)
    if hit is None or hit[0].model is not cfg.model or hit[0].data is not cfg.data:
        plan = cfg.rank_plan()
        hit = (cfg, first_batch(plan, make_dataset(plan, n_samples=cfg.micro_batch)))
        with _BATCHES_LOCK:
            if len(_BATCHES) > 16:
                _BATCHES.clear()
            _BATCHES[key] = hit
    return hit[1]


def traced(cfg, keep="auto"):
    """The `Traced` model of ``cfg`` (cached): ``keep="auto"``: its first `TRACED_BLOCKS`
    blocks above `SCALE_ABOVE` parameters (more than 4 blocks), else the whole model."""
    if keep == "auto":
        big = (cfg.n_blocks > TRACED_BLOCKS + 1 and cfg.info.n_params > SCALE_ABOVE
               and len(cfg.info.stacks) == 1)  # several stacks: traced whole
        keep = TRACED_BLOCKS if big else None
    key = _trace_key(cfg) + (keep,)
    with _TRACES_LOCK:
        hit = _TRACES.get(key)
        if hit is None or hit.cfg.model is not cfg.model or hit.cfg.data is not cfg.data:
            if len(_TRACES) > 16:
                _TRACES.clear()
            hit = _TRACES[key] = Traced(cfg, keep)
        return hit


def as_setting(cfg, setting):
    """``setting`` as given (a `CheckpointSetting`), or the config's own when None."""
    if setting is None:
        return cfg.checkpoint
    if not isinstance(setting, CheckpointSetting):
        raise TypeError(f"pass a CheckpointSetting, or nothing for the config's own setting; "
                        f"cfg.checkpoint.with_value({setting!r}) makes one on this config's "
                        f"stacks")
    return setting


def run_target(cfg):
    """The GPU cfg's rank 0 computes attention on (an `attention.CudaTarget`), or None for CPU
    ranks."""
    return attention.run_target(cfg.world_size, cfg.backend, cfg.device)


def traced_flops(cfg, setting=None):
    """FLOPs of one micro-batch's forward and backward under ``setting`` (a `CheckpointSetting`;
    the config's when not given), counted under FakeTensorMode."""
    return traced(cfg).step_flops(as_setting(cfg, setting))


def trace_activations(cfg, setting=None):
    """Activation bytes of one micro-batch under ``setting`` (a `CheckpointSetting`; the
    config's when not given), traced (no memory)."""
    return traced(cfg).forward_bytes(as_setting(cfg, setting))
