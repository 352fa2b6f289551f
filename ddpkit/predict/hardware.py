"""Named hardware: each GPU's published peaks, the share of them its kernels reach, the host's
cost of issuing them, and the links between GPUs; every figure with where it comes from.

A named device's rank is simulated as the CUDA rank it is (`target`: the compute capability
torch's kernel choices read) and its step played with CUDA's semantics (`gpuplay`): the host
issues each op (`HOST`), the GPU runs it for ``max(FLOPs / (peak x GEMM share), bytes /
(bandwidth x memory share))`` plus a kernel's fixed cost (`KERNEL_S`), attention at its
kernel's share (`EFFICIENCY`). Collectives follow NCCL's ring (`Machine.collective_s`): an
all-reduce of B bytes over N ranks moves ``2(N-1)/N x B`` through each rank at the link's
*bus bandwidth* (nccl-tests' ``busbw``, which is what the ring's slowest hop sustains), plus a
latency per ring step; a ring spanning nodes runs as fast as its slower part: the node's
NVLink, or the nodes' cards, which carry ``GPUs per node x card bandwidth`` between two nodes
(one card per GPU, each ring channel through its own card).

Figures marked *assumption* are this module's, stated so that they can be argued with;
`sources()` lists every figure with its source. ``bench/gpu_step_time.py`` (run by
``bench/gpu_check.sh``) sets these predictions beside a measured step the day a GPU is lent;
README "Step time on named hardware" sets them beside published throughput.
"""
from __future__ import annotations

import dataclasses
import re

from .attention import CudaTarget
from .gpus import NAMED_CUDA, NAMED_CUDNN
from .machine import Machine

TB, GB = 1e12, 1e9
H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (SXM5; dense: the sparsity figures halved)"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (SXM; dense)"
A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (SXM4; dense)"


@dataclasses.dataclass(frozen=True)
class Device:
    """One GPU: dense peaks in FLOP/s (``bf16``: its 16-bit tensor cores; ``fp32``: plain fp32,
    what torch's fp32 matmuls run on unless TF32 is allowed), memory bandwidth in bytes/s,
    compute capability, GPUs per node and the link between them (a `LINKS` name), the
    architecture its efficiency factors are for, and the source of the figures. Make your own
    with ``dataclasses.replace(DEVICES["H100-80GB"], bandwidth=2.4e12, ...)`` and pass it as
    ``step_time(device=...)``."""
    name: str
    bf16: float
    fp32: float
    bandwidth: float
    capability: tuple
    node: int
    nvlink: str
    arch: str
    source: str


DEVICES = {d.name: d for d in (
    Device("H100-80GB", 989.4 * TB, 66.9 * TB, 3.35 * TB, (9, 0), 8, "NVLink4", "hopper",
           H100_SHEET + ": BF16 1,979 TFLOPS with sparsity, FP32 67 TFLOPS, 3.35 TB/s HBM3"),
    Device("H200-141GB", 989.4 * TB, 66.9 * TB, 4.8 * TB, (9, 0), 8, "NVLink4", "hopper",
           H200_SHEET + ": BF16 1,979 TFLOPS with sparsity, FP32 67 TFLOPS, 4.8 TB/s HBM3e"),
    Device("A100-80GB", 312 * TB, 19.5 * TB, 2.039 * TB, (8, 0), 8, "NVLink3", "ampere",
           A100_SHEET + ": BF16 312 TFLOPS, FP32 19.5 TFLOPS, 2,039 GB/s HBM2e"),
    Device("A100-40GB", 312 * TB, 19.5 * TB, 1.555 * TB, (8, 0), 8, "NVLink3", "ampere",
           A100_SHEET + ": BF16 312 TFLOPS, FP32 19.5 TFLOPS, 1,555 GB/s HBM2"),
    Device("V100-32GB", 15.7 * TB, 15.7 * TB, 0.9 * TB, (7, 0), 8, "NVLink2", "volta",
           "NVIDIA V100 datasheet (SXM2): FP32 15.7 TFLOPS, 900 GB/s HBM2; no bf16 tensor "
           "cores (its 125 TFLOPS are fp16): bf16 at the fp32 rate is an assumption"),
    Device("L4", 121 * TB, 30.3 * TB, 0.3 * TB, (8, 9), 8, "PCIe4", "ada",
           "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity, FP32 30.3 TFLOPS, 300 GB/s"),
    Device("T4", 8.1 * TB, 8.1 * TB, 0.32 * TB, (7, 5), 8, "PCIe3", "turing",
           "NVIDIA T4 datasheet: FP32 8.1 TFLOPS, 320 GB/s; no bf16 tensor cores (its 65 "
           "TFLOPS are fp16): bf16 at the fp32 rate is an assumption"),
)}
ALIASES = {"H100": "H100-80GB", "H200": "H200-141GB", "A100": "A100-80GB", "V100": "V100-32GB"}

