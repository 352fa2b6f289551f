"""`Lab`: ipywidgets that edit a `TrainConfig`, run it on a warm pool, and follow it live.

The widgets only edit a config; `Lab.run` hands that config to `ddpkit.train` (non-blocking,
``live=True``) and returns at once, so the kernel stays free and controls keep working while the
ranks train. A change of checkpoint segments (or per-block toggles) or of accumulation steps
during a run is sent to rank 0, which broadcasts it: it lands on every rank at the same optimizer
step, and the plots mark that step. Controls that cannot change mid-run are disabled meanwhile.

A refresher thread per run moves records into the figures at <= 10 updates/s, updates the
progress bar, and at the end writes a row to ``history`` and shows any error as a red banner
with the culprit's traceback (the lab is ready for the next run at once).
"""
from __future__ import annotations

import html
import threading
import time

import ipywidgets as W

from ..engine.blocks import block_names
from ..config import PRECISIONS, TrainConfig
from ..errors import RankError, RankStalled
from .estimate import activation_bytes, estimate
from .plots import LivePlots
from .timeline import LiveTimeline, link_label, timeline_controls
from .units import fmt_bytes
from ..engine.policies import CheckpointSetting

FIXED_TIP = "fixed while a run goes: it needs new processes or a new model (Stop first)"


