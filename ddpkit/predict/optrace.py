"""What a simulated step computes, op by op: the stream the step-time prediction times.

`OpTrace` rides along the rank's step simulated on fake tensors (`simulate.py`): a dispatch mode
sees every op the rank would run (the forward, autograd's backward, the recompute of a
checkpointed region inside it, the optimizer, DDP's and FSDP's own copies and collectives) and
keeps, per op, what its time depends on: FLOPs (torch's ``flop_registry``, and the CPU
attention kernel it lacks), bytes read and written (each tensor's elements, views moving none),
the shape of a matrix product, its dtype, the phase and micro-step it ran in. Module hooks add
marks (a block's forward and backward start and end, a recompute) and DDP's comm hook adds one
per bucket handed to the all-reduce; a collective op (ZeRO-1's broadcasts, FSDP2's all-gathers
and reduce-scatters) is kept with its payload and group size, and the first later op that reads
what it wrote is where the step waits for it.

Nothing here is a time: `steptime.py` turns the stream into seconds with a machine's rates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .datadep import tensors_in
from .replay import recipe



_DTENSOR = []


def dtensor_class():
    """torch's ``DTensor`` class, or ``None`` while ``torch.distributed.tensor`` is not imported:
    no DTensor can exist before it is (FSDP2 imports it). Not imported here: it costs about a
    second of every ``import ddpkit`` (every kernel, the rank server, most tests)."""
    if _DTENSOR:  # asked on every op of a simulated step: found once, kept
        return _DTENSOR[0]
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if cls is not None:
        _DTENSOR.append(cls)
    return cls


def is_dtensor_op(types):
    """Does a dispatched op take a DTensor (its sharding propagation: the local ops it runs
    are seen instead)?"""
    cls = dtensor_class()
    return cls is not None and any(issubclass(t, cls) for t in types)


MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
             "_flash_attention_forward", "_flash_attention_backward",
             "_efficient_attention_forward", "_efficient_attention_backward"}
COLLECTIVES = {"allreduce_": "allreduce", "allreduce_coalesced_": "allreduce",
               "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
               "reduce_scatter_tensor_coalesced_": "reduce_scatter",
               "_allgather_base_": "allgather", "allgather_": "allgather",
               "allgather_coalesced_": "allgather", "allgather_into_tensor_coalesced_": "allgather",
               "broadcast_": "broadcast", "reduce_": "reduce", "alltoall_base_": "alltoall"}
# ops that only look at metadata or make a view: the dispatcher's cost, no data moved
_FAKE_ONLY = {"device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
              "is_contiguous", "sym_is_contiguous", "dim", "numel", "stride", "size"}
"""Ops a fake tensor dispatches where a real one reads a field (``t.device``): not run."""
_FREE = {"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided",
         "slice", "select", "unsqueeze", "squeeze", "alias", "split", "split_with_sizes",
         "unbind", "chunk", "narrow", "view_as", "unflatten", "lift_fresh", "_reshape_alias",
         "expand_as", "diagonal", "_to_copy_view"}
KINDS = ("matmul", "attention", "memory", "view", "collective")
SDPA_RANGE = "ddpkit.sdpa:"
"""The profiler range `attention.on_cuda` opens around a CUDA SDPA kernel's stand-in:
``ddpkit.sdpa:KERNEL:forward`` or ``:backward``."""
CUDA_SDPA = {"flash": "_scaled_dot_product_flash_attention",
             "efficient": "_scaled_dot_product_efficient_attention",
             "cudnn": "_scaled_dot_product_cudnn_attention"}


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the step. ``kind``: matmul, attention, memory (bound by bytes moved), view (no
    data moved) or collective. ``shape``: (batch, m, n, k) of a matrix product, (batch*heads,
    queries, keys, head dim) of attention; else (). ``group``: a collective's ranks."""
    name: str
    kind: str
    flops: int
    bytes: int
    dtype: str
    phase: str
    micro: int
    shape: tuple = ()
    recompute: bool = False
    group: int = 1
    index: int = 0
    recipe: tuple | None = dataclasses.field(default=None, compare=False, repr=False)
    """How to run it again for real (`replay.recipe`): the op and its arguments' shapes."""
    stream: int = 0
    """The CUDA stream a CUDA rank runs it on (0: the compute stream; `cudastreams` numbers
    FSDP2's own streams); always 0 for a CPU rank."""
    causal: bool = False
    """Attention with ``is_causal``: a flash kernel skips the masked half of its work."""


