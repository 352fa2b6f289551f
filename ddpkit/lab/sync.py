"""Between the Lab's controls and a `TrainConfig`, by the control table (`controls.CONTROLS`):
the controls set from a config, the config the controls describe, what a moved control does
(the estimate read-out follows it, its peak simulated on the Lab's `background.Predictor`;
mid-run, the live fields are sent to the ranks). Widgets only edit a config."""
from __future__ import annotations

import html
import threading

from ..predict.calibrate import cached
from ..predict.estimate import estimate
from ..predict.units import fmt_bytes
from .controls import CONTROLS, control, live_fields


class ConfigSync:
    """``view``: the `LabView`; ``cfg``: the config the Lab started from (what the controls do
    not edit comes from it); ``running()``: is a run going; ``send(**settings)``: to its ranks;
    ``predictor``: the Lab's thread for the read-out's simulated step."""

    def __init__(self, view, cfg, running, send, predictor):
        self.view, self.cfg, self.running, self.send = view, cfg, running, send
        self.predictor = predictor
        self._syncing = False
        # the per-block control's setting while it is the Lab's (edited last, or the config
        # named blocks); None: the segments control's
        self.chosen = cfg.checkpoint if cfg.checkpoint.names_blocks else None
        self._generation = 0  # one more per read-out: a late peak of an older one is dropped
        self._lock = threading.Lock()

    def read_config(self, cfg, fields=None):
        """Set the controls from a config (those of ``fields`` only, when given), without
        sending anything mid-run."""
        self._syncing = True
        try:
            for c in CONTROLS:
                if fields is None or c.field in fields:
                    self.view.controls[c.name].value = c.shown(cfg)
            if fields is None or "checkpoint" in fields:
                self.view.blocks.show(cfg.checkpoint)
                self.chosen = cfg.checkpoint if cfg.checkpoint.names_blocks else None
        finally:
            self._syncing = False

    def checkpoint_setting(self):
        """What the controls say, a `CheckpointSetting`: the per-block control's once it was
        edited, else the segments slider's (0: none)."""
        return self.config().checkpoint

    def config(self):
        """The TrainConfig the controls describe (raises ValueError naming the field)."""
        return described(self.cfg, self.view, self.chosen)

    def on_control(self, change):
        if self._syncing:
            return
        if change["owner"] is self.view.controls["segments"]:
            self.chosen = None  # the blocks show what the segments cover
            self.view.blocks.show(control("segments").value(change["new"], self.cfg))
        self.update_estimate()
        self.send_live()

    def on_blocks(self, setting):
        """A person edited the per-block control (a toggle, or a range's button): ``setting``,
        one per block, is the checkpointing now (sent once per edit)."""
        if self._syncing:
            return
        self.chosen = setting
        self.update_estimate()
        self.send_live()

    def set(self, **settings):
        """Move controls from code, as a person would (``set(segments=2, accum_steps=4)``);
        ``checkpoint=`` sets the checkpoint controls to a setting (or its plain value)."""
        for name, value in settings.items():
            if name == "checkpoint":
                self.read_config(self.cfg.replace(checkpoint=value), fields={"checkpoint"})
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
        self.send(**{field: getattr(cfg, field) for field in live_fields()})

    def update_estimate(self):
        view = self.view
        with self._lock:
            self._generation += 1
        text, cfg, e = readout(self.config)
        view.estimate_html.value = text
        view.run_button.disabled = cfg is None or self.running()
        if cfg is not None:  # the peak takes a simulated step: the latest config only
            self.predictor.submit(lambda g=self._generation: self._peak(g, e), slot="readout")

    def _peak(self, generation, e):
        try:
            p = e.peak()
            top = sorted(((v, k) for k, v in p.ledger.items() if v), reverse=True)[:3]
            text = (f"<b>the step's peak</b>: {fmt_bytes(p.bytes)} in the {p.phase} ("
                    + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for v, k in top) + ")"
                    + _assumed_text(p) + _step_text(e))
        except Exception as exc:  # noqa: BLE001 (shown in the read-out, never raised here)
            text = f"<span style='color:#b00'>{html.escape(f'{type(exc).__name__}: {exc}')}</span>"
        with self._lock:
            if generation == self._generation:  # no newer read-out meanwhile
                self.view.estimate_html.value = _readout(e, text)

    def show_torchrun(self):
        view = self.view
        try:
            view.torchrun_text.value = self.config().to_torchrun()
        except ValueError as exc:  # a notebook-defined model has no import path
            view.torchrun_text.value = str(exc)
        view.torchrun_text.layout.display = ""


def described(cfg, view, chosen=None):
    """The TrainConfig ``view``'s controls describe (each by its row of the table), the rest
    from ``cfg``; ``chosen``: the per-block control's setting when it is the Lab's (else the
    segments control's). Raises ValueError naming the field. A control shows a value within
    its range: a config's value outside it (``micro_batch=100`` on a slider to 64) is the
    control's."""
    fields = {c.field: c.value(view.controls[c.name].value, cfg) for c in CONTROLS}
    if chosen is not None:
        fields["checkpoint"] = cfg.checkpoint.with_value(chosen)
    return cfg.replace(**fields)


def readout(describe):
    """The read-out of the config ``describe()`` gives, before its peak is simulated (on the
    Lab's predictor): ``(html, config, estimate)``; a refused config gives its error and
    ``None, None``."""
    try:
        cfg = describe()
    except ValueError as exc:
        return f"<span style='color:#b00'>{html.escape(str(exc))}</span>", None, None
    e = estimate(cfg)
    return _readout(e, "<i>simulating the step...</i>"), cfg, e


def _assumed_text(p):
    """What sized the peak's data-dependent ops (a mixture of experts' routing assumed, an upper
    bound), where any did: the first, and how many more `Peak.assumed` holds."""
    if not p.assumed:
        return ""
    more = f" (and {len(p.assumed) - 1} more: .peak().assumed)" if p.assumed[1:] else ""
    return f"<br><i>assumed: {html.escape(p.assumed[0])}{more}</i>"


def _step_text(e):
    """The predicted step time on this machine, where it has been calibrated (`calibrate`:
    the read-out never waits for a calibration), with what most of it goes to."""
    machine = cached()
    if machine is None:
        return ("; <b>a step</b>: <i>ddpkit.calibrate() this machine once (under a minute) "
                "for its predicted time</i>")
    st = e.step_time()
    top = sorted(((v, k) for k, v in st.ledger.items() if v), reverse=True)[:3]
    return (f"; <b>a step</b>: {1e3 * st.seconds:.1f} ms predicted here ("
            + ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.1f}" for v, k in top) + ")")


def _readout(e, peak_text):
    return (f"<div style='line-height:1.35'><b>predicted per rank</b>: params "
            f"{fmt_bytes(e.params)}, grads {fmt_bytes(e.grads)}, optimizer "
            f"{fmt_bytes(e.optimizer)}, activations {fmt_bytes(e.activations)} (one "
            f"micro-batch); {peak_text}</div>")
