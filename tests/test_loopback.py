"""Nothing a run opens can be reached from another machine: during real 2-rank runs (launch, Pool,
Lab) every listening TCP socket of the kernel and of its ranks is on a loopback address, unless
``host=`` asks for another one."""
import ipaddress
import os
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.runtime.pool import shared_pool
from procs import rank_children


def hold(ctx, flag):
    """Bring the group up, say so, then stay until the test has looked at the sockets."""
    dist.all_reduce(torch.ones(1))  # every rank has connected: all its sockets exist now
    ctx.log(step=0)
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(flag)


def listening(pid):
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def sockets_now():
    """{pid: listening (ip, port)} for this process (the kernel) and each rank process, less
    the kernel's shared warm pools (their stores and ranks: other tests' runs, on loopback)."""
    from ddpkit.runtime import pool as shared

    warm = {p._group.port for p in list(shared._SHARED.values()) if p._group is not None}
    seen = {pid: listening(pid) for pid in [os.getpid()] + [p.pid for p in rank_children()]}
    seen[os.getpid()] = {(ip, port) for ip, port in seen[os.getpid()] if port not in warm}
    return seen


def is_loopback(ip):
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def lan_interface():
    """(name, IPv4 address) of an interface of this machine that is not loopback, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return name, a.address
    return None


@pytest.fixture(autouse=True)
def gloo_off_loopback(monkeypatch):
    """Left alone, gloo listens on the address the machine's hostname resolves to: a LAN address
    on most servers, but 127.0.0.1 on machines whose /etc/hosts maps the hostname there (this
    test machine's does). Pointing GLOO_SOCKET_IFNAME at a real LAN interface in the kernel, which
    the ranks inherit, puts gloo where such a server's hostname would, so these tests fail if
    ddpkit leaves gloo's choice alone (they did before ranks set the interface themselves)."""
    lan = lan_interface()
    if lan is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", lan[0])


def check_all_on_loopback(seen, store_port, ranks):
    assert store_port in {port for _, port in seen[os.getpid()]}, seen  # the store was seen
    assert len(seen) == 1 + ranks and all(seen[pid] for pid in seen), seen  # and each rank's gloo
    exposed = {pid: s for pid, s in seen.items() if not all(is_loopback(ip) for ip, _ in s)}
    assert exposed == {}, f"listening beyond loopback: {exposed}"


def wait_for_records(records, n=1, timeout=60):
    deadline = time.monotonic() + timeout
    while len(records) < n:
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.01)


def sockets_during(handle, flag):
    """The listening sockets while both ranks hold, then the run's result."""
    try:
        wait_for_records(handle.metrics, 2)
        seen = sockets_now()
    finally:
        open(flag, "w").close()
    return seen, handle.wait(timeout=60)


def test_launch_listens_on_loopback_only(tmp_path):
    flag = str(tmp_path / "seen")
    seen, res = sockets_during(ddpkit.launch(hold, flag, world_size=2, block=False), flag)
    assert res.returns == [True, True]
    check_all_on_loopback(seen, res.port, 2)


def test_pool_listens_on_loopback_only(tmp_path):
    flag = str(tmp_path / "seen")
    with ddpkit.Pool(world_size=2) as pool:
        seen, res = sockets_during(pool.launch(hold, flag, block=False), flag)
    assert res.returns == [True, True]
    check_all_on_loopback(seen, res.port, 2)


def test_lab_listens_on_loopback_only():
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=2, width=16, world_size=2, steps=400,
                             measure=False)
    with ddpkit.Lab(cfg) as lab:
        lab.run()
        wait_for_records(lab.metrics, 2)
        # the lab runs on the kernel's shared pool: its ranks, not the test's own children
        pool = shared_pool(cfg.world_size, cfg.backend, cfg.device)
        seen = {pid: listening(pid) for pid in [os.getpid()] + pool.pids}
        port = pool._group.port
        lab.stop()
    check_all_on_loopback(seen, port, 2)


def test_host_puts_every_socket_on_that_address(tmp_path):
    lan = lan_interface()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    flag = str(tmp_path / "seen")
    earlier = listening(os.getpid())  # another test's listener in this process is not this run's
    handle = ddpkit.launch(hold, flag, world_size=2, block=False, host=lan[1])
    try:
        wait_for_records(handle.metrics, 2)
        seen = sockets_now()
        seen[os.getpid()] -= earlier
    finally:
        open(flag, "w").close()
    res = handle.wait(timeout=60)
    assert res.returns == [True, True] and res.port in {p for _, p in seen[os.getpid()]}
    assert {ip for s in seen.values() for ip, _ in s} == {lan[1]}, seen  # no wildcard, no other


def test_a_pool_refuses_a_launch_for_another_host():
    with ddpkit.Pool(world_size=1) as pool:
        with pytest.raises(ValueError, match=r"host='::1' but the pool listens on '127.0.0.1'; "
                                             r"pass host='127.0.0.1' or make a Pool with host='::1'"):
            ddpkit.launch(hold, "x", pool=pool, host="::1")
