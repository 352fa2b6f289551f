import os
import socket
import time

import psutil
import pytest


def rank_children():
    """Child processes of this test process, leaving out multiprocessing's one resource tracker
    (started once per interpreter by the first spawn, not per run)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must leave no rank process (nor zombie) behind."""
    before = {p.pid for p in rank_children()}
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        left = [p for p in rank_children() if p.pid not in before]
        if not left:
            return
        time.sleep(0.1)
    details = []
    for p in left:
        try:
            details.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    if details:
        pytest.fail("processes left behind: " + "; ".join(details))
