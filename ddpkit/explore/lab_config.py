"""Between the Lab's controls and a `TrainConfig`: the controls set from a config, the config the
controls describe, what a moved control does (the estimate read-out follows it; mid-run, the
settings that may change are sent to the ranks). Widgets only edit a config."""
from __future__ import annotations

import html

from ..engine.policies import CheckpointSetting
from .estimate import estimate
from .units import fmt_bytes


class ConfigSync:
    """``view``: the `LabView`; ``cfg``: the config the Lab started from (what the controls do
    not edit comes from it); ``running()``: is a run going; ``send(**settings)``: to its ranks."""

    def __init__(self, view, cfg, running, send):
        self.view, self.cfg, self.running, self.send = view, cfg, running, send
        self._syncing = False
        self._selective = False

    def read_config(self, cfg):
        """Set the controls from a config (without sending anything mid-run)."""
        self._syncing = True
        try:
            setting = cfg.checkpoint
            self.view.controls["segments"].value = setting if isinstance(setting, int) else 0
            for t, on in zip(self.view.block_toggles, cfg.checkpointing.mask):
                t.value = on
            self._selective = isinstance(setting, (list, str))
        finally:
            self._syncing = False

    def checkpoint_setting(self):
        """What the controls say, a `CheckpointSetting`: the per-block toggles once one was
        moved, else the segments slider (0: none)."""
        if self._selective:
            return CheckpointSetting.from_mask([t.value for t in self.view.block_toggles])
        return CheckpointSetting.of(self.view.controls["segments"].value or None,
                                    self.cfg.n_blocks)

    def config(self):
        """The TrainConfig the controls describe (raises ValueError naming the field)."""
        v = {k: w.value for k, w in self.view.controls.items() if k != "segments"}
        v.update({k: v[k] or None for k in ("bucket_cap_mb", "link_gbps")})  # 0: torch's/none
        return self.cfg.replace(checkpoint=self.checkpoint_setting().plain, **v)

    def on_control(self, change):
        if self._syncing:
            return
        if change["owner"] is self.view.controls["segments"]:
            self._selective = False
            self._syncing = True
            try:
                for t, on in zip(self.view.block_toggles, self.checkpoint_setting().mask):
                    t.value = on
            finally:
                self._syncing = False
        self.update_estimate()
        self.send_live()

    def on_toggle(self, change):
        if self._syncing:
            return
        self._selective = True
        self.update_estimate()
        self.send_live()

    def set(self, **settings):
        """Move controls from code, as a person would (``set(segments=2, accum_steps=4)``)."""
        for name, value in settings.items():
            if name == "checkpoint":
                self.read_config(self.cfg.replace(checkpoint=value))
                self.update_estimate()
                self.send_live()
            else:
                self.view.controls[name].value = value

    def send_live(self):
        if not self.running():
            return
        try:
            cfg = self.config()  # only settings that make a valid config are sent
        except ValueError:
            return
        self.send(checkpoint=cfg.checkpoint, accum_steps=cfg.accum_steps)

    def update_estimate(self):
        view = self.view
        try:
            cfg = self.config()
        except ValueError as exc:
            view.estimate_html.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            view.run_button.disabled = True
            return
        e = estimate(cfg)
        view.estimate_html.value = (
            f"<div style='line-height:1.35'><b>predicted per rank</b>: params "
            f"{fmt_bytes(e.params)}, grads {fmt_bytes(e.grads)}, optimizer "
            f"{fmt_bytes(e.optimizer)}, activations {fmt_bytes(e.activations)} (one "
            f"micro-batch); total {fmt_bytes(e.total)}</div>")
        view.run_button.disabled = self.running()

    def show_torchrun(self):
        view = self.view
        try:
            view.torchrun_text.value = self.config().to_torchrun()
        except ValueError as exc:  # a notebook-defined model has no import path
            view.torchrun_text.value = str(exc)
        view.torchrun_text.layout.display = ""
