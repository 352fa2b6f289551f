"""The process group of one rank: joined at start-up, retimed between a pool's jobs, destroyed at
the end. Its sockets listen on the run's ``host`` only (loopback by default)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from .. import devices


def _interface_of(host):
    """The name of this machine's network interface that holds ``host``'s address, or None
    (a wildcard such as 0.0.0.0 is on no interface)."""
    import socket

    import psutil

    wanted = {info[4][0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addrs):  # "fe80::1%eth0": drop the scope
            return name
    return None


def listen_on(host):
    """Make this rank's own sockets listen on ``host``'s interface only.

    Left alone, gloo binds the address this machine's *hostname* resolves to (torch's
    ``ProcessGroupGloo::createDefaultDevice``; loopback only as a fallback), which on most servers
    is a LAN address. ``GLOO_SOCKET_IFNAME`` is what torch reads instead when it creates the gloo
    device (``ProcessGroupGloo::Options::create_default``), and ``NCCL_SOCKET_IFNAME`` does the same
    for NCCL's bootstrap. Set in this rank process only, before the group exists; a value the user
    exported for other jobs does not open a ddpkit run to the network (``host=`` is the switch).
    """
    name = _interface_of(host)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name


def init_group(rank, world_size, backend, host, port, timeout_s, device=None):
    """Join the kernel's TCPStore and bring the process group up, listening on ``host`` only."""
    listen_on(host)
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    start_group(backend, device, store=store, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s))


def start_group(backend, device, **kwargs):
    """``init_process_group`` for a rank on ``device``, spawned or under torchrun.

    NCCL ranks pass ``device_id``: barriers then know their GPU (without it, every
    ``dist.barrier()`` warns "using the device under current context", distributed_c10d.py
    ``barrier``), and NCCL connects during start-up (``eager_connect_single_device``), so an NCCL
    hang shows as a start-up stall rather than in the first collective.
    """
    bound = device if backend == "nccl" else None
    dist.init_process_group(devices.group_backend(backend), device_id=bound, **kwargs)


def set_collective_timeout(seconds):
    """Change the group's collective timeout (gloo's, and NCCL's watchdog) for the next job."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def destroy_group():
    if dist.is_initialized():
        dist.destroy_process_group()
