"""``ddpkit workshop [DIR]``: the curriculum copied into DIR (an attendee's changes kept), the
check, then JupyterLab there, listening on 127.0.0.1 only, with its token.

JupyterLab runs as a child in a session of its own, so a Ctrl-C in the terminal reaches ddpkit
alone, which then stops JupyterLab with SIGTERM: the server shuts its kernels down (and a
kernel's ranks end with it) before it exits, and ddpkit waits for that. ``--no-browser`` opens
nothing and prints the URL (the server's own record of where it listens, with its token).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import curriculum, packages
from .check import run

STOP_WAIT_S = 30  # JupyterLab's own shutdown of its kernels; killed after that


def report_copy(folder, copied, out):
    notebooks = [c for c in copied if c.path.endswith(".ipynb")]
    counts = [(sum(c.action == a for c in notebooks), a) for a in curriculum.ACTIONS]
    summary = ", ".join(f"{n} {action}" for n, action in counts if n)
    print(f"The curriculum is in {folder}: {len(notebooks)} notebooks ({summary}), "
          f"{len(copied) - len(notebooks)} images.", file=out)
    for c in copied:
        if c.action == "kept":
            print(f"  kept your {c.path} (you changed it); ddpkit {curriculum.version()}'s is "
                  f"beside it as {c.beside}", file=out)
    out.flush()


def workshop(folder, open_browser=True, check=True, out=None):
    """Copy, check, serve (printing on ``out``, stdout by default); returns the exit code."""
    out = out or sys.stdout
    folder = Path(folder).resolve()
    report_copy(folder, curriculum.copy_into(folder), out)
    if check:
        report = run()
        print(report.table(), file=out, flush=True)
    if packages.installed("jupyterlab") is None:
        print(f"JupyterLab is not installed: {packages.LAB_FIX}", file=out, flush=True)
        return 1
    return serve(folder, open_browser, out)


def _url(pid):
    """The server's URL with its token, once it has written where it listens."""
    from jupyter_server.serverapp import list_running_servers

    for info in list_running_servers():
        if info.get("pid") == pid:
            return f"{info['url']}lab?token={info['token']}"
    return None


class _Stop(Exception):
    pass


class _Signals:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP while JupyterLab runs: each ends ddpkit's wait (an
    exception in the main thread), except while the child is being started: a signal then is
    noted and acted on once the child is known (raised inside ``Popen`` it would lose a child
    already started, left running with nobody to stop it)."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                    if hasattr(signal, name))  # Windows has no SIGHUP

    def __enter__(self):
        self.deferring, self.noted = False, None
        self.old = {s: signal.signal(s, self._on) for s in self.SIGNALS}
        return self

    def _on(self, signum, frame):
        if self.deferring:
            self.noted = signum
        else:
            raise _Stop(signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.noted is not None:
            raise _Stop(signal.Signals(self.noted).name)

    def ignore(self):
        """Stopping takes its time: a second Ctrl-C waits for it too."""
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)


def serve(folder, open_browser=True, out=None):
    """JupyterLab on 127.0.0.1 in ``folder`` until it ends or ddpkit is stopped."""
    out = out or sys.stdout
    cmd = [sys.executable, "-m", "jupyterlab", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.root_dir={folder}",
           f"--ServerApp.open_browser={open_browser}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # a container's root: Jupyter refuses it
        cmd.append("--ServerApp.allow_root=True")  # unless told (loopback and a token still)
        print("(running as root: JupyterLab is allowed to)", file=out)
    proc = None
    with _Signals() as signals:
        try:
            with signals.deferred():
                proc = subprocess.Popen(cmd, cwd=folder, start_new_session=True)
            url = None
            while url is None and proc.poll() is None:
                url = _url(proc.pid)
                time.sleep(0.2)
            if url is None:
                print(f"JupyterLab ended (exit code {proc.returncode}) before it listened: its "
                      f"log above says why", file=out, flush=True)
            else:
                print(f"JupyterLab is at {url}\n(Ctrl-C here stops it and its kernels)",
                      file=out, flush=True)
            return proc.wait()
        except _Stop:
            return 0
        finally:
            signals.ignore()
            if proc is not None:
                _stop(proc)


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
