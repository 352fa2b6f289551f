"""Between the Lab's controls and a `TrainConfig`: the controls set from a config, the config the
controls describe, what a moved control does (the estimate read-out follows it; mid-run, the
settings that may change are sent to the ranks). Widgets only edit a config."""
from __future__ import annotations

import html
import threading

from . import background
from ..predict.estimate import estimate
from ..predict.units import fmt_bytes


class ConfigSync:
    """``view``: the `LabView`; ``cfg``: the config the Lab started from (what the controls do
    not edit comes from it); ``running()``: is a run going; ``send(**settings)``: to its ranks."""

    def __init__(self, view, cfg, running, send):
        self.view, self.cfg, self.running, self.send = view, cfg, running, send
        self._syncing = False
        self._selective = cfg.checkpoint.names_blocks  # the blocks control's, or the slider's
        self._wanted = None  # (generation, config, estimate) whose peak the read-out shows
        self._generation = 0  # one more per read-out: a late peak of an older one is dropped
        self._wake = threading.Condition()
        threading.Thread(target=self._peaks, name="ddpkit-lab-peak", daemon=True).start()

    def read_config(self, cfg):
        """Set the controls from a config (without sending anything mid-run)."""
        self._syncing = True
        try:
            self.view.controls["segments"].value = cfg.checkpoint.segment_count or 0
            self.view.blocks.show(cfg.checkpoint)
            self._selective = cfg.checkpoint.names_blocks
        finally:
            self._syncing = False

    def checkpoint_setting(self):
        """What the controls say, a `CheckpointSetting`: the per-block control's once it was
        edited, else the segments slider's (0: none)."""
        return checkpoint_of(self.cfg, self.view, self._selective)

    def config(self):
        """The TrainConfig the controls describe (raises ValueError naming the field)."""
        return described(self.cfg, self.view, self._selective)

    def on_control(self, change):
        if self._syncing:
            return
        if change["owner"] is self.view.controls["segments"]:
            self._selective = False  # the blocks show what the segments cover
            self.view.blocks.show(self.checkpoint_setting())
        self.update_estimate()
        self.send_live()

    def on_blocks(self, setting):
        """A person edited the per-block control (a toggle, or a range's button): ``setting``,
        one per block, is the checkpointing now (sent once per edit)."""
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
        with self._wake:
            self._generation += 1
        text, cfg, e = readout(self.config)
        view.estimate_html.value = text
        view.run_button.disabled = cfg is None or self.running()
        if cfg is None:
            return
        with self._wake:  # the peak takes a simulated step: on a thread, the latest config only
            self._wanted = (self._generation, cfg, e)
            self._wake.notify()

    def _peaks(self):
        while True:
            with self._wake:
                while self._wanted is None:
                    self._wake.wait()
                generation, cfg, e = self._wanted
                self._wanted = None
            try:
                p = background.run(e.peak)  # Python's end waits for it
                top = sorted(((v, k) for k, v in p.ledger.items() if v), reverse=True)[:3]
                text = (f"<b>the step's peak</b>: {fmt_bytes(p.bytes)} in the {p.phase} ("
                        + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for v, k in top) + ")")
            except Exception as exc:  # noqa: BLE001 (shown in the read-out, never raised here)
                text = f"<span style='color:#b00'>{html.escape(f'{type(exc).__name__}: {exc}')}</span>"
            with self._wake:
                if generation == self._generation:  # no newer read-out meanwhile
                    self.view.estimate_html.value = _readout(e, text)

    def show_torchrun(self):
        view = self.view
        try:
            view.torchrun_text.value = self.config().to_torchrun()
        except ValueError as exc:  # a notebook-defined model has no import path
            view.torchrun_text.value = str(exc)
        view.torchrun_text.layout.display = ""


def checkpoint_of(cfg, view, selective):
    """The `CheckpointSetting` ``view``'s controls say: its blocks control's when ``selective``
    (it was edited last, or the config named blocks), else its segments slider's (0: none)."""
    if selective:
        return cfg.checkpoint.with_value(view.blocks.setting())
    return cfg.checkpoint.with_value(view.controls["segments"].value or None)


def described(cfg, view, selective):
    """The TrainConfig ``view``'s controls describe, the rest from ``cfg`` (raises ValueError
    naming the field). A control shows a value within its range: a config's value outside it
    (``micro_batch=100`` on a slider to 64) is the control's."""
    v = {k: w.value for k, w in view.controls.items() if k != "segments"}
    v.update({k: v[k] or None for k in ("bucket_cap_mb", "link_gbps")})  # 0: torch's/none
    return cfg.replace(checkpoint=checkpoint_of(cfg, view, selective), **v)


def readout(describe):
    """The read-out of the config ``describe()`` gives, before its peak is simulated (on the
    thread): ``(html, config, estimate)``; a refused config gives its error and ``None, None``."""
    try:
        cfg = describe()
    except ValueError as exc:
        return f"<span style='color:#b00'>{html.escape(str(exc))}</span>", None, None
    e = estimate(cfg)
    return _readout(e, "<i>simulating the step...</i>"), cfg, e


def _readout(e, peak_text):
    return (f"<div style='line-height:1.35'><b>predicted per rank</b>: params "
            f"{fmt_bytes(e.params)}, grads {fmt_bytes(e.grads)}, optimizer "
            f"{fmt_bytes(e.optimizer)}, activations {fmt_bytes(e.activations)} (one "
            f"micro-batch); {peak_text}</div>")
