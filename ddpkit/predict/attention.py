"""What ``scaled_dot_product_attention`` saves for backward on the kernel each device runs.

The estimate traces a model on CPU, where SDPA runs CPU kernels. A CUDA rank runs one of four
other kernels, chosen at each call by torch's rules (`cuda_kernel`), and each saves its own set
of tensors (`kernel_saves`). Besides the caller's q, k, v (kept as they are), per call:

==============  ==========================================================================
kernel          what it makes and keeps for backward (B batch, H heads, L queries, Ev value dim)
==============  ==========================================================================
CPU flash       output (B, H, L, Ev); log-sum-exp (B, H, L) in fp32 (fp64 for fp64 inputs)
efficient       output; log-sum-exp (B, H, L rounded **up to a multiple of 32**) fp32; the
                philox seed and offset, two 0-dim int64 (8 bytes each, dropout or not);
                an attn_mask as its float copy, padded to a multiple of 8 keys if unaligned
flash           output; log-sum-exp (B, H, L) fp32; RNG state (2,) uint64 and an unused
                0-dim uint64 (24 bytes); q, k, v **copied, padded** to a multiple of 8 in
                their last dim when it is not one (and the output at that width)
cuDNN           output; log-sum-exp (B, H, L, 1) fp32; seed and offset, (1,) int64 each
                (the meta function says 0-dim: the same 8 bytes)
math            no fixed set: the composite's matmuls and softmax save what they save. It
                runs the same ops on every device, so a trace runs it as CUDA would
==============  ==========================================================================

Sources, torch 2.13: the meta functions in ``torch/_meta_registrations.py`` (shapes), the
autograd formulas of the aten SDPA ops (which outputs are saved), ``attention.cpp``'s SDPA
(the padding of flash and of the efficient kernel's mask, a boolean mask made float) and the
kernels' allocations (``mha_fwd``: the output as ``empty_like`` of q in (B, L, H, E) order;
``_efficient_attention_forward``: (B, L, H, Ev); cuDNN: in q's stride order). The selection
follows ``sdp_utils.cpp`` (pytorch main at 001f694a, read for torch 2.13: no CUDA build of 2.13
was available to read or run): the priority order (flash, efficient, math, cuDNN; cuDNN first on
sm90/sm100 with cuDNN newer than 9.15.0), then each kernel's constraints, in `why_not`.
``tests/test_attention.py`` checks every row above against the CUDA ops' meta functions and
autograd formulas, run on meta tensors on CPU. The trace cannot run the CUDA kernels themselves:
SDPA on fake CUDA tensors aborts a CPU build of torch (TORCH_NOTES).

`on_cuda(target)` is what the estimate runs a trace under when the run's device is CUDA: each
SDPA call takes the kernel CUDA would pick and saves exactly that kernel's tensors (a stand-in
`torch.autograd.Function`; math runs as math).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import devices

KERNELS = ("cudnn", "flash", "efficient", "math")  # CUDA's SDPA kernels, torch's names
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # torch._C._get_sdp_priority_order()
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaTarget:
    """What torch's kernel choice reads from the GPU a rank runs on: its compute capability,
    the cuDNN version (None: no cuDNN), CUDA's version, and which kernels are switched on (a
    fresh rank: all of them, in torch's default order)."""
    capability: tuple = (8, 0)
    cudnn: int | None = None
    cuda: str | None = "12.8"
    enabled: frozenset = frozenset(KERNELS)

    @classmethod
    def of_gpu(cls, capability):
        """This machine's torch build (cuDNN and CUDA versions) on a GPU of ``capability``."""
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return cls(tuple(capability), cudnn, torch.version.cuda)

    def order(self):
        """The kernels in the order CUDA tries them (``sdp_utils.cpp``, ``priority_order``)."""
        major, minor = self.capability
        cuda13 = self.cuda is not None and int(self.cuda.split(".")[0]) >= 13
        prefer_cudnn = (os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") not in
                        ("1", "true", "True", "ON", "on", "YES", "yes")
                        and (self.cudnn or 0) > 91500 and major in (9, 10)
                        and (cuda13 or minor in (0, 3)))
        return ("cudnn", "flash", "efficient", "math") if prefer_cudnn else DEFAULT_ORDER


@dataclass(frozen=True)
class Saved:
    """One tensor a kernel makes and keeps for backward."""
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


