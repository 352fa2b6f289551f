"""The Lab's widgets, built and laid out: one per row of the control table
(`controls.CONTROLS`), the per-block checkpoint control (`blocks.BlockControl`), the planner
box, the run's buttons and read-outs. Nothing here acts: `lab.Lab` wires them to what they do."""
from __future__ import annotations

import ipywidgets as W

from ..spec.blocks import block_names
from .blocks import BlockControl
from .controls import CONTROLS

FIXED_TIP = "fixed while a run goes: it needs new processes or a new model (Stop first)"


class LabView:
    """Every widget of a Lab for ``cfg``; ``widget`` is the whole dashboard. ``plots``: the
    `LivePlots` shown beside the controls; ``planner``: the planner box (`PlanPanel`)."""

    def __init__(self, cfg, plots, planner, timeline=None, readout=None):
        # every widget is made showing ``cfg``, and the read-out what ``readout(view)`` says of
        # the controls (`sync.readout`), so that its comm opens with its whole state: a page
        # that asks the kernel for every widget's state while the cell runs can be handed a
        # widget as it was when its comm opened, after the changes that followed (fit.py)
        self.plots, self.planner, self.timeline = plots, planner, timeline
        self._build_controls(cfg)
        text, ok = ("", True) if readout is None else readout(self)
        self._build_run_widgets(cfg, text, ok)
        self._lay_out()

    def _build_controls(self, c):
        """One widget per row of the control table, and the per-block control (one toggle per
        detected block, named as the model names it)."""
        self.controls = {row.name: row.make(c) for row in CONTROLS}
        # the blocks the config found in the model, stack by stack (their full module names as
        # tooltips), counted over all stacks in order
        self.blocks = BlockControl([(s.path, block_names([(s.path, s.n_blocks)]))
                                    for s in c.info.stacks], c.checkpoint)
        self.block_toggles = self.blocks.toggles

    def _build_run_widgets(self, cfg, readout, ok):
        """Buttons, progress, the estimate read-out, error banner, rank output, history."""
        self.smooth = W.Checkbox(bool(self.plots.ema), description="smoothed loss (EMA)",
                                 indent=False, disabled=not self.plots.ema)
        self.run_button = W.Button(description="Run", button_style="success", icon="play",
                                   disabled=not ok)
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.torchrun_button = W.Button(description="copy as torchrun command", icon="terminal",
                                        layout=W.Layout(width="auto"))
        self.torchrun_text = W.Textarea(layout=W.Layout(width="100%", height="48px",
                                                        display="none"))
        self.progress = W.IntProgress(0, 0, cfg.steps, description="progress",
                                      style={"description_width": "110px"},
                                      layout=W.Layout(width="auto", max_width="380px"))
        self.progress_label = W.Label("", layout=W.Layout(width="100%"))
        self.estimate_html = W.HTML(readout)
        self.banner = W.HTML()
        self.traceback = W.Accordion(children=[W.HTML()], titles=("traceback",),
                                     layout=W.Layout(display="none"))
        self.output = W.Output(layout=W.Layout(max_height="160px", overflow="auto"))
        self._out_box = W.Accordion(children=[self.output], titles=("rank output",))
        self.history_html = W.HTML()

    def _lay_out(self):
        # controls beside the plots when the cell is wide, above them when it is narrow
        # (a wrapping flex row); the plots fill the rest of the width in a grid (plots.py)
        box = lambda items: W.Box(items, layout=W.Layout(  # noqa: E731
            display="flex", flex_flow="row wrap", align_items="center"))
        left = W.VBox([*self.controls.values(), self.blocks.widget, self.planner.widget,
                       box([self.run_button, self.stop_button]),
                       self.progress, self.progress_label, self.smooth, self.estimate_html,
                       self.torchrun_button, self.torchrun_text],
                      layout=W.Layout(flex="0 1 400px", min_width="320px", overflow="hidden"))
        right = W.Box([self.plots.widget],
                      layout=W.Layout(flex="1 1 600px", min_width="0", overflow="hidden"))
        main = W.Box([left, right], layout=W.Layout(display="flex", flex_flow="row wrap",
                                                    align_items="flex-start", width="100%",
                                                    grid_gap="8px"))
        lanes = [self.timeline.widget] if self.timeline is not None else []  # [timeline]
        self.widget = W.VBox([self.banner, self.traceback, main, *lanes, self._out_box,
                              self.history_html], layout=W.Layout(width="100%"),
                             _dom_classes=["ddpkit-lab"])  # the browser test finds the lab so

    def set_running(self, on):
        """Controls that cannot change mid-run (not ``live`` in the table) are disabled
        meanwhile, with the reason."""
        for row in CONTROLS:
            if not row.live:
                w = self.controls[row.name]
                w.disabled = on
                w.tooltip = FIXED_TIP if on else ""
        self.run_button.disabled = on
        self.stop_button.disabled = not on
