"""`Lab`: ipywidgets that edit a `TrainConfig`, run it on a warm pool, and follow it live.

The widgets only edit a config; `Lab.run` hands that config to `ddpkit.train` (non-blocking,
``live=True``) and returns at once, so the kernel stays free and controls keep working while the
ranks train. A change of checkpoint segments (or per-block toggles) or of accumulation steps
during a run is sent to rank 0, which broadcasts it: it lands on every rank at the same optimizer
step, and the plots mark that step. Controls that cannot change mid-run are disabled meanwhile.

The Lab is its jobs put together, each in its own file: `controls.py` is the table of its
controls (one row each), `view.py` builds the widgets from it (`blocks.py` the per-block
checkpoint control), `sync.py` keeps them and the config in step, `runner.py` starts runs and
shows the doctor's banner, `follow.py` follows a run (figures, progress, error banner),
`history.py` writes and shows one row per finished run, `plan_panel.py` is the planner box and
`peak_panel.py` the peak beside the memory plot; `background.py` is the Lab's one predictor
thread (the simulated steps), which `close` stops.
"""
from __future__ import annotations

from ..config import TrainConfig
from ..predict.estimate import activation_bytes
from ..runs.timeline import link_label
from .background import Predictor
from .follow import RunFollower
from .peak_panel import PeakPanel
from .plan_panel import PlanPanel
from .plots import LivePlots, check_ema
from .runner import LabRunner
from .sync import ConfigSync, described, readout
from .timeline import LiveTimeline
from .view import LabView