FA2 = ("FlashAttention-2 (Dao, 2023, arXiv:2307.08691) §1/§4: FA2 reaches 50-73% of A100's "
       "peak in forward, and 'optimized GEMM can reach up to 80-90% of the theoretical maximum'")
FA3 = ("FlashAttention-3 (Shah et al., 2024, arXiv:2407.08608) §1: 'FlashAttention-2 achieves "
       "only 35% utilization on the H100'")
EFFICIENCY = {
    # arch: (matmul, attention forward, attention backward, memory), each a share of the peak
    "ampere": (0.80, 0.65, 0.50, 0.85),
    "hopper": (0.75, 0.35, 0.30, 0.85),
    "ada": (0.75, 0.50, 0.40, 0.85),
    "volta": (0.80, 0.50, 0.40, 0.85),
    "turing": (0.80, 0.50, 0.40, 0.85),
}
"""Shares of a device's peaks its kernels reach at LLM sizes (matrix products of 1024+ per
side, attention at head dim 64-128 and sequences of 1k+): a causal attention kernel's share is
of the FLOPs it does (half of what torch's formula counts). Ampere: GEMM 80% (the low end of
FA2's 80-90%), flash attention forward 65% and backward 50% (FA2's Figure 5-6 at head dim
128, causal: 60-70% and 45-55%). Hopper: FA2, which is torch's flash kernel, at 35% (FA3) and
its backward at 30% (*assumption*: below forward as on A100); cuBLAS bf16 GEMM at 75%
(*assumption*: Hopper's dense tensor cores are harder to keep fed than Ampere's, as FA3's
paper argues for attention). Memory-bound kernels at 85% of peak bandwidth (*assumption*: a
STREAM-like elementwise kernel's share on HBM). Ada, Volta, Turing: *assumptions*."""
EFFICIENCY_SOURCES = {"ampere": FA2, "hopper": FA3 + "; " + FA2}
K_HALF = 128
"""A matrix product's share of its peak share falls with its inner dimension k as ``k / (k +
K_HALF)`` (*assumption*: each output tile's prologue and epilogue cost about 128 k-steps'
worth; 98% at k = 8192, 86% at GPT-2's 768)."""
REDUCTIONS = {name: 0.75 for name in (
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
    "_fused_rms_norm_backward", "mean", "sum", "embedding_dense_backward")}
"""Row reductions (softmax, the norms, sums over rows) run at 75% of an elementwise kernel's
bandwidth (*assumption*: two passes over each row, a reduction between them)."""
NCCL_SM_SHARE = 0.1
"""While a collective runs, compute beside it is slowed by this share (*assumption*: NCCL's
kernels take their channels' SMs, 16-32 CTAs of an H100's 132, and memory bandwidth)."""
KERNEL_S = 3e-6
"""A kernel's fixed cost on the device, seconds (*assumption*: a launch's latency plus a
small kernel's ramp, 2-5 us on recent GPUs and drivers)."""
HOST = dict(forward=12e-6, forward_view=4e-6, backward=6e-6, backward_view=2e-6,
            optimizer=15e-6, optimizer_view=2e-6, other=12e-6, other_view=4e-6)
"""Seconds the host spends issuing one op in eager PyTorch: a forward op goes through Python,
the dispatcher and autograd's recording before its launch ("~5-25 us of CPU-side work per
op", J. Lin, *From PyTorch op to kernel launch*, jiahuanglin.xyz: 12 us taken); backward ops
are issued by autograd's C++ engine (6 us, *assumption*); a foreach optimizer op launches
several kernels over its tensor lists (15 us, *assumption*); a view launches nothing (the
dispatcher only: *assumption*). Measured, not assumed, where a GPU is calibrated
(`calibrate`)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's NCCL bus bandwidth (bytes/s each GPU sustains in a ring: nccl-tests' busbw;
    ``allreduce``: all-reduce's where NVLink SHARP lifts it), its latency per ring step, and
    the source."""
    name: str
    bus: float
    latency: float
    source: str
    allreduce: float | None = None


NCCL_TESTS = ("nccl-tests all_reduce_perf busbw at large sizes, 'NCCL-tests in practice', "
              "Alaya NeW (docs.alayanew.com, 2026)")
