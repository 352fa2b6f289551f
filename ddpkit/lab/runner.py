"""How the Lab starts its runs: `train` on the kernel's shared warm pool for the run's world
size (``pool="shared"``; fresh ranks while that pool runs something else), and
`ddpkit.doctor`'s look at each config before its run: its warnings in a yellow banner, its
notes in a quiet line."""
from __future__ import annotations

import html

from ..runs.train import check_config, train


class LabRunner:
    """Starts the Lab's runs. ``view``: the `LabView` whose banner shows the doctor's findings."""

    def __init__(self, view):
        self.view = view
        self.findings = []

    def check(self, cfg):
        """The doctor on ``cfg``: what to act on goes to the yellow banner, notes (what ddpkit
        already did about something) to a quiet line under it; both cleared when there are none."""
        view = self.view
        view.banner.value, view.traceback.layout.display = "", "none"
        self.findings = check_config(cfg)
        view.banner.value = banner_html(self.findings)
        return self.findings

    def train(self, cfg, on_metric, on_output):
        """Start ``cfg`` on the kernel's shared pool, live (mid-run changes), without
        blocking."""
        return train(cfg, pool="shared", block=False, live=True, check=False,
                     on_metric=on_metric, on_output=on_output)


def _item(f):
    return (f"<b>{html.escape(f.pitfall)}</b> at {html.escape(f.where)}: {html.escape(f.message)}"
            f" <i>Fix: {html.escape(f.fix)}</i>")


def banner_html(findings):
    """The doctor's findings as the Lab shows them: a yellow box for the warnings (act on
    these), a folded grey line for the notes; empty when there are none."""
    out = ""
    warned, notes = findings.warnings, findings.notes
    if warned:
        items = "".join(f"<li>{_item(f)}</li>" for f in warned)
        out += (f"<div style='background:#fff4d6;border-left:6px solid #d90;padding:6px'>"
                f"<b>ddpkit.doctor</b><ul>{items}</ul></div>")
    if notes:
        names = ", ".join(html.escape(f.pitfall) for f in notes)
        items = "".join(f"<li>{_item(f)}</li>" for f in notes)
        out += (f"<details class='ddpkit-notes' style='color:#666;font-size:90%'><summary>"
                f"ddpkit.doctor: {len(notes)} note{'s' * (len(notes) > 1)} ({names}), nothing to "
                f"act on</summary><ul>{items}</ul></details>")
    return out