def _ceil(n, m):
    return -(-n // m) * m


# ----------------------------------------------------------------------------- the choice
def _dense(q, k, v, enable_gqa, gqa, ignore_singleton, same_v_heads=True):
    """The dense-input constraints every fused CUDA kernel shares (``sdp_utils_cpp.h``)."""
    if q.size(-2) == 0 or k.size(-2) == 0:
        return "a zero-length sequence"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and not (ignore_singleton and t.size(-1) == 1):
            return f"{name}'s last dim is strided"
    if not q.size(0) == k.size(0) == v.size(0):
        return "q, k, v batch sizes differ"
    hq, hk, hv = q.size(1), k.size(1), v.size(1)
    if hq == hk == hv:
        return None
    if not (gqa and enable_gqa) or hq % hk or (hk != hv if same_v_heads else hq % hv):
        return f"heads {hq}, {hk}, {hv} are not grouped-query attention this kernel runs"
    return None


def _alignment(target, dtype):
    """The efficient kernel's head-dim and pointer alignment, in elements
    (``minimum_gemm_alignment``)."""
    major = target.capability[0]
    half = dtype in HALF
    base = 4 if major >= 8 else 1
    tensor_cores = major >= 8 or (major >= 7 and half)
    return max(base, 128 // (16 if half else 32)) if tensor_cores else base


def why_not(kernel, q, k, v, target, attn_mask=None, dropout_p=0.0, is_causal=False,
            enable_gqa=False, requires_grad=True):
    """Why CUDA would not run ``kernel`` for this call on ``target``, or None if it would."""
    cap, dtype = tuple(target.capability), q.dtype
    if kernel not in target.enabled:
        return f"{kernel} is switched off"
    if kernel == "math":
        return None
    if not q.dim() == k.dim() == v.dim() == 4:
        return "needs 4-D q, k, v"
    E, Ev, L, S = q.size(-1), v.size(-1), q.size(-2), k.size(-2)
    if kernel == "flash":
        if attn_mask is not None:
            return "flash takes no attn_mask"
        if not (E == k.size(-1) == Ev and E <= 256):
            return "flash needs equal head dims of at most 256"
        if not (8, 0) <= cap <= (12, 1):
            return f"flash needs sm80..sm121, this is sm{cap[0]}{cap[1]}"
        if requires_grad and ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)) and \
                not (E <= 192 or (dropout_p == 0 and E > 224)):
            return "flash cannot train this head dim on sm86-89/sm120"
        if is_causal and L != S:
            return "flash takes is_causal only with as many queries as keys"
        if dtype not in (HALF if cap >= (8, 0) else (torch.float16,)):
            return f"flash needs fp16/bf16, not {dtype}"
        return _dense(q, k, v, enable_gqa, gqa=True, ignore_singleton=True)
    if kernel == "efficient":
        if not (5, 0) <= cap <= (12, 1):
            return f"efficient needs sm50..sm121, this is sm{cap[0]}{cap[1]}"
        a = _alignment(target, dtype)
        if E != k.size(-1) or E % a or Ev % a or E == 0 or Ev == 0:
            return f"efficient needs head dims divisible by {a}"
        if cap >= (8, 0) and any(t.storage_offset() % a for t in (q, k, v)):
            return f"efficient needs q, k, v storage offsets divisible by {a} elements"
        reason = _dense(q, k, v, enable_gqa, gqa=True, ignore_singleton=False)
        allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if cap >= (8, 0) else ())
        return reason or (None if dtype in allowed else f"efficient does not run {dtype}")
    return _why_not_cudnn(q, k, v, target, attn_mask, dropout_p, enable_gqa, requires_grad)


def _why_not_cudnn(q, k, v, target, attn_mask, dropout_p, enable_gqa, requires_grad):
    cap, version = tuple(target.capability), target.cudnn or 0
    if version < 90000:
        return "cuDNN attention needs cuDNN 9"
    if dropout_p > 0 and 91100 < version < 91400:
        return "cuDNN 9.11-9.13 runs no SDPA dropout"
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():
        return "cuDNN attention is not deterministic"
    if q.dtype not in (HALF if cap >= (8, 0) else (torch.float16,)):
        return f"cuDNN attention needs fp16/bf16, not {q.dtype}"
    if not (8, 0) <= cap <= (12, 1):
        return f"cuDNN attention needs sm80..sm121, this is sm{cap[0]}{cap[1]}"
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return "cuDNN dropout must be a multiple of 1/16"
    reason = _dense(q, k, v, enable_gqa, gqa=True, ignore_singleton=True,
                    same_v_heads=False)
    if reason:
        return reason
    B, H, L, E = q.shape
    S, Ev = k.size(2), v.size(3)
    if B > 65535 or H > 65535:
        return "cuDNN attention takes at most 65535 batch or heads"
    sm90 = cap == (9, 0) or cap[0] == 10
    d256 = sm90 and not (cap == (10, 7) and version <= 92500) and version > 92200
    limit = 256 if d256 else 192 if sm90 and version >= 91100 and (E, Ev) == (192, 128) else 128
    if E > limit or Ev > limit or E % 8 or Ev % 8:
        return f"cuDNN attention needs head dims divisible by 8, at most {limit}"
    if S == 1 or (dropout_p and L == 1):
        return "cuDNN attention needs more than one key"
    if requires_grad and d256 and not (max(E, Ev) <= 128 or (E, Ev) in ((192, 128), (256, 256))):
        return "cuDNN attention cannot train these head dims"
    return None