LINKS = {k.name: k for k in (
    Link("NVLink4", 360 * GB, 1e-6, NCCL_TESTS + ": 8xH100 SXM5 460-480 GB/s for all-reduce "
         "(NVLink SHARP); all-gather and reduce-scatter rings at 360 GB/s, 80% of NVLink4's "
         "450 GB/s each way, are an *assumption*", allreduce=460 * GB),
    Link("NVLink3", 230 * GB, 1e-6, NCCL_TESTS + ": 8xA100 SXM4 230-250 GB/s"),
    Link("NVLink2", 130 * GB, 2e-6, "*assumption*: 300 GB/s NVLink2 (V100 SXM2) in a hybrid "
         "cube mesh, about 130 GB/s bus bandwidth"),
    Link("PCIe4", 20 * GB, 5e-6, "*assumption*: PCIe 4.0 x16 (32 GB/s) through the host, "
         "about 20 GB/s bus bandwidth"),
    Link("PCIe3", 10 * GB, 5e-6, "*assumption*: PCIe 3.0 x16 (16 GB/s), about 10 GB/s"),
    Link("NDR", 45 * GB, 5e-6, "InfiniBand NDR, 400 Gbit/s per GPU at 90% of line rate "
         "(*assumption*); 8 per node give the 400-450 GB/s busbw of 'Validating Multi-Node GPU "
         "Clusters with NCCL Tests', Saturn Cloud, for H100 SXM with IB NDR"),
    Link("HDR", 22.5 * GB, 5e-6, "InfiniBand HDR, 200 Gbit/s per GPU at 90% (*assumption*)"),
    Link("EDR", 11.25 * GB, 5e-6, "InfiniBand EDR, 100 Gbit/s per GPU at 90% (*assumption*)"),
)}
NIC_SHARE, NIC_LATENCY = 0.9, 5e-6
"""A network card given as Gbit/s: 90% of its line rate, 5 us a ring step (*assumptions*)."""


def device_name(device):
    """The `DEVICES` key for a name or alias; a clear error naming the choices otherwise."""
    name = ALIASES.get(device, device)
    if name not in DEVICES and isinstance(device, str) and device_for(device) is not None:
        name = device_for(device).name  # as torch names it: 'NVIDIA H100 80GB HBM3'
    if name not in DEVICES:
        raise ValueError(f"step_time(device={device!r}): not a device ddpkit knows; pass one of "
                         f"{', '.join([*DEVICES, *ALIASES])}, a hardware.Device, or None for "
                         f"this machine")
    return name


def device_of(device):
    """A `Device` from a name, an alias or a `Device`."""
    return device if isinstance(device, Device) else DEVICES[device_name(device)]


def device_for(gpu):
    """The catalogue's `Device` for a GPU as torch names it (``torch.cuda.get_device_name``:
    'NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB', 'Tesla T4'), or None: the catalogue's
    data-center cards are the SXM ones (a PCIe H100 or A100 has other peaks)."""
    text = gpu.upper()
    for model in ("H200", "H100", "A100", "V100", "L4", "T4"):
        if not re.search(rf"\b{model}\b|{model}[-_ ]", text + " "):
            continue
        if "PCIE" in text and model not in ("L4", "T4"):
            return None
        sizes = [d for name, d in DEVICES.items() if name.split("-")[0] == model]
        memory = re.search(r"(\d+)\s*GB", text)
        exact = [d for d in sizes if memory and d.name.endswith(f"-{memory.group(1)}GB")]
        return (exact or sizes or [None])[0]
    return None


def target(device):
    """The `attention.CudaTarget` a named device's ranks run on: its compute capability, with
    torch's default kernels switched on and the software `gpus.NAMED_CUDNN`/`NAMED_CUDA` (the
    same target `fits` simulates a card's rank on)."""
    return CudaTarget(tuple(device_of(device).capability), cudnn=NAMED_CUDNN, cuda=NAMED_CUDA)


def link_gbps(link):
    """Gbit/s of a link named like '400Gbps' / '100 Gbit/s' (a network card's line rate)."""
    text = str(link).lower().replace(" ", "").replace("gbit/s", "gbps").replace("gb/s", "gbps")
    if text.endswith("gbps"):
        try:
            value = float(text[:-4])
            if value > 0:
                return value
        except ValueError:
            pass
    raise ValueError(f"link={link!r}: pass a number of Gbit/s per GPU (400), '400Gbps', or one "
                     f"of {', '.join(LINKS)}")