class Lab:
    """``lab = ddpkit.Lab(cfg)`` shows the dashboard; ``lab.run()``, ``lab.wait()``,
    ``lab.stop()`` do what the buttons do; ``lab.history`` has one row per finished run."""

    def __init__(self, cfg=None, display=True, max_hz=5.0, ema=0.95):
        if cfg is not None and not isinstance(cfg, TrainConfig):
            raise TypeError(f"Lab() takes a ddpkit.TrainConfig, got {type(cfg).__name__}; "
                            f"build one with ddpkit.TrainConfig(...)")
        if not max_hz > 0:
            raise ValueError(f"Lab(max_hz={max_hz!r}): figure updates per second must be > 0; "
                             f"pass e.g. max_hz=5")
        self.cfg = cfg or TrainConfig()
        self.history, self.metrics, self.findings = [], [], []
        self._pool = self._handle = self._refresher = None
        self._syncing = False
        self.plots = LivePlots(self.cfg.world_size, max_hz=max_hz, ema=ema)
        self.timeline = LiveTimeline(self.cfg.world_size, max_hz=1.0)  # [timeline] swimlanes
        self._build()
        self._read_config(self.cfg)
        self._update_estimate()
        if display:
            self.show()

    # ------------------------------------------------------------------ widgets
    def _build(self):
        """The widgets in four named steps: the config's controls, the run's widgets, what
        each one does when used, and where each sits."""
        self._build_controls()
        self._build_run_widgets()
        self._wire()
        self._lay_out()

    def _build_controls(self):
        """One control per config field the Lab edits, and one toggle per detected block."""
        c, n = self.cfg, self.cfg.n_blocks
        style = {"description_width": "110px"}
        full = lambda: W.Layout(width="auto", max_width="380px")
        self.controls = {
            "world_size": W.IntSlider(c.world_size, 1, 8, description="world size", style=style,
                                      layout=full()),
            "segments": W.IntSlider(0, 0, n, description="ckpt segments", style=style,
                                    layout=full(),
                                    tooltip="0 = off; s = checkpoint_sequential segments "
                                            "(the last segment is never checkpointed)"),
            "use_reentrant": W.Checkbox(c.use_reentrant, description="use_reentrant",
                                        indent=False),
            "accum_steps": W.IntSlider(c.accum_steps, 1, 16, description="accum steps",
                                       style=style, layout=full()),
            "micro_batch": W.IntSlider(c.micro_batch, 1, 64, description="micro batch",
                                       style=style, layout=full()),
            "precision": W.Dropdown(options=list(PRECISIONS), value=c.precision,
                                    description="precision", style=style, layout=full()),
            "no_sync": W.Checkbox(c.no_sync, description="no_sync", indent=False),
            "steps": W.BoundedIntText(c.steps, 1, 100_000, description="steps", style=style,
                                      layout=full()),
            **timeline_controls(c, style, full),  # [timeline] bucket size, simulated link
        }
        # one toggle per block the config found in the model (its full module name as tooltip)
        self.block_toggles = [W.ToggleButton(False, description=f"b{i}", tooltip=f"checkpoint {name}",
                                             layout=W.Layout(width="44px"))
                              for i, name in enumerate(block_names(c.blocks_path, range(n)))]
        from .plan_panel import PlanPanel

        self.planner = PlanPanel(self)  # a budget or a GPU in: the block toggles set to the plan

    def _build_run_widgets(self):
        """Buttons, progress, the estimate read-out, error banner, rank output, history."""
        self.smooth = W.Checkbox(bool(self.plots.ema), description="smoothed loss (EMA)",
                                 indent=False, disabled=not self.plots.ema)
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.torchrun_button = W.Button(description="copy as torchrun command", icon="terminal",
                                        layout=W.Layout(width="auto"))
        self.torchrun_text = W.Textarea(layout=W.Layout(width="100%", height="48px",
                                                        display="none"))
        self.progress = W.IntProgress(0, 0, self.cfg.steps, description="progress",
                                      style={"description_width": "110px"},
                                      layout=W.Layout(width="auto", max_width="380px"))
        self.progress_label = W.Label("", layout=W.Layout(width="100%"))
        self.estimate_html = W.HTML()
        self.banner = W.HTML()
        self.traceback = W.Accordion(children=[W.HTML()], layout=W.Layout(display="none"))
        self.traceback.set_title(0, "traceback")
        self.output = W.Output(layout=W.Layout(max_height="160px", overflow="auto"))
        self._out_box = W.Accordion(children=[self.output])
        self._out_box.set_title(0, "rank output")
        self.history_html = W.HTML()

    def _wire(self):
        for w in self.controls.values():
            w.observe(self._on_control, names="value")
        for t in self.block_toggles:
            t.observe(self._on_toggle, names="value")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.torchrun_button.on_click(lambda _: self._show_torchrun())
        self.smooth.observe(self._on_smooth, names="value")

    def _lay_out(self):
        # controls beside the plots when the cell is wide, above them when it is narrow
        # (a wrapping flex row); the plots fill the rest of the width in a grid (plots.py)
        box = lambda items: W.Box(items, layout=W.Layout(
            display="flex", flex_flow="row wrap", align_items="center"))
        left = W.VBox([*self.controls.values(), box(self.block_toggles), self.planner.widget,
                       box([self.run_button, self.stop_button]),
                       self.progress, self.progress_label, self.smooth, self.estimate_html,
                       self.torchrun_button, self.torchrun_text],
                      layout=W.Layout(flex="0 1 400px", min_width="320px", overflow="hidden"))
        right = W.Box([self.plots.widget],
                      layout=W.Layout(flex="1 1 600px", min_width="0", overflow="hidden"))
        main = W.Box([left, right], layout=W.Layout(display="flex", flex_flow="row wrap",
                                                    align_items="flex-start", width="100%",
                                                    grid_gap="8px"))
        self.widget = W.VBox([self.banner, self.traceback, main, self.timeline.widget, self._out_box,
                              self.history_html], layout=W.Layout(width="100%"))
        self.widget.add_class("ddpkit-lab")  # the browser test finds the lab by it

    def _on_smooth(self, change):
        for fig in (self.plots.loss,):
            with fig.batch_update():
                for tr in fig.data:
                    if tr.name and tr.name.endswith("EMA"):
                        tr.visible = change["new"]

    def show(self):
        try:
            from IPython.display import display
            display(self.widget)
        except ImportError:
            pass

    def _ipython_display_(self):
        self.show()

    # ------------------------------------------------------------------ config <-> widgets
    def _read_config(self, cfg):
        """Set the controls from a config (without sending anything mid-run)."""
        self._syncing = True
        try:
            setting = cfg.checkpoint
            self.controls["segments"].value = setting if isinstance(setting, int) else 0
            for t, on in zip(self.block_toggles, cfg.checkpointing.mask):
                t.value = on
            self._selective = isinstance(setting, (list, str))
        finally:
            self._syncing = False

    def checkpoint_setting(self):
        """What the controls say: None, an int (segments), or a list (per-block toggles)."""
        if self._selective:
            mask = [t.value for t in self.block_toggles]
            return mask if any(mask) else None
        s = self.controls["segments"].value
        return s or None

    def config(self):
        """The TrainConfig the controls describe (raises ValueError naming the field)."""
        v = {k: w.value for k, w in self.controls.items() if k != "segments"}
        v.update({k: v[k] or None for k in ("bucket_cap_mb", "link_gbps")})  # 0: torch's/none
        return self.cfg.replace(checkpoint=self.checkpoint_setting(), **v)

    def _on_control(self, change):
        if self._syncing:
            return
        if change["owner"] is self.controls["segments"]:
            self._selective = False
            self._syncing = True
            try:
                mask = CheckpointSetting.of(self.checkpoint_setting(), self.cfg.n_blocks).mask
                for t, on in zip(self.block_toggles, mask):
                    t.value = on
            finally:
                self._syncing = False
        self._update_estimate()
        self._send_live()

    def _on_toggle(self, change):
        if self._syncing:
            return
        self._selective = True
        self._update_estimate()
        self._send_live()

    def set(self, **settings):
        """Move controls from code, as a person would (``lab.set(segments=2, accum_steps=4)``)."""
        for name, value in settings.items():
            if name == "checkpoint":
                self._read_config(self.cfg.replace(checkpoint=value))
                self._update_estimate()
                self._send_live()
            else:
                self.controls[name].value = value

    def _send_live(self):
        if not self.running:
            return
        try:
            cfg = self.config()  # only settings that make a valid config are sent
        except ValueError:
            return
        self._handle.send_control(checkpoint=cfg.checkpoint, accum_steps=cfg.accum_steps)

    def _update_estimate(self):
        try:
            cfg = self.config()
        except ValueError as exc:
            self.estimate_html.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            self.run_button.disabled = True
            return
        e = estimate(cfg)
        self.estimate_html.value = (
            f"<div style='line-height:1.35'><b>predicted per rank</b>: params "
            f"{fmt_bytes(e.params)}, grads {fmt_bytes(e.grads)}, optimizer "
            f"{fmt_bytes(e.optimizer)}, activations {fmt_bytes(e.activations)} (one "
            f"micro-batch); total {fmt_bytes(e.total)}</div>")
        self.run_button.disabled = self.running

    def _show_torchrun(self):
        try:
            self.torchrun_text.value = self.config().to_torchrun()
        except ValueError as exc:  # a notebook-defined model has no import path
            self.torchrun_text.value = str(exc)
        self.torchrun_text.layout.display = ""

    # ------------------------------------------------------------------ running
    @property
    def running(self):
        return self._handle is not None and not self._handle.done

    def run(self):
        """Start a run of the current config; returns at once (see ``wait``)."""
        from ..runtime.pool import Pool
        from .api import train

        if self.running or (self._refresher is not None and self._refresher.is_alive()):
            raise RuntimeError("a run is already going in this lab; stop() or wait() first")
        cfg = self.config()
        if self._pool is None or self._pool.world_size != cfg.world_size:
            if self._pool is not None:
                self._pool.close()
            self._pool = Pool(cfg.world_size, cfg.backend, cfg.device)
        self.metrics, self._rank0_steps = [], 0
        self.banner.value, self.traceback.layout.display = "", "none"
        from .api import check_config
        self.findings = check_config(cfg)
        if self.findings:
            items = "".join(f"<li><b>{html.escape(f.pitfall)}</b> at {html.escape(f.where)}: "
                            f"{html.escape(f.message)} <i>Fix: {html.escape(f.fix)}</i></li>"
                            for f in self.findings)
            self.banner.value = (f"<div style='background:#fff4d6;border-left:6px solid #d90;"
                                 f"padding:6px'><b>ddpkit.doctor</b><ul>{items}</ul></div>")
        self.output.clear_output()
        self.plots.new_run(cfg.world_size, predict=lambda rec: activation_bytes(
            cfg, CheckpointSetting.parse(rec["checkpoint"], cfg.n_blocks).plain), label=f"run {len(self.history)}")
        self.timeline.new_run(cfg.world_size, link_label(cfg))  # [timeline]
        self.progress.max, self.progress.value = cfg.steps, 0
        self._set_running(True)
        self._t0 = time.monotonic()
        self._handle = train(cfg, pool=self._pool, block=False, live=True, check=False,
                             on_metric=self._on_metric, on_output=self._on_output)
        self._refresher = threading.Thread(target=self._follow, args=(cfg, self._handle),
                                           name="ddpkit-lab", daemon=True)
        self._refresher.start()
        return self._handle

    def _on_metric(self, record):
        self.metrics.append(record)
        self._rank0_steps += record["rank"] == 0
        self.plots.add(record)
        self.timeline.add(record)  # [timeline]

    def _on_output(self, rank, line):
        self.output.append_stdout(f"[rank {rank}] {line}\n")

    def _follow(self, cfg, handle):
        # one wake-up per allowed figure update: each widget change is a message to the
        # browser, and the kernel shares the cores with the ranks
        period, shown = 1.0 / self.plots.max_hz, 0.0
        while not handle.done:
            handle.join(period)
            # the progress bar and its label: twice a second is enough to read them
            self.timeline.flush()  # [timeline] at most once a second
            if self.plots.flush(force=True) and time.monotonic() - shown >= 0.5:
                self._update_progress(cfg)
                shown = time.monotonic()
        self.plots.flush(force=True)
        self.timeline.flush(force=True)  # [timeline]
        self.plots.sync()  # the figures' own state gets the points, for a re-rendered view
        self._update_progress(cfg)
        self._finish(cfg, handle)

    def _update_progress(self, cfg):
        done = self._rank0_steps
        self.progress.value = done
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (cfg.steps - done) if done else float("nan")
        self.progress_label.value = (f"step {done} of {cfg.steps}" +
                                     (f", about {eta:.0f} s to go" if done else ""))

    def _finish(self, cfg, handle):
        error = handle.error
        status = "error" if error else ("stopped" if handle.result and handle.result.stopped else "ok")
        from .api import summarize

        m0 = [m for m in self.metrics if m["rank"] == 0]
        s = summarize(self.metrics) if m0 else {}
        row = {"run": len(self.history), "status": status, "steps_done": len(m0),
               "final_loss": s.get("final_loss"), "peak_bytes": s.get("peak_bytes"),
               # the last step's, not the median: checkpointing may have changed mid-run
               "activation_bytes": m0[-1].get("activation_bytes") if m0 else None,
               "step_time_s": s.get("step_time_s"),
               "wall_s": round(time.monotonic() - self._t0, 3),
               "changes": [(m["step"], m["changed"]) for m in m0 if m.get("changed")],
               "config": cfg.to_dict(), "error": str(error) if error else None}
        self.history.append(row)
        if error is not None:
            self._show_error(error)
        self._render_history()
        self._set_running(False)

    def _show_error(self, error):
        if isinstance(error, RankError):
            head = f"rank {error.rank} failed: {error.exc_type}: {error.message}"
            tb = error.traceback
        elif isinstance(error, RankStalled):
            head, tb = str(error).split(";")[0], str(error)
        else:
            head, tb = f"{type(error).__name__}: {error}", ""
        self.banner.value = (f"<div style='background:#fdd;border-left:6px solid #c00;"
                             f"padding:6px'><b>{html.escape(head)}</b></div>")
        self.traceback.children[0].value = f"<pre>{html.escape(tb)}</pre>"
        self.traceback.layout.display = "" if tb else "none"

    def _render_history(self):
        cols = ["run", "status", "steps_done", "final_loss", "peak_bytes", "activation_bytes",
                "step_time_s", "wall_s", "changes"]
        heads = ["run", "status", "steps", "final loss", "peak", "activations", "step ms",
                 "wall s", "changes"]

        def fmt(c, v):
            if c in ("peak_bytes", "activation_bytes"):
                return fmt_bytes(v)
            if c == "step_time_s" and v is not None:
                return f"{1000 * v:.2f}"
            return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))
        rows = "".join("<tr>" + "".join(f"<td>{fmt(c, r[c])}</td>" for c in cols) + "</tr>"
                       for r in self.history)
        self.history_html.value = (f"<div style='overflow-x:auto'><table><tr>"
                                   f"{''.join(f'<th>{h}</th>' for h in heads)}</tr>"
                                   f"{rows}</table></div>")

    def _set_running(self, on):
        for name in ("world_size", "precision", "micro_batch", "steps", "use_reentrant", "no_sync",
                     "bucket_cap_mb", "link_gbps"):  # a new DDP wrapper: fixed mid-run
            w = self.controls[name]
            w.disabled = on
            w.tooltip = FIXED_TIP if on else ""
        self.run_button.disabled = on
        self.stop_button.disabled = not on

    def wait(self, timeout=None):
        """Block until the current run ends and its history row is written; returns the row."""
        if self._refresher is None:
            return None
        self._refresher.join(timeout)
        if self._refresher.is_alive():
            raise TimeoutError(f"run still going after {timeout}s; call stop() to end it")
        return self.history[-1]

    def stop(self):
        """End the current run now; the row says 'stopped'."""
        if self._handle is not None and not self._handle.done:
            self._handle.stop()
        return self.wait()

    def close(self):
        """Stop any run and end the lab's warm ranks."""
        self.stop()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
