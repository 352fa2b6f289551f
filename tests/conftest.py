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


class FileSeconds:
    """Seconds of each test file and notebook (setup, call and teardown of its tests) and which
    worker ran it: at the end, a line per xdist worker says how long its tests took and when its
    last file ended (two workers that end far apart waste a core), and with
    ``DDPKIT_FILE_SECONDS=path`` the figures are written there, longest first, in
    tests/file_seconds.txt's own format (what its figures are refreshed from)."""

    def __init__(self):
        self.files = {}  # file -> [seconds, worker, first start, last stop]

    def pytest_runtest_logreport(self, report):
        row = self.files.setdefault(report.nodeid.split("::")[0], [0.0, "-", None, None])
        row[0] += report.duration
        node = getattr(report, "node", None)  # the xdist worker's, on the controller
        row[1] = getattr(getattr(node, "gateway", None), "id", "-")
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if start is not None and stop is not None:
            row[2] = start if row[2] is None else min(row[2], start)
            row[3] = stop if row[3] is None else max(row[3], stop)

    def pytest_terminal_summary(self, terminalreporter, config):
        if hasattr(config, "workerinput") or not self.files:
            return
        begun = min((r[2] for r in self.files.values() if r[2] is not None), default=None)
        workers = sorted({r[1] for r in self.files.values()})
        for w in workers if len(workers) > 1 and begun is not None else []:
            mine = {f: r for f, r in self.files.items() if r[1] == w and r[3] is not None}
            last = max(mine, key=lambda f: mine[f][3])
            terminalreporter.write_line(
                f"worker {w}: {len(mine)} files, {sum(r[0] for r in mine.values()):.0f} s of "
                f"tests, ended {mine[last][3] - begun:.0f} s in (its last: {last})")
        path = os.environ.get("DDPKIT_FILE_SECONDS")
        if path:
            with open(path, "w") as fh:
                for f, r in sorted(self.files.items(), key=lambda kv: -kv[1][0]):
                    fh.write(f"{r[0]:6.1f} {f}\n")


def pytest_configure(config):
    # a plugin, not this conftest's own hooks: those see only the reports of tests/ (the
    # notebooks' come through the plugin manager too)
    if not config.pluginmanager.has_plugin("ddpkit-file-seconds"):
        config.pluginmanager.register(FileSeconds(), "ddpkit-file-seconds")
