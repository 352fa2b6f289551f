"""What the Lab runs on: one warm `Pool` (replaced when the world size changes, closed with
the Lab), and `ddpkit.doctor`'s look at each config before its run, shown as a yellow banner."""
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
        """The doctor on ``cfg``; its findings go to the banner (cleared when there are none)."""
        from .api import check_config

        view = self.view
        view.banner.value, view.traceback.layout.display = "", "none"
        self.findings = check_config(cfg)
        if self.findings:
            items = "".join(f"<li><b>{html.escape(f.pitfall)}</b> at {html.escape(f.where)}: "
                            f"{html.escape(f.message)} <i>Fix: {html.escape(f.fix)}</i></li>"
                            for f in self.findings)
            view.banner.value = (f"<div style='background:#fff4d6;border-left:6px solid #d90;"
                                 f"padding:6px'><b>ddpkit.doctor</b><ul>{items}</ul></div>")
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
