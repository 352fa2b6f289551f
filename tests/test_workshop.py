"""The workshop: the curriculum as the package ships it, its copy into an attendee's folder, and
``ddpkit check`` naming each problem with its fix (each simulated here, in this process: a
port that cannot be bound, a package that is not installed, a torch without distributed, an
old front-end where JupyterLab looks). At the end, the wheel itself: built, installed with the
lab extra into a fresh venv outside the repository, and run there (slow)."""
import json
import re
import socket
from importlib import metadata
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.workshop import check, curriculum, packages

ROOT = Path(__file__).resolve().parent.parent


def _code(nb_path):
    cells = json.loads(nb_path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_the_curriculum_lists_every_notebook_and_what_each_imports():
    on_disk = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [nb.name for nb in curriculum.NOTEBOOKS] == on_disk
    for nb in curriculum.NOTEBOOKS:
        code = _code(ROOT / "notebooks" / nb.file)
        imported = {p for p in ("transformers", "peft")
                    if re.search(rf"^\s*(from|import) {p}\b", code, re.M)}
        assert imported == set(nb.packages), nb.name
        assert (nb.ranks == 4) == bool(re.search(r"world_size=4\b", code)), nb.name
    assert all(name in curriculum.BY_NAME for name, _ in curriculum.SHORT_TRACK)
    assert sum(minutes for _, minutes in curriculum.SHORT_TRACK) == 60
    assert not any(curriculum.BY_NAME[name].packages for name, _ in curriculum.SHORT_TRACK)


def test_the_notebooks_do_not_depend_on_the_repository():
    """An attendee's copy has no conftest.py, tests/, bench/ or checkout around it."""
    layout = re.compile(r"__file__|conftest|\btests[./]|\bbench[./]|notebooks/|\.\./|sys\.path"
                        r"|os\.chdir|import pytest|pyproject|\.ci/|images/")
    found = [(p.name, m.group()) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
             for m in layout.finditer(_code(p))]
    assert found == []


def _notebooks(folder):
    return sorted(p.name for p in Path(folder).glob("*.ipynb"))


def test_a_second_copy_keeps_what_the_attendee_changed_and_updates_the_rest(tmp_path):
    first = curriculum.copy_into(tmp_path)
    assert _notebooks(tmp_path) == [nb.file for nb in curriculum.NOTEBOOKS]
    assert {c.action for c in first} == {"copied"}
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == \
        sorted(p.name for p in (ROOT / "notebooks" / "images").iterdir())
    shipped = (ROOT / "notebooks" / "01_launch.ipynb").read_bytes()
    mine = shipped.replace(b"# 01 \xc2\xb7 Launching", b"# My notes on launching")
    assert mine != shipped
    (tmp_path / "01_launch.ipynb").write_bytes(mine)
    # 02 as an older ddpkit copied it, untouched since: it is updated in place
    record = json.loads((tmp_path / curriculum.MANIFEST).read_text())
    (tmp_path / "02_checkpointing.ipynb").write_bytes(b"{}")
    record["files"]["02_checkpointing.ipynb"] = curriculum._digest(b"{}")
    (tmp_path / curriculum.MANIFEST).write_text(json.dumps(record))

    for _ in range(2):  # the third run finds the same: the attendee's file is still theirs
        again = {c.path: c for c in curriculum.copy_into(tmp_path)}
        beside = f"01_launch.ddpkit-{curriculum.version()}.ipynb"
        assert (again["01_launch.ipynb"].action, again["01_launch.ipynb"].beside) == \
            ("kept", beside)
        assert (tmp_path / "01_launch.ipynb").read_bytes() == mine
        assert (tmp_path / beside).read_bytes() == shipped
        assert again["02_checkpointing.ipynb"].action in ("updated", "up to date")
        assert (tmp_path / "02_checkpointing.ipynb").read_bytes() == \
            (ROOT / "notebooks" / "02_checkpointing.ipynb").read_bytes()
        assert {c.action for p, c in again.items() if not p.startswith(("01", "02"))} == \
            {"up to date"}
    assert _notebooks(tmp_path) == sorted([nb.file for nb in curriculum.NOTEBOOKS] + [beside])


@pytest.fixture
def without(monkeypatch):
    """Make installed packages look absent, as they are on a machine without them."""
    def hide(*names):
        real = metadata.version

        def version(name):
            if name.lower().replace("-", "_") in names:
                raise metadata.PackageNotFoundError(name)
            return real(name)

        monkeypatch.setattr(metadata, "version", version)
        for name in names:
            monkeypatch.setitem(__import__("sys").modules, name, None)
    return hide


def test_check_names_each_problem_and_its_fix(monkeypatch, without, capsys):
    """No port on loopback, anywidget missing, a torch built without distributed: each named
    with its fix, the launch skipped, exit 1; as a table and as JSON."""
    import torch.distributed

    def refuse(self, address):
        raise OSError(99, "Cannot assign requested address")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    without("anywidget")

    assert main(["check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in report["checks"]}
    assert not report["ready"] and report["verdict"].startswith("not ready")
    assert {n for n, r in rows.items() if r["status"] == "fail"} == \
        {"loopback", "torch.distributed", "widgets"}
    assert "Cannot assign requested address" in rows["loopback"]["found"]
    assert "listen on 127.0.0.1" in rows["loopback"]["fix"]
    assert "without distributed support" in rows["torch.distributed"]["fix"]
    assert "pip install" in rows["torch.distributed"]["fix"]
    assert rows["widgets"]["found"] == "anywidget is not installed"
    assert rows["widgets"]["fix"] == 'pip install -U "ddpkit[lab]"'
    assert rows["2-rank launch"]["status"] == "skipped"

    assert main(["check"]) == 1
    out, err = capsys.readouterr()
    assert len(re.findall(r"^\[ ?\d+/\d+\] ", err, re.M)) == len(check.CHECKS)  # progress
    for name in ("loopback", "torch.distributed", "widgets"):
        assert f"to fix: {name}: {rows[name]['fix']}" in out
    assert "verdict: not ready: fix torch.distributed, loopback, widgets" in out


def _extension(root, name, version):
    path = Path(root, "labextensions", name)
    path.mkdir(parents=True)
    (path / "package.json").write_text(json.dumps({"name": name, "version": version}))
    return path


def test_check_rows_name_other_problems_and_their_fixes(monkeypatch, without, tmp_path):
    ctx = {}
    monkeypatch.setattr("platform.python_version", lambda: "3.9.7")
    assert check.python_row(ctx)[0] == "fail" and ">=3.10" in check.python_row(ctx)[2]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert check.cores_row(ctx)[0] == "warn"

    # too little memory for the short track: to fix; for notebook 12 alone: a note
    need = curriculum.memory_needed()
    track = max(need[name] for name, _ in curriculum.SHORT_TRACK)
    for free, status in ((track - 1, "fail"), (need["12_peak"] - 1, "warn")):
        monkeypatch.setattr("psutil.virtual_memory", lambda: type("M", (), {"available": free}))
        over = [curriculum.BY_NAME[n] for n, b in need.items() if b > free]
        assert check.memory_row(ctx)[0] == status
        assert f" {curriculum.numbers(over)}, or skip " in check.memory_row(ctx)[2]
    assert [nb.name for nb in over] == ["12_peak"]

    # an old anywidget front-end where JupyterLab looks first; a kernel of another Python
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    old = _extension(tmp_path, "anywidget", "0.0.1")
    status, found, fix = packages.widgets_row()
    assert status == "fail" and "anywidget 0.0.1" in found and fix == f"remove the older " \
        f"one: rm -r '{old}'"
    kernel = tmp_path / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": ["/opt/other/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    status, found, fix = packages.kernel_row()
    assert status == "fail" and "/opt/other/bin/python3" in found
    assert fix.endswith("-m ipykernel install --sys-prefix")

    without("transformers", "jupyterlab")
    status, found, fix = packages.hf_row()
    assert (status, fix) == ("fail", 'pip install "ddpkit[lab]"')
    assert found == "transformers is not installed: notebooks 09, 10, 11, 12, 13, 15 and 16 need it"
    assert packages.jupyterlab_row() == ("fail", "jupyterlab is not installed",
                                         'pip install "ddpkit[lab]"')


def test_packages_of_mismatched_versions_are_named(monkeypatch):
    real, old = metadata.version, {"jupyterlab_widgets": "3.0.1", "torch": "2.5.1"}
    monkeypatch.setattr(metadata, "version", lambda name: old.get(name) or real(name))
    status, found, fix = packages.widgets_row()
    assert status == "fail" and found.startswith("jupyterlab_widgets 3.0.1 (ipywidgets ")
    assert fix == "pip install -U ipywidgets jupyterlab_widgets"
    assert check.torch_row({}) == ("fail", "torch 2.5.1, ddpkit needs >=2.11",
                                   "pip install -U torch")


def test_the_workshop_checks_before_it_starts_jupyterlab(monkeypatch, without, tmp_path,
                                                        capsys):
    from ddpkit.workshop.jupyter import workshop

    def refuse(self, address):
        raise OSError(99, "Cannot assign requested address")

    monkeypatch.setattr(socket.socket, "bind", refuse)  # no launch: this test stays short
    without("jupyterlab")
    assert workshop(tmp_path / "course") == 1
    out = capsys.readouterr().out
    copied, table, missing = out.split("\n", 1)[0], out.split("\n", 1)[1], out.splitlines()[-1]
    assert copied.endswith(f"course: 16 notebooks (16 copied), "
                           f"{len(list((ROOT / 'notebooks' / 'images').iterdir()))} images.")
    assert "verdict: not ready: fix loopback, jupyterlab" in table
    assert missing == 'JupyterLab is not installed: pip install "ddpkit[lab]"'


def test_a_stop_that_comes_while_jupyterlab_starts_stops_it(monkeypatch, tmp_path):
    """SIGTERM (a closed terminal, a kill) as the server's process is made: raised inside
    Popen it would lose the child, left running with nobody to stop it."""
    import os
    import signal
    import subprocess

    from ddpkit.workshop import jupyter

    made = []

    def popen(*args, **kw):
        made.append(real(*args, **kw))
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, before Popen returns
        return made[-1]

    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    try:
        assert jupyter.serve(tmp_path, open_browser=False) == 0
        assert made[0].poll() is not None  # ended, and waited for
    finally:
        for p in _left_in(tmp_path):
            p.kill()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back


def test_the_readme_starts_an_attendee_in_two_commands_and_holds_the_measured_table():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### At a workshop", 1)[1].split("\n#", 1)[0]
    commands = re.findall(r"^```bash\n(.*?)\n```", section, re.S | re.M)
    assert [c.splitlines() for c in commands] == [['pip install "ddpkit[lab]"',
                                                   "ddpkit workshop"]]
    block = re.search(r"<!-- facilitator table: python -m bench.curriculum --write -->\n(.*?)\n"
                      r"<!-- end of the facilitator table -->", readme, re.S)[1]
    assert block == curriculum.facilitator_table()
    # and every other place that says the curriculum's times, from the same measurement (one
    # command writes them all: python -m bench.curriculum --write)
    from bench import curriculum as bench

    measured = curriculum.timings()
    assert bench.readme_row(measured) in readme.splitlines()
    assert bench.results_section(measured) in (ROOT / "bench" / "results.md").read_text()


def test_the_verdict_names_the_long_notebooks_scaled_to_this_machine():
    ok = [check.Row("python", "ok", "3.11")]
    measured = curriculum.timings()["notebooks"]
    long = sorted(n for n, m in measured.items() if m["seconds"] >= curriculum.LONG_S)
    minutes = round(sum(measured[n]["seconds"] for n in long) / 60)
    numbers = curriculum.numbers([curriculum.BY_NAME[n] for n in long])
    assert check.Report(ok, 1.0, 1).verdict == \
        f"ready, notebooks {numbers} will take about {minutes} min"
    # a machine 3x slower than the one that measured them: more of them take a minute or more
    slow = sorted(n for n, m in measured.items() if 3 * m["seconds"] >= curriculum.LONG_S)
    assert check.Report(ok, 3.0, 1).verdict.startswith(
        f"ready, notebooks {curriculum.numbers([curriculum.BY_NAME[n] for n in slow])} ")
    assert check.Report(ok, 0.01, 1).verdict == "ready"
    note = check.Row("memory", "warn", "7 GiB available", "free 2 GiB for notebook 12")
    assert check.Report([*ok, note], 0.01, 1).verdict == "ready; see the notes below"
    assert "note: memory: free 2 GiB for notebook 12" in check.Report([*ok, note], 0.01, 1).table()


# -- the wheel, installed with the lab extra into a fresh venv outside the repository

def _venv_resolving_against_this_one(env_dir):
    """A fresh venv whose dependencies are this environment's installed packages (a .pth to a
    folder of links to them, ddpkit's own editable install left out) and its Jupyter data
    (JupyterLab's assets, the widget front-ends, the kernel spec): pip then finds every
    requirement installed and downloads nothing."""
    import os
    import subprocess
    import sys
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    ver = "python%d.%d" % sys.version_info[:2]
    view = env_dir / "lib" / ver / "deps"  # its ../../../share is the venv's share: see below
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("ddpkit", "__editable__")) and entry.suffix != ".pth":
            (view / entry.name).symlink_to(entry)
    (env_dir / "lib" / ver / "site-packages" / "deps.pth").write_text(f"{view}\n")
    (env_dir / "share").mkdir(exist_ok=True)
    (env_dir / "share" / "jupyter").symlink_to(Path(sys.prefix, "share", "jupyter"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        env[var] = str(env_dir.parent / "home" / sub)  # nothing of this user's Jupyter set-up
    return env


def _build_wheel(tmp_path):
    """The wheel of this worktree's files (tracked, or new and not ignored), built as pip
    builds it, from a copy: nothing is written into the checkout."""
    import shutil
    import subprocess
    import sys

    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(src)],
                   check=True)
    return next((tmp_path / "wheels").glob("ddpkit-*.whl"))


def _start_workshop(env, cwd, *args):
    """``ddpkit workshop`` with its stdout read line by line."""
    import subprocess

    with open(cwd / f"workshop-{len(list(cwd.glob('workshop-*')))}.log", "w") as log:
        return subprocess.Popen(["ddpkit", "workshop", *args], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=log)


def _read_until(proc, text):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            break
    return "".join(lines)


def _left_in(folder):
    """Processes whose working folder is under ``folder`` (JupyterLab, its kernels, their
    ranks: a server left running would be orphaned, out of sight of the usual checks)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if Path(p.cwd()).is_relative_to(folder):
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def _stop_and_check_nothing_left(proc, folder):
    """SIGTERM to ``ddpkit workshop``, as a terminal's close or a kill sends; it must end
    JupyterLab and every kernel before it exits."""
    import signal

    proc.send_signal(signal.SIGTERM)
    proc.wait()
    left = _left_in(folder)
    for p in left:
        p.kill()
    assert left == []
    return proc.stdout.read()


def test_the_wheel_installs_with_the_lab_extra_and_runs_the_workshop(tmp_path):
    try:
        _wheel_workshop(tmp_path)
    finally:  # a failure above leaves no server running
        for p in _left_in(tmp_path):
            p.kill()


def _wheel_workshop(tmp_path):
    import resource
    import subprocess
    import time
    import zipfile

    import psutil

    t0 = time.monotonic()
    cpu0 = sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    wheel = _build_wheel(tmp_path)
    inside = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.split("/")[-1] for n in inside
                     if n.startswith("ddpkit/workshop/notebooks/") and n.endswith(".ipynb"))
    assert shipped == [nb.file for nb in curriculum.NOTEBOOKS]
    assert "ddpkit/workshop/timings.json" in inside
    assert len([n for n in inside if n.startswith("ddpkit/workshop/notebooks/images/")]) == \
        len(list((ROOT / "notebooks" / "images").iterdir()))
    env = _venv_resolving_against_this_one(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
                    f"{wheel}[lab]"], env=env, check=True)
    built = time.monotonic()

    # (stderr: the progress lines, left to the terminal)
    done = subprocess.run(["ddpkit", "check"], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE)
    assert done.returncode == 0, done.stdout
    assert re.search(r"^verdict: ready", done.stdout, re.M), done.stdout
    checked = time.monotonic()

    # the check just ran (what a facilitator asks for before the day); the workshop's own run
    # of it is tested in test_the_workshop_checks_before_it_starts_jupyterlab
    first = _start_workshop(env, tmp_path, "course", "--no-browser", "--no-check")
    out = _read_until(first, "JupyterLab is at ")
    assert "16 notebooks (16 copied)" in out, out
    url = re.search(r"JupyterLab is at (http://127\.0\.0\.1:(\d+)/lab\?token=\w+)", out)
    assert url, out
    server = next(p for p in psutil.Process(first.pid).children() if "jupyterlab" in
                  " ".join(p.cmdline()))
    listening = {c.laddr.ip for c in server.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}  # loopback only
    _stop_and_check_nothing_left(first, tmp_path)
    assert first.returncode == 0
    assert sorted(p.name for p in (tmp_path / "course").glob("*.ipynb")) == shipped
    served = time.monotonic()

    nb = tmp_path / "course" / "01_launch.ipynb"
    mine = json.loads(nb.read_text())
    mine["cells"].insert(0, {"cell_type": "markdown", "metadata": {}, "source": ["my notes"]})
    nb.write_text(json.dumps(mine))
    second = _start_workshop(env, tmp_path, "course", "--no-browser", "--no-check")
    out = _read_until(second, "kept your 01_launch.ipynb")
    beside = f"01_launch.ddpkit-{curriculum.version()}.ipynb"
    assert "16 notebooks (15 up to date, 1 kept)" in out and f"beside it as {beside}" in out, out
    _stop_and_check_nothing_left(second, tmp_path)  # stopped as JupyterLab starts
    assert json.loads(nb.read_text())["cells"][0]["source"] == ["my notes"]
    assert (tmp_path / "course" / beside).read_bytes() == \
        (ROOT / "notebooks" / "01_launch.ipynb").read_bytes()

    ran = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
                          "01_launch.ipynb"], cwd=tmp_path / "course", env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-3000:]
    end = time.monotonic()
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"wheel and venv {built - t0:.1f} s, check {checked - built:.1f} s, workshop "
          f"{served - checked:.1f} s, second copy and 01 under nbmake {end - served:.1f} s; "
          f"CPU of the commands {cpu.ru_utime + cpu.ru_stime - cpu0:.0f} s")