@dataclasses.dataclass(frozen=True)
class Mark:
    """A point in the stream: ``what`` is block_forward_start/end, block_backward_start/end,
    recompute_start/end (``block`` its index), grad (parameter ``block``'s gradient is ready,
    ``bytes`` its size), bucket (DDP handed the simulation's bucket ``block`` over: this
    micro-step syncs), forward_end/backward_end/optimizer_end (a phase of `train_step` ended),
    or wait (the step waits for the collective `Op` whose ``index`` is ``block``). A CUDA rank's
    streams and events (`cudastreams`): record (event ``block`` recorded on ``stream``),
    wait_event (``stream`` waits for event ``block``'s latest record), wait_stream (``stream``
    waits for all work queued so far on stream ``block``), sync_event (the host waits)."""
    what: str
    block: int
    phase: str
    micro: int
    bytes: int = 0
    stream: int = 0


def _elements_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _attention_flops(name, args, out):
    """FLOPs of CPU's flash attention and its backward (torch's registry lacks them), by the
    same formulas torch uses for the CUDA kernels."""
    shape = lambda t: tuple(t.shape)  # noqa: E731
    if name.endswith("_backward"):
        grad, q, k, v = args[:4]
        return sdpa_backward_flop_count(shape(grad), shape(q), shape(k), shape(v))
    q, k, v = args[:3]
    return sdpa_flop_count(shape(q), shape(k), shape(v))