class Lab:
    """The dashboard over a config. It shows the way an ipywidget does: as a cell's value
    (``ddpkit.Lab(cfg)``, or ``lab = ddpkit.Lab(cfg)`` then ``lab``) or with ``display(lab)``;
    ``lab = ddpkit.Lab(cfg)`` alone shows nothing. Every view of it is the same live dashboard.
    ``lab.run()``, ``lab.wait()``, ``lab.stop()`` do what the buttons do; ``lab.history`` has one
    row per finished run."""

    def __init__(self, cfg=None, max_hz=5.0, ema=0.95):
        if cfg is not None and not isinstance(cfg, TrainConfig):
            raise TypeError(f"Lab() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                            f"build one with ddpkit.TrainConfig(...)")
        if not max_hz > 0:
            raise ValueError(f"Lab(max_hz={max_hz!r}): figure updates per second must be > 0; "
                             f"pass e.g. max_hz=5")
        check_ema(ema, "Lab")  # before the peak panel starts its thread

        self.cfg = cfg or TrainConfig()
        self.history = []
        self._handle = None
        self.predictor = Predictor()  # the Lab's one thread for simulated steps; close() ends it
        self.peaks = PeakPanel(self.predictor)  # beside the memory plot: each rank's peak
        self.plots = LivePlots(self.cfg.world_size, max_hz=max_hz, ema=ema,
                               beside_memory=self.peaks.widget)
        self.timeline = LiveTimeline(self.cfg.world_size, max_hz=1.0)  # [timeline] swimlanes
        # a budget or a GPU in: the checkpoint controls set to the plan, as a person would
        self.planner = PlanPanel(self.config, lambda p: self.set(checkpoint=p.checkpoint))
        self.view = LabView(self.cfg, self.plots, self.planner, self.timeline,
                            readout=self._first_readout)
        self.sync = ConfigSync(self.view, self.cfg, lambda: self.running,
                               lambda **kw: self._handle.send_control(**kw), self.predictor)
        self.runner = LabRunner(self.view)
        self.follower = RunFollower(self.view, self.plots, self.history, self.peaks,
                                    self.timeline)
        v = self.view  # the widgets people and tests reach through the Lab
        self.controls, self.block_toggles, self.widget = v.controls, v.block_toggles, v.widget
        self.blocks = v.blocks  # the per-block control: range, 'every', toggles, its summary
        self.run_button, self.stop_button, self.progress = v.run_button, v.stop_button, v.progress
        self.estimate_html, self.banner, self.traceback = v.estimate_html, v.banner, v.traceback
        self.output = v.output
        self._wire()
        self.sync.update_estimate()  # the same read-out the view was made with; starts its peak

    def _first_readout(self, view):
        """What the read-out says of ``view``'s controls as they are made (the view shows it
        from the start: its comm opens whole), and whether Run may start."""
        chosen = self.cfg.checkpoint if self.cfg.checkpoint.names_blocks else None
        text, cfg, _ = readout(lambda: described(self.cfg, view, chosen))
        return text, cfg is not None

    def _wire(self):
        v = self.view
        for w in v.controls.values():
            w.observe(self.sync.on_control, names="value")
        v.blocks.on_change(self.sync.on_blocks)
        v.run_button.on_click(lambda _: self.run())
        v.stop_button.on_click(lambda _: self.stop())
        v.torchrun_button.on_click(lambda _: self.sync.show_torchrun())
        v.smooth.observe(self._on_smooth, names="value")

    def _on_smooth(self, change):
        with self.plots.loss.batch_update():
            for tr in self.plots.loss.data:
                if tr.name and tr.name.endswith("EMA"):
                    tr.visible = change["new"]

    def show(self):
        """Show the dashboard in the cell now (what ``display(lab)`` does)."""
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        # as a cell's value or in display(): the dashboard, exactly as its widget shows itself
        return self.widget._repr_mimebundle_(**kwargs)

    # ------------------------------------------------------------------ the config
    def checkpoint_setting(self):
        """What the controls say, a `CheckpointSetting` (segments, or per-block toggles)."""
        return self.sync.checkpoint_setting()

    def config(self):
        """The TrainConfig the controls describe (raises ValueError naming the field)."""
        return self.sync.config()

    def set(self, **settings):
        """Move controls from code, as a person would (``lab.set(segments=2, accum_steps=4)``)."""
        self.sync.set(**settings)

    # ------------------------------------------------------------------ running
    @property
    def running(self):
        return self._handle is not None and not self._handle.done

    @property
    def metrics(self):
        """The current (or last) run's records, every rank's, as they arrived."""
        return self.follower.metrics

    @property
    def findings(self):
        """What the doctor found in the current (or last) run's config."""
        return self.runner.findings

    def run(self):
        """Start a run of the current config; returns at once (see ``wait``)."""
        if self.running or self.follower.alive:
            raise RuntimeError("a run is already going in this lab; stop() or wait() first")
        cfg = self.config()
        self.follower.reset(cfg)
        self.runner.check(cfg)
        self.view.output.clear_output()
        self.plots.new_run(cfg.world_size, label=f"run {len(self.history)}",
                           setting=cfg.checkpoint, predict=lambda rec: activation_bytes(
                               cfg, cfg.checkpoint.with_value(rec["checkpoint"])))
        self.peaks.new_run(cfg)
        self.timeline.new_run(cfg.world_size, link_label(cfg))  # [timeline]
        self.view.set_running(True)
        self.follower.clock()
        self._handle = self.runner.train(cfg, self._on_metric, self.follower.on_output)
        self.follower.start(cfg, self._handle)
        return self._handle

    def _on_metric(self, record):
        self.follower.on_metric(record)

    def wait(self, timeout=None):
        """Block until the current run ends and its history row is written; returns the row."""
        return self.follower.wait(timeout)

    def stop(self):
        """End the current run now; the row says 'stopped'."""
        if self._handle is not None and not self._handle.done:
            self._handle.stop()
        return self.wait()

    def close(self):
        """Stop any run and end the Lab's predictor thread. The warm ranks its runs used are
        the kernel's shared pool, kept for the next run until idle ``DDPKIT_POOL_IDLE_S``
        seconds or `ddpkit.shutdown()`."""
        self.stop()
        self.predictor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
