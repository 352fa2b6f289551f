"""Process and port checks shared by the tests (a plain module: `conftest` names clash
between tests/ and notebooks/)."""
import os
import socket

import psutil


def rank_children(shared=False):
    """Child processes of this test process, leaving out multiprocessing's one resource tracker
    (started once per interpreter by the first launch, not per run) and, unless ``shared``, what
    `ddpkit.shutdown` ends: the ranks of the kernel's shared warm pools (`ddpkit.train`'s
    default) and the forkserver (`ddpkit.runtime.start`): they stay between tests by design; the
    session's end checks that `ddpkit.shutdown` ends them."""
    from ddpkit.runtime.pool import shared_pids

    warm = set() if shared else shared_pids()
    me = os.getpid()
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
            # the forkserver outlives a run; the ranks forked from it are its children, and count
            server = not shared and "forkserver" in line and p.ppid() == me
            if "resource_tracker" not in line and not server and p.pid not in warm:
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


def in_tmp(tmp_path):
    """This process's environment with TMPDIR at a test's ``tmp_path``, for a command that
    leaves temporary files behind: torchrun writes its workers' logs to a
    ``tempfile.mkdtemp(prefix="torchelastic_")`` that it never removes."""
    return {**os.environ, "TMPDIR": str(tmp_path)}