def cuda_kernel(q, k, v, target, **call):
    """The kernel CUDA runs for this call on ``target``: 'cudnn', 'flash', 'efficient' or
    'math'. ``call``: attn_mask, dropout_p, is_causal, enable_gqa, requires_grad."""
    for kernel in target.order():
        if why_not(kernel, q, k, v, target, **call) is None:
            return kernel
    raise RuntimeError("no SDPA kernel can run this call (torch: 'No available kernel')")


# ----------------------------------------------------------------------------- what it keeps
def kernel_saves(kernel, q, k, v, attn_mask=None, requires_grad=True):
    """The tensors ``kernel`` makes and keeps for backward (beyond the caller's q, k, v and
    attn_mask, which it keeps as they are); None for math, whose ops save what they save."""
    if kernel == "math":
        return None
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    Ev, f32 = v.shape[-1], torch.float32
    out = Saved("output", (B, H, L, Ev), q.dtype)
    if kernel == "cpu_flash":
        lse = torch.float64 if q.dtype == torch.float64 else f32
        return [out, Saved("log-sum-exp", (B, H, L), lse)]
    if kernel == "efficient":
        saved = [out, Saved("log-sum-exp", (B, H, _ceil(L, 32) if requires_grad else 0), f32),
                 Saved("philox seed", (), torch.int64), Saved("philox offset", (), torch.int64)]
        mask = _efficient_mask(attn_mask, q.dtype)
        return saved + ([Saved("attn_mask (made float or padded)", tuple(mask.shape), mask.dtype)]
                        if mask is not None and mask is not attn_mask else [])
    if kernel == "flash":
        E8 = _ceil(q.shape[-1], 8)
        padded = [Saved(f"{n} (padded to {E8})", (*t.shape[:-1], E8), t.dtype)
                  for n, t in (("q", q), ("k", k), ("v", v))] if E8 != q.shape[-1] else []
        return padded + [Saved("output", (B, H, L, E8), q.dtype),
                         Saved("log-sum-exp", (B, H, L), f32),
                         Saved("rng state", (2,), torch.uint64), Saved("unused", (), torch.uint64)]
    if kernel == "cudnn":
        saved = [out, Saved("log-sum-exp", (B, H, L, 1), f32),
                 Saved("seed", (1,), torch.int64), Saved("offset", (1,), torch.int64)]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            saved.append(Saved("attn_mask (float)", tuple(attn_mask.shape), q.dtype))
        return saved
    raise ValueError(f"kernel={kernel!r}: pass one of {('cpu_flash',) + KERNELS}")


def saved_bytes(kernel, q, k, v, **kwargs):
    """Bytes of `kernel_saves` (None for math)."""
    saved = kernel_saves(kernel, q, k, v, **kwargs)
    return None if saved is None else sum(s.nbytes for s in saved)


def _efficient_mask(mask, dtype):
    """The mask the efficient kernel keeps: a boolean one made float (``where``), then, when
    its strides are not multiples of 8 elements, padded by 8 - S % 8 keys and sliced back
    (``preprocess_mask``); a meta tensor of that storage, or the caller's mask itself."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.empty(mask.shape, dtype=dtype, device="meta")
    if all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1:
        return mask
    S = mask.shape[-1]
    return torch.empty((*mask.shape[:-1], S + 8 - S % 8), dtype=mask.dtype, device="meta")


# ----------------------------------------------------------------------------- the stand-in
_SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)


class on_cuda(TorchFunctionMode):
    """While active (around a trace), each SDPA call runs the kernel CUDA would pick on
    ``target`` and saves what that kernel saves; math runs as torch's math composite."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.kernels = []  # the kernel of each call, in order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return _backward_within(self, *args, **kwargs)
        if func is not _SDPA:
            return func(*args, **kwargs)
        call = {**_DEFAULTS, **dict(zip(_NAMES, args)), **kwargs}
        # under autocast SDPA runs in its lower precision: every floating input is cast
        q, k, v, call["attn_mask"] = (_autocast(call[n]) for n in _NAMES[:4])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        kernel = cuda_kernel(q, k, v, self.target, attn_mask=call["attn_mask"],
                             dropout_p=call["dropout_p"], is_causal=call["is_causal"],
                             enable_gqa=call["enable_gqa"], requires_grad=grad)
        self.kernels.append(kernel)
        if kernel == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        rest = {n: call[n] for n in _NAMES[3:]}
        return _StandIn.apply(q, k, v, kernel, rest)


