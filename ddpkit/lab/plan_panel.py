"""The Lab's planner box: a memory budget (or a GPU) in, `ddpkit.plan`'s choice out, the
predicted bytes and FLOP ratio shown. It knows nothing of the Lab: it plans for the config
``describe()`` gives and reports a plan that fits to ``on_plan`` (the Lab sets its checkpoint
controls to it, as a person would)."""
from __future__ import annotations

import html

import ipywidgets as W

from ..predict.gpus import GPUS, parse_bytes
from ..predict.plan import plan
from ..predict.units import MIB

NO_GPU = "(budget)"


class PlanPanel:
    def __init__(self, describe, on_plan):
        self.describe, self.on_plan = describe, on_plan
        self.budget = W.Text(placeholder="e.g. 12GiB", description="memory budget",
                             continuous_update=False, style={"description_width": "110px"},
                             layout=W.Layout(width="230px"))
        self.gpu = W.Dropdown(options=[NO_GPU, *GPUS], value=NO_GPU, description="or GPU",
                              style={"description_width": "56px"}, layout=W.Layout(width="170px"))
        self.readout = W.HTML()
        self.last = None  # the last Plan, for code and tests
        self.budget.observe(lambda _: self.apply(), names="value")
        self.gpu.observe(lambda _: self.apply(), names="value")
        row = W.Box([self.budget, self.gpu], layout=W.Layout(display="flex", flex_flow="row wrap"))
        self.widget = W.VBox([row, self.readout])

    def apply(self):
        """Plan for what the boxes say; a plan that fits goes to ``on_plan``."""
        gpu, text = self.gpu.value, self.budget.value.strip()
        if gpu == NO_GPU and not text:
            self.readout.value = ""
            return None
        try:
            budget = gpu if gpu != NO_GPU else parse_bytes(text)
            p = plan(self.describe(), budget)
        except ValueError as exc:
            self.readout.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            return None
        self.last = p
        if p.choice is None:
            alts = "".join(f"<li>{html.escape(a['change'])}: {a['predicted'] / MIB:.2f} MiB"
                           f"{' (fits)' if a['fits'] else ''}</li>" for a in p.alternatives)
            self.readout.value = (f"<b>nothing fits {p.budget / MIB:.2f} MiB</b> "
                                  f"({html.escape(p.memory_note)}) with any checkpoint choice; "
                                  f"instead:<ul>{alts}</ul>")
            return p
        self.on_plan(p)
        c = p.choice
        self.readout.value = (f"plan: {sum(c.mask)} of {len(c.mask)} blocks checkpointed, "
                              f"{c.total / MIB:.2f} MiB of {p.budget / MIB:.2f} MiB per rank "
                              f"({html.escape(p.memory_note)}), FLOP ratio {c.flops_ratio:.3f}")
        return p