def _matmul_shape(name, args):
    """(batch, m, n, k) of a matrix product from its operands."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if a.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return (1, a.shape[0], b.shape[1], a.shape[1])


class OpTrace(TorchDispatchMode):
    """Records the ops of a simulated step (``ops``: `Op` and `Mark` in the order they ran).
    ``live``: the simulation's `simulate.LiveStorages` (its phase, and whether it is inside
    DTensor's sharding propagation, whose ops no rank runs)."""

    def __init__(self, live):
        super().__init__()
        self.live = live
        self.stream = []
        self.micro = -1
        self.recomputing = 0
        self._pending = {}  # storage key -> index of the collective that writes it
        self._count = 0
        self.cuda_stream = 0  # set by `cudastreams.recorded` while a side stream is current
        self._regions = []  # record_function names entered and not yet left

    def reset(self):
        """A new step: the stream keeps only the last step's."""
        self.stream, self.micro, self.recomputing, self._pending = [], -1, 0, {}

    @contextlib.contextmanager
    def phase(self, name):
        """`train_step`'s phase marks (the simulation's own, ``live.mark``), and a mark where
        each ends: a backward's end is where DDP waits for its buckets' all-reduces."""
        with self.live.mark(name):
            yield
        self.mark(f"{name}_end")

    # --- marks from hooks
    def mark(self, what, block=-1, nbytes=0, stream=0):
        self.stream.append(Mark(what, block, self.live.phase or "", self.micro, nbytes, stream))

    def _phase(self):
        return self.live.phase or ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_dtensor_op(types):
            return NotImplemented
        out = func(*args, **kwargs)
        if self.live.ignore:
            return out
        packet = func._overloadpacket
        name = packet.__name__
        if name in _FAKE_ONLY:
            return out
        cuda_kernel = self._region(name, args)
        if cuda_kernel is False:
            return out  # a stand-in's own work, which the CUDA kernel does not do
        ins, outs = tensors_in((args, kwargs)), tensors_in(out)
        if not outs and name.startswith("_foreach_") and name.endswith("_"):
            outs = tensors_in(args[0])  # an in-place foreach op returns nothing: it writes self
        reads = {t.untyped_storage()._cdata for t in ins}
        waited = [i for key, i in self._pending.items() if key in reads]
        for i in waited:
            self.stream.append(Mark("wait", i, self._phase(), self.micro))
        if waited:
            self._pending = {k: i for k, i in self._pending.items() if i not in waited}
        op = self._op(func, name, packet, args, kwargs, ins, outs, out)
        if cuda_kernel:
            op = dataclasses.replace(op, name=cuda_kernel + ("_backward" if "backward" in name
                                                              else ""))
        self.stream.append(op)
        return out

    def _region(self, name, args):
        """Inside `attention.on_cuda`'s stand-in for a CUDA SDPA kernel (a ``ddpkit.sdpa:KERNEL:
        forward|backward`` profiler range): the CUDA op's name for the attention op itself,
        False for the stand-in's other ops (its copies, and the forward its backward runs
        again to reach torch's CPU backward), None elsewhere."""
        if name == "_record_function_enter_new":
            self._regions.append(args[0] if args and isinstance(args[0], str) else "")
        elif name == "_record_function_exit" and self._regions:
            self._regions.pop()
        region = next((r for r in reversed(self._regions) if r.startswith(SDPA_RANGE)), None)
        if region is None:
            return None
        _, kernel, which = region.split(":")
        if name in ATTENTION and name.endswith("backward") == (which == "backward"):
            return CUDA_SDPA.get(kernel, "_scaled_dot_product_" + kernel + "_attention")
        return False

    def _op(self, func, name, packet, args, kwargs, ins, outs, out):
        phase, micro = self._phase(), self.micro
        dtype = str((outs or ins or [torch.empty(0)])[0].dtype).replace("torch.", "")
        self._count += 1
        common = dict(dtype=dtype, phase=phase, micro=micro, recompute=self.recomputing > 0,
                      index=self._count, stream=self.cuda_stream)
        if name in COLLECTIVES:
            group = _group_size(args)
            for t in outs or ins:
                self._pending[t.untyped_storage()._cdata] = self._count
            return Op(name, "collective", 0, _payload(name, ins), group=group,
                      shape=(COLLECTIVES[name],), **common)
        if name in MATMULS or name in ATTENTION:
            flops = (flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry
                     else _attention_flops(name, args, out))
            shape = _matmul_shape(name, args) if name in MATMULS else _attention_shape(args)
            causal = name in ATTENTION and bool(_argument(func, args, kwargs, "is_causal"))
            return Op(name, "matmul" if name in MATMULS else "attention", int(flops),
                      _elements_bytes(ins) + _elements_bytes(outs), shape=shape, causal=causal,
                      recipe=recipe(func, args, kwargs), **common)
        in_keys = {t.untyped_storage()._cdata for t in ins}
        aliased = outs and all(t.untyped_storage()._cdata in in_keys for t in outs)
        if name in _FREE or (aliased and not name.endswith("_") and name != "copy_"):
            return Op(name, "view", 0, 0, **common)
        return Op(name, "memory", 0, _elements_bytes(ins) + _elements_bytes(outs),
                  recipe=recipe(func, args, kwargs), **common)

    # --- the blocks, as the rank's timeline probe sees them
    def watch(self, blocks, model, grads=False):
        """Hooks on the model and its blocks: micro-steps, each block's forward and backward,
        and a checkpointed block's recompute (its forward run again inside the backward);
        ``grads``: a ``grad`` mark where each parameter's gradient is ready (DDP's buckets are
        made in that order from step 1 on: `steptime` lays them out from these)."""
        handles = [model.register_forward_pre_hook(self._model_pre)]
        if grads:
            for i, p in enumerate(q for q in model.parameters() if q.requires_grad):
                nbytes = p.numel() * p.element_size()
                handles.append(p.register_post_accumulate_grad_hook(
                    lambda _, i=i, nbytes=nbytes: self.mark("grad", i, nbytes)))
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._block_pre(i), with_kwargs=True))
            # always_call: a recompute that torch stops early (non-reentrant checkpointing
            # stops at the last op the backward needs) ends with an exception in the block
            handles.append(block.register_forward_hook(self._block_post(i), always_call=True))
        return handles

    def _model_pre(self, module, args):
        if self._phase() == "forward":
            self.micro += 1

    def _block_pre(self, i):
        def hook(module, args, kwargs):
            t = _grad_tensor((args, kwargs))
            if self._phase() == "forward":
                self.mark("block_forward_start", i)
                if t is not None:
                    t.register_hook(lambda g: self.mark("block_backward_end", i))
            else:
                self.recomputing += 1
                self.mark("recompute_start", i)
        return hook

    def _block_post(self, i):
        def hook(module, args, out):
            if self._phase() == "forward":
                self.mark("block_forward_end", i)
                t = _grad_tensor(out)
                if t is not None:
                    t.register_hook(lambda g: self.mark("block_backward_start", i))
            else:
                self.mark("recompute_end", i)
                self.recomputing = max(0, self.recomputing - 1)
        return hook

    def bucket(self, index, nbytes):
        """DDP handed bucket ``index`` (``nbytes``) to its comm hook: its all-reduce starts."""
        self.mark("bucket", index, nbytes)

    @property
    def ops(self):
        return [e for e in self.stream if isinstance(e, Op)]


def _argument(func, args, kwargs, name):
    """An op's argument by its schema name (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    names = [a.name for a in func._schema.arguments]
    return args[names.index(name)] if name in names and names.index(name) < len(args) else None


def _grad_tensor(values):
    return next((t for t in tensors_in(values) if t.requires_grad), None)


def _attention_shape(args):
    q, k = args[0], args[1]
    batch = math.prod(q.shape[:-2])
    return (batch, q.shape[-2], k.shape[-2], q.shape[-1])


def _payload(name, ins):
    """The tensor bytes a collective moves, as `engine.collectives` counts its payload."""
    return _elements_bytes(ins)


def _group_size(args):
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return torch.distributed.ProcessGroup.unbox(a).size()
            except Exception:  # not a process group (a work or options object)
                continue
    return 1
