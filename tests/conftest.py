import atexit
import os
import shutil
import tempfile
import time

import psutil
import pytest

from procs import rank_children

# No test sees this machine's calibration (~/.cache/ddpkit): with one there every train() would
# predict its step time beside the run (a simulated step each). A test that wants a prediction
# puts a machine of its own in a folder of its own (tests/test_predicted.py); set before any
# test, so subprocesses (the CLI's, JupyterLab's kernels) have it too.
os.environ["DDPKIT_CACHE"] = tempfile.mkdtemp(prefix="ddpkit-test-cache-")
atexit.register(shutil.rmtree, os.environ["DDPKIT_CACHE"], True)


@pytest.fixture(autouse=True, scope="session")
def shared_pools_end_with_the_session():
    """The shared warm pools serve every test (as they serve every cell of a notebook); at the
    end, `ddpkit.shutdown()` must leave no process."""
    yield
    import ddpkit

    ddpkit.shutdown()
    deadline = time.monotonic() + 5
    while rank_children(shared=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = rank_children(shared=True)
    assert not left, f"processes left after ddpkit.shutdown(): {left}"


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


@pytest.fixture
def kernel_sigint():
    """Python's own SIGINT handler, as a Jupyter kernel has it, for the tests that interrupt a
    run. A shell starts background commands with SIGINT ignored, and Python then keeps it so;
    ``_thread.interrupt_main`` does nothing at all under that."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def pytest_addoption(parser):
    parser.addoption("--breadth", action="store_true",
                     help="also run the tests marked breadth (the whole family list of "
                          "tests/test_breadth.py; python -m bench.breadth tabulates it)")


def _slow_tests():
    """The test functions listed in tests/slow_tests.txt (measured, see its header)."""
    from pathlib import Path

    path = Path(__file__).with_name("slow_tests.txt")
    return {line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def _file_seconds():
    """{file: seconds} from tests/file_seconds.txt (measured, see its header)."""
    from pathlib import Path

    out = {}
    for line in Path(__file__).with_name("file_seconds.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, path = line.split()
            out[path] = float(seconds)
    return out


def pytest_collection_modifyitems(config, items):
    """The longest files first (the notebooks' too: this hook sees every item), each file's
    tests kept together in their order: with ``--dist loadfile --no-loadscope-reorder`` the two
    workers then end within seconds of each other. Two tiers. The browser tests and the tests
    marked ``slow`` (more than ~2 s each on 2 cores) belong to the full run only:
    ``pytest tests -m "not slow"`` is the quick tier for the inner loop. Tests marked
    ``breadth`` run with --breadth (or -m breadth); otherwise they are skipped, saying so."""
    seconds = _file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable
    slow = _slow_tests()
    for item in items:
        node = item.nodeid.split("[")[0]  # every parameter of a slow test function
        if "browser" in item.nodeid.split("::")[0].split("/") or node in slow:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--breadth") or "breadth" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="marked breadth: run with --breadth (or python -m bench.breadth)")
    for item in items:
        if "breadth" in item.keywords and item.get_closest_marker("breadth") is not None:
            item.add_marker(skip)


@pytest.fixture
def opening():
    """The state each widget comm opened in this test carried in its opening message, by comm
    id (a copy: what the page was sent, whatever the widget does after)."""
    import copy

    import comm

    states, create = {}, comm.create_comm

    def create_comm(**kw):
        c = create(**kw)
        states[c.comm_id] = copy.deepcopy(kw["data"]["state"])
        return c

    comm.create_comm = create_comm
    try:
        yield states
    finally:
        comm.create_comm = create
