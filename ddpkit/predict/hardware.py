"""Named hardware: a roofline per device from its published peaks, and links between devices.

A named device's op takes ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x
efficiency))`` plus a kernel's fixed cost, and never less than the host's time to issue it
(PyTorch eager dispatches each op from Python: a small model is bound by that, not the GPU).
Collectives follow the alpha-beta model of a ring: an all-reduce of B bytes over N ranks sends
2(N-1)/N x B through each rank's link in 2(N-1) steps of latency alpha; inside a node the link
is NVLink (NCCL's bus bandwidth), between nodes each GPU's network card; a job spanning nodes
runs the hierarchical form (reduce-scatter inside the node, an all-reduce of 1/G of the bytes
between nodes, an all-gather inside).

The figures and their sources are in `DEVICES` and `LINKS`; the efficiency factors are stated
there too, with where each comes from.
"""
from __future__ import annotations

import dataclasses

from .machine import Machine

TB, GB = 1e12, 1e9

DEVICES = {
    # name: bf16 dense FLOP/s, fp32 FLOP/s (TF32 tensor cores where torch uses them by default:
    # no, fp32 matmuls are plain fp32 unless allow_tf32), memory bytes/s, GPUs per node, the
    # node's NVLink generation. Sources: NVIDIA's data sheets (H100 SXM5: 989.4 TFLOP/s bf16
    # dense, 66.9 fp32, 3.35 TB/s; H200 SXM: 989.4, 66.9, 4.8 TB/s; A100 SXM4 80GB: 312, 19.5,
    # 2.039 TB/s; A100 40GB: 312, 19.5, 1.555 TB/s; V100 SXM2: 125 (fp16), 15.7, 0.9 TB/s;
    # L4: 121 (bf16 dense), 30.3, 0.3 TB/s; T4: 65 (fp16), 8.1, 0.32 TB/s).
    "H100-80GB": dict(bf16=989.4 * TB, fp32=66.9 * TB, bandwidth=3.35 * TB, node=8,
                      nvlink="NVLink4"),
    "H200-141GB": dict(bf16=989.4 * TB, fp32=66.9 * TB, bandwidth=4.8 * TB, node=8,
                       nvlink="NVLink4"),
    "A100-80GB": dict(bf16=312 * TB, fp32=19.5 * TB, bandwidth=2.039 * TB, node=8,
                      nvlink="NVLink3"),
    "A100-40GB": dict(bf16=312 * TB, fp32=19.5 * TB, bandwidth=1.555 * TB, node=8,
                      nvlink="NVLink3"),
    "V100-32GB": dict(bf16=125 * TB, fp32=15.7 * TB, bandwidth=0.9 * TB, node=8,
                      nvlink="NVLink2"),
    "L4": dict(bf16=121 * TB, fp32=30.3 * TB, bandwidth=0.3 * TB, node=8, nvlink="PCIe4"),
    "T4": dict(bf16=65 * TB, fp32=8.1 * TB, bandwidth=0.32 * TB, node=8, nvlink="PCIe3"),
}
ALIASES = {"H100": "H100-80GB", "H200": "H200-141GB", "A100": "A100-80GB", "V100": "V100-32GB"}

EFFICIENCY = dict(matmul=0.70, attention=0.50, memory=0.80)
"""Shares of a device's peak that its kernels reach on large shapes: cuBLAS's bf16 GEMMs run at
about 70% of an H100's dense peak at LLM sizes; FlashAttention-2 at 50-73% forward and
35-50% backward on A100 (Dao, 2023); streaming kernels at about 80% of peak bandwidth."""
KERNEL_S = 4e-6
"""A kernel's fixed cost on the device (launch and ramp), seconds."""
HOST_S = dict(forward=12e-6, backward=5e-6, optimizer=4e-6, other=12e-6)
"""The host's seconds to issue one op in eager PyTorch (Python, the dispatcher, autograd's
recording in forward; autograd's C++ engine in backward; a fused or foreach optimizer's
per-tensor-list op): a step is never faster than issuing its ops."""

LINKS = {
    # name: (bytes/s each way per GPU, latency seconds). NCCL bus bandwidth, not the wire's:
    # NVLink4 (H100 SXM, 900 GB/s bidirectional: 450 each way; nccl-tests all-reduce reaches
    # about 360-380 GB/s bus bandwidth on 8 GPUs); NVLink3 (A100, 600 GB/s: about 230 GB/s);
    # PCIe (about 20 GB/s); a network card of N Gbit/s at about 90% of its line rate.
    "NVLink4": (370 * GB, 5e-6), "NVLink3": (230 * GB, 5e-6), "NVLink2": (130 * GB, 5e-6),
    "PCIe4": (20 * GB, 10e-6), "PCIe3": (10 * GB, 10e-6),
}


def device_name(device):
    name = ALIASES.get(device, device)
    if name not in DEVICES:
        raise ValueError(f"step_time(device={device!r}): not a device ddpkit knows; pass one of "
                         f"{', '.join([*DEVICES, *ALIASES])}, or None for this machine")
    return name


def link_gbps(link):
    """Gbit/s of a link named like '400Gbps' / '100 Gbit/s' (a network card's line rate)."""
    text = str(link).lower().replace(" ", "").replace("gbit/s", "gbps")
    if text.endswith("gbps"):
        try:
            return float(text[:-4])
        except ValueError:
            pass
    raise ValueError(f"link={link!r}: pass a number of Gbit/s, '400Gbps', or one of "
                     f"{', '.join(LINKS)}")


def machine(device):
    """The `Machine` of a named device: its roofline, its node's NVLink for collectives."""
    name = device_name(device)
    spec = DEVICES[name]
    return Machine(name, kind="roofline",
                   gemm={"bfloat16": {"roofline": spec["bf16"] * EFFICIENCY["matmul"]},
                         "float32": {"roofline": spec["fp32"] * EFFICIENCY["matmul"]}},
                   attention={"bfloat16": {"roofline": spec["bf16"] * EFFICIENCY["attention"]},
                              "float32": {"roofline": spec["fp32"] * EFFICIENCY["attention"]}},
                   memory={"bandwidth": spec["bandwidth"] * EFFICIENCY["memory"]},
                   kernel_s=KERNEL_S,
                   overhead=dict(HOST_S),
                   collectives={"link": list(LINKS[spec["nvlink"]]), "node": spec["node"]},
                   peak_flops={"bfloat16": spec["bf16"], "float32": spec["fp32"]},
                   notes=[f"{name}: a roofline from its published peaks at "
                          f"{EFFICIENCY['matmul']:.0%} (matrix products), "
                          f"{EFFICIENCY['attention']:.0%} (attention) and "
                          f"{EFFICIENCY['memory']:.0%} (memory) of them"])


def with_link(machine, link, world_size):
    """``machine`` with ``link`` between its nodes (None: one node's NVLink only)."""
    if machine.kind != "roofline":
        return machine
    out = dataclasses.replace(machine, collectives=dict(machine.collectives))
    if link is not None:
        if isinstance(link, str) and link in LINKS:
            out.collectives["network"] = list(LINKS[link])
        else:
            gbps = float(link) if isinstance(link, (int, float)) else link_gbps(link)
            out.collectives["network"] = [gbps / 8 * GB * 0.9, 10e-6]
    return out
