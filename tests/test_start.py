"""How ranks start (`ddpkit.runtime.start`): forkserver where no CUDA can exist, else spawn, and
the forkserver's safety argument, each part of it a test: the server is a fresh interpreter that
holds nothing of the kernel, its imports do not initialise CUDA, it has no thread pool to fork;
and its life: it ends when unused after the idle time, at shutdown, and never when not ddpkit's."""
import multiprocessing
import os
import subprocess
import sys
import time
import types

import psutil
import pytest
import torch

import ddpkit
from ddpkit.runtime import start


def parents(ctx):
    return os.getppid()


def test_the_default_is_the_forkserver_only_where_no_cuda_can_exist(monkeypatch):
    monkeypatch.delenv(start.START_ENV, raising=False)
    for name in ("cuda", "hip", "xpu"):
        monkeypatch.setattr(torch.version, name, None, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    assert start.start_method() == "forkserver"
    for name, version in (("cuda", "12.8"), ("hip", "6.3"), ("xpu", "20250101")):
        with monkeypatch.context() as m:
            m.setattr(torch.version, name, version, raising=False)
            assert start.start_method() == "spawn", name
    for platform in ("darwin", "win32"):
        with monkeypatch.context() as m:
            m.setattr(sys, "platform", platform)
            assert start.start_method() == "spawn", platform
    monkeypatch.setenv(start.START_ENV, "spawn")
    assert start.start_method() == "spawn"  # the setting wins
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv(start.START_ENV, "forkserver")
    assert start.start_method() == "forkserver"


def test_a_fork_start_method_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(start.START_ENV, "fork")
    with pytest.raises(ValueError, match=r"DDPKIT_START_METHOD='fork': set it to 'spawn' or "
                                         r"'forkserver', or unset it for this machine's default "
                                         r"\('(spawn|forkserver)'\); 'fork' is refused"):
        ddpkit.launch(parents, world_size=2)


@pytest.fixture
def forkserver(monkeypatch):
    monkeypatch.setenv(start.START_ENV, "forkserver")
    yield
    ddpkit.shutdown()


def test_a_forked_rank_holds_nothing_of_the_kernel(forkserver):
    """The server is exec'd, not forked from the kernel: what the kernel holds (a module only it
    imported, an attribute it set) is not in a rank; a fork of the kernel would carry both."""
    sys.modules["kernel_only_marker"] = types.ModuleType("kernel_only_marker")
    ddpkit._kernel_marker = True
    try:
        def look(ctx):
            import ddpkit
            return "kernel_only_marker" in sys.modules, hasattr(ddpkit, "_kernel_marker")
        assert ddpkit.launch(look, world_size=2).returns == [(False, False)] * 2
        assert ddpkit.launch(look, world_size=2, pool="shared").returns == [(False, False)] * 2
    finally:
        del sys.modules["kernel_only_marker"], ddpkit._kernel_marker
    server = psutil.Process(start.server_pid())
    assert server.ppid() == os.getpid()
    assert "from multiprocessing.forkserver import main" in " ".join(server.cmdline())
    assert server.exe() == psutil.Process().exe()  # a fresh interpreter of the kernel's python


def test_the_preloaded_imports_do_not_initialise_cuda():
    """Whatever the server imports must not touch CUDA: torch.cuda's lazy init raises here if
    anything calls it, and so does asking the driver for its devices (``is_available``,
    ``device_count``: cuInit, without torch's own flag); nothing has made a context after."""
    code = ("import importlib, torch, torch.cuda\n"
            "def refuse(*a, **k): raise AssertionError('the preload initialised CUDA')\n"
            "torch.cuda._lazy_init = torch.cuda.init = refuse\n"
            # cuInit without torch's own flag: is_available() asks the driver for the count
            "torch.cuda.is_available = torch.cuda.device_count = refuse\n"
            "if hasattr(torch._C, '_cuda_getDeviceCount'): torch._C._cuda_getDeviceCount = refuse\n"
            "from ddpkit.runtime.start import PRELOAD\n"
            "for name in PRELOAD: importlib.import_module(name)\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('ok', PRELOAD)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
    assert "torch._dynamo" in out.stdout


def test_the_server_forks_from_a_single_thread(forkserver):
    """A fork copies the forking thread alone: a lock another thread held stays held in the
    child, and a pool of OpenMP threads would be gone. The server has no other thread to lose:
    it runs no tensor operation, so no pool exists (measured: one thread, where a bare
    ``import torch`` here has two for a moment)."""
    ddpkit.launch(parents, world_size=2)
    assert psutil.Process(start.server_pid()).num_threads() == 1


def test_an_unused_server_ends_after_the_idle_time(forkserver, monkeypatch):
    ddpkit.shutdown()
    monkeypatch.setenv(start.IDLE_ENV, "1.5")
    assert set(ddpkit.launch(parents, world_size=2).returns) == {start.server_pid()}
    server = start.server_pid()
    time.sleep(0.8)
    assert psutil.pid_exists(server)  # not before its time: the next launch skips its start
    assert set(ddpkit.launch(parents, world_size=2).returns) == {server}
    deadline = time.monotonic() + 6
    while start.server_pid() is not None or psutil.pid_exists(server):
        assert time.monotonic() < deadline, "the unused forkserver did not end"
        time.sleep(0.1)


def test_a_server_in_use_is_kept_and_shutdown_ends_it(forkserver, monkeypatch):
    monkeypatch.setenv(start.IDLE_ENV, "0.2")
    with ddpkit.Pool(world_size=2) as pool:  # forks of the server, idle but open
        server = start.server_pid()
        ddpkit.launch(parents, world_size=2)
        time.sleep(1.0)
        assert start.server_pid() == server and set(pool.launch(parents).returns) == {server}
    ddpkit.train(ddpkit.TrainConfig(model="mlp", n_blocks=2, width=16, micro_batch=4, steps=1,
                                    world_size=2, backend="gloo", device="cpu"))
    ddpkit.shutdown()
    assert start.server_pid() is None and not any(
        "forkserver" in " ".join(p.cmdline()) for p in psutil.Process().children())


def test_a_process_forked_from_the_kernel_does_not_hold_up_the_servers_end(forkserver):
    """Every process forked from the kernel after the server started holds the server's alive
    pipe (a DataLoader's fork workers, say): the stdlib's way to stop it waits for all of them.
    ddpkit's does not: shutdown returns at once, the server is gone, and the next launch starts a
    new one."""
    import signal

    ddpkit.launch(parents, world_size=2)
    server = start.server_pid()
    child = os.fork()
    if child == 0:  # a worker the kernel forked, still working
        time.sleep(30)
        os._exit(0)
    try:
        t0 = time.monotonic()
        ddpkit.shutdown()
        assert time.monotonic() - t0 < 5, "shutdown waited for a process forked from the kernel"
        assert start.server_pid() is None and not psutil.pid_exists(server)
        assert set(ddpkit.launch(parents, world_size=2).returns) == {start.server_pid()} != {server}
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_server_started_under_other_startup_variables_is_not_used(forkserver, monkeypatch):
    """OMP_NUM_THREADS and the like are read when torch starts: the server's were read at its own
    start. Changed since, the server is started again once unused; while a pool's ranks are its
    forks, new ranks are spawned instead."""
    first = set(ddpkit.launch(parents, world_size=2).returns)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with ddpkit.Pool(world_size=2) as pool:  # the old server is unused: a new one
        second = set(pool.launch(parents).returns)
        assert second != first and not psutil.pid_exists(first.pop())
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set(ddpkit.launch(parents, world_size=2).returns) == {os.getpid()}  # spawned
        assert start.server_pid() in second


def test_a_forkserver_the_kernel_started_itself_is_used_and_left_running(monkeypatch):
    ddpkit.shutdown()
    monkeypatch.setenv(start.START_ENV, "forkserver")
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=os.getpid)  # the kernel's own forkserver (a DataLoader's, say)
    p.start()
    p.join()
    theirs = start.server_pid()
    try:
        assert set(ddpkit.launch(parents, world_size=2).returns) == {theirs}
        ddpkit.shutdown()
        assert start.server_pid() == theirs and psutil.pid_exists(theirs)
    finally:
        multiprocessing.forkserver._forkserver._stop()