def network(link):
    """(bus bytes/s, latency) of the network between nodes named by ``link``."""
    if isinstance(link, Link):
        return link.bus, link.latency
    if isinstance(link, str) and link in LINKS:
        return LINKS[link].bus, LINKS[link].latency
    if isinstance(link, bool) or not isinstance(link, (int, float, str)):
        raise ValueError(f"link={link!r}: pass a number of Gbit/s per GPU (400), '400Gbps', or "
                         f"one of {', '.join(LINKS)}")
    gbps = float(link) if isinstance(link, (int, float)) else link_gbps(link)
    if gbps <= 0:
        raise ValueError(f"link={link!r}: Gbit/s must be above 0")
    return gbps / 8 * GB * NIC_SHARE, NIC_LATENCY


def machine(device):
    """The `Machine` of a named device: its roofline, its host, its node's NVLink."""
    d = device_of(device)
    matmul, fwd, bwd, mem = EFFICIENCY[d.arch]
    inside = LINKS[d.nvlink]
    rates = {dt: peak for dt, peak in (("bfloat16", d.bf16), ("float16", d.bf16),
                                       ("float32", d.fp32))}
    return Machine(d.name, kind="roofline",
                   gemm={dt: {"roofline": p * matmul, "k_half": K_HALF}
                         for dt, p in rates.items()},
                   attention={dt: {"roofline": p * fwd, "roofline_forward": p * fwd,
                                   "roofline_backward": p * bwd} for dt, p in rates.items()},
                   memory={"bandwidth": d.bandwidth * mem, "ops": dict(REDUCTIONS)},
                   kernel_s=KERNEL_S, overhead=dict(HOST), comm_cpu_share=NCCL_SM_SHARE,
                   collectives={"link": [inside.bus, inside.latency], "node": d.node,
                                "link_allreduce": inside.allreduce or inside.bus},
                   peak_flops={"bfloat16": d.bf16, "float16": d.bf16, "float32": d.fp32},
                   notes=[f"{d.name}: a roofline from its published peaks at {matmul:.0%} "
                          f"(matrix products), {fwd:.0%}/{bwd:.0%} (attention forward/"
                          f"backward) and {mem:.0%} (memory) of them; {d.nvlink} inside a node"])


def with_link(machine, link, world_size):
    """``machine`` with ``link`` as the network between its nodes. A job on more GPUs than one
    node holds needs one: the error says so."""
    if machine.kind != "roofline":
        return machine
    out = dataclasses.replace(machine, collectives=dict(machine.collectives))
    per_node = out.collectives.get("node", world_size)
    if link is not None:
        out.collectives["network"] = list(network(link))
    elif world_size > per_node:
        raise ValueError(f"step_time: world_size={world_size} spans {-(-world_size // per_node)} "
                         f"nodes of {per_node} {machine.name}s; name the network between them: "
                         f"link='400Gbps' (Gbit/s per GPU) or one of {', '.join(LINKS)}")
    return out


def sources():
    """Every figure of the catalogue with its source: rows (what, value, unit, source)."""
    rows = []
    for d in DEVICES.values():
        rows += [(f"{d.name} bf16 peak", d.bf16, "FLOP/s", d.source),
                 (f"{d.name} fp32 peak", d.fp32, "FLOP/s", d.source),
                 (f"{d.name} memory bandwidth", d.bandwidth, "bytes/s", d.source)]
    for arch, shares in EFFICIENCY.items():
        src = EFFICIENCY_SOURCES.get(arch, "*assumption*")
        for what, share in zip(("matmul", "attention forward", "attention backward", "memory"),
                               shares):
            rows.append((f"{arch} {what} share", share, "of peak", src))
    for k in LINKS.values():
        rows.append((f"{k.name} bus bandwidth", k.bus, "bytes/s", k.source))
        rows.append((f"{k.name} latency per ring step", k.latency, "s", k.source))
    rows.append(("kernel fixed cost", KERNEL_S, "s", "*assumption*"))
    rows.append(("GEMM inner-dimension ramp k_half", K_HALF, "k", "*assumption*"))
    rows.append(("compute slowed beside a collective", NCCL_SM_SHARE, "share", "*assumption*"))
    rows.append(("row reductions' share of memory bandwidth", 0.75, "of elementwise",
                 "*assumption*"))
    rows += [(f"host per {phase} op", s, "s", HOST_SOURCE) for phase, s in HOST.items()]
    return rows


HOST_SOURCE = ("J. Lin, 'From PyTorch op to kernel launch' (jiahuanglin.xyz): ~5-25 us of "
               "CPU-side work per eager op; the per-phase split is an *assumption*")