def _backward_within(mode, tensor, gradient=None, retain_graph=None, create_graph=False,
                     inputs=None):
    """``tensor.backward()`` with ``mode`` on. A mode is off while its handler runs, so a
    backward run from the handler would recompute a checkpointed region with CPU attention,
    which saves other tensors than its forward did (torch's checkpoint then refuses). So the
    backward's engine is called here as ``torch.autograd.backward`` calls it
    (``torch.autograd.graph._engine_run_backward``, private), with the mode pushed again."""
    from torch.autograd.graph import _engine_run_backward

    grad = torch.ones_like(tensor) if gradient is None else gradient
    with mode:
        _engine_run_backward((tensor,), (grad,), create_graph if retain_graph is None else
                             retain_graph, create_graph, tuple(inputs or ()),
                             allow_unreachable=True, accumulate_grad=True)


def _autocast(t):
    """The dtype SDPA runs in under autocast (it is on autocast's lower-precision list)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and \
            torch.is_autocast_enabled(t.device.type):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


def _out_like(kernel, q, Ev):
    """An empty output laid out as the CUDA kernel lays it out (the model's next reshape is a
    view or a copy depending on it)."""
    B, H, L = q.shape[:3]
    if kernel == "efficient":  # (B, L, H, Ev), handed back transposed
        return torch.empty(B, L, H, Ev, dtype=q.dtype, device=q.device).transpose(1, 2)
    if kernel == "flash":  # empty_like(q) in (B, L, H, E) order
        return torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
    order = sorted(range(4), key=lambda d: q.stride(d))  # cuDNN: q's stride order
    strides, step = [0] * 4, 1
    for d in order:
        strides[d], step = step, step * (B, H, L, Ev)[d]
    return torch.empty_strided((B, H, L, Ev), strides, dtype=q.dtype, device=q.device)


class _StandIn(torch.autograd.Function):
    """One SDPA call as the CUDA ``kernel`` runs it: the values from torch's own SDPA, the
    output laid out and the tensors kept for backward as that kernel makes them."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, call):
        # the range names the CUDA kernel for a step's op trace (`optrace.SDPA_RANGE`)
        with torch.profiler.record_function(f"ddpkit.sdpa:{kernel}:forward"):
            return _StandIn._forward(ctx, q, k, v, kernel, call)

    @staticmethod
    def _forward(ctx, q, k, v, kernel, call):
        mask, E, Ev = call["attn_mask"], q.shape[-1], v.shape[-1]
        inputs = (q, k, v)
        if kernel == "flash" and E % 8:  # padded in attention.cpp, before the kernel
            inputs = tuple(F.pad(t, (0, _ceil(E, 8) - E)) for t in inputs)
        with torch.autocast(q.device.type, enabled=False):
            with torch._C.DisableTorchFunction():  # torch's own SDPA, not this mode's again
                value = _SDPA(q, k, v, **call)
        out = _out_like(kernel, inputs[0], inputs[2].shape[-1])
        out[..., :Ev].copy_(value)
        made = {"output": out, **{f"{n} (padded to {t.shape[-1]})": t
                                  for n, t in zip("qkv", inputs) if t.shape[-1] != E}}
        keep = [*inputs] if len(made) == 1 else []  # the caller's own q, k, v
        for s in kernel_saves(kernel, q, k, v, attn_mask=mask):
            keep.append(made.get(s.name) if s.name in made else
                        torch.empty(s.shape, dtype=s.dtype, device=q.device))
        if mask is not None and not any(s.name.startswith("attn_mask") for s in
                                        kernel_saves(kernel, q, k, v, attn_mask=mask)):
            keep.append(mask)  # kept as the caller made it
        ctx.save_for_backward(*keep)
        ctx.call, ctx.dims, ctx.kernel = call, (E, E, Ev), kernel
        return out if out.shape[-1] == Ev else out[..., :Ev]

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t[..., :n] for t, n in zip(ctx.saved_tensors[:3], ctx.dims))
        # torch's CPU backward needs its own forward run again first; the CUDA kernel's
        # backward does not (the range tells a step's op trace which op is the backward)
        with torch.profiler.record_function(f"ddpkit.sdpa:{ctx.kernel}:backward"):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                with torch._C.DisableTorchFunction():
                    value = _SDPA(*leaves, **ctx.call)
            return (*torch.autograd.grad(value, leaves, grad), None, None)


def run_target(world_size, backend=None, device=None):
    """The GPU rank 0 of such a run computes attention on (a `CudaTarget`), or None when its
    ranks run on CPU. Under torchrun or srun, the choice of this machine's own ranks."""
    here = devices.local_world_size(world_size) if devices.under_torchrun() else world_size
    if devices.resolve_devices(here, backend, device)[1] != "cuda":
        return None
    return CudaTarget.of_gpu(devices.cuda_gpus()[0])
