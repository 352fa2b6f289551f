"""What the Lab runs on: one warm `Pool` (replaced when the world size changes, closed with
the Lab), and `ddpkit.doctor`'s look at each config before its run: its warnings in a yellow
banner, its notes in a quiet line."""
from __future__ import annotations

import html


class LabRunner:
    """Starts the Lab's runs. ``view``: the `LabView` whose banner shows the doctor's findings."""

    def __init__(self, view):
        self.view = view
        self.pool = None
        self.findings = []

    def pool_for(self, cfg):
        """A warm pool of ``cfg.world_size`` ranks (the last one, if it fits)."""
        from ..runtime.pool import Pool

        if self.pool is None or self.pool.world_size != cfg.world_size:
            if self.pool is not None:
                self.pool.close()
            self.pool = Pool(cfg.world_size, cfg.backend, cfg.device)
        return self.pool

    def check(self, cfg):
        """The doctor on ``cfg``: what to act on goes to the yellow banner, notes (what ddpkit
        already did about something) to a quiet line under it; both cleared when there are none."""
        from .api import check_config

        view = self.view
        view.banner.value, view.traceback.layout.display = "", "none"
        self.findings = check_config(cfg)
        view.banner.value = banner_html(self.findings)
        return self.findings

    def train(self, cfg, on_metric, on_output):
        """Start ``cfg`` on the warm pool, live (mid-run changes), without blocking."""
        from .api import train

        return train(cfg, pool=self.pool_for(cfg), block=False, live=True, check=False,
                     on_metric=on_metric, on_output=on_output)

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool = None


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
