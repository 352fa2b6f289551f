"""The Lab's controls, one row each (`CONTROLS`): the config field a control sets, its widget
(made showing a config), how the widget's value becomes the field's value and back, whether it
may change while a run goes, and how such a change reads on the plots.

Every part of the Lab reads this table and nothing else about its controls: the view makes the
widgets from it (and disables the rows that are not ``live`` while a run goes), the sync reads
the widgets into a config and sends the live fields to the ranks, the ranks' `LiveSettings`
apply the fields sent (the same step on every rank), and the plots label the step a change
landed on with its row's ``mark``. Adding a control is adding a row (README, "Layout").

The per-block checkpoint control (`blocks.BlockControl`) edits the same field as the segments
row, ``checkpoint``: whichever a person edited last is the Lab's (`sync.ConfigSync`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ipywidgets as W

from ..spec.names import PRECISIONS

STYLE = {"description_width": "110px"}
BUCKET_MIB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
LINKS = (("loopback (real)", 0.0), ("100 Gbit/s (simulated)", 100.0),
         ("10 Gbit/s (simulated)", 10.0), ("1 Gbit/s (simulated)", 1.0))


def _layout():
    return W.Layout(width="auto", max_width="380px")


@dataclass(frozen=True)
class Control:
    """One control of the Lab. ``widget(cfg, value)`` makes it showing ``value``;
    ``to_config(value, cfg)``: the field's value for the widget's (``cfg``: the config being
    described, for what the field is bound to); ``from_config(cfg)``: the widget's value for a
    config (None: the field as it is); ``live``: it may change mid-run; ``mark(value,
    setting)``: how a change of the field reads on the plots (``value`` as a record carries it,
    ``setting`` the run's checkpoint setting; None: the field's name)."""
    name: str
    field: str
    widget: Callable
    to_config: Callable = None
    from_config: Callable = None
    live: bool = False
    mark: Callable = None

    def shown(self, cfg):
        """The widget's value for ``cfg``."""
        return getattr(cfg, self.field) if self.from_config is None else self.from_config(cfg)

    def make(self, cfg):
        return self.widget(cfg, self.shown(cfg))

    def value(self, widget_value, cfg):
        """The field's value for the widget's."""
        return widget_value if self.to_config is None else self.to_config(widget_value, cfg)


def slider(description, low, high):
    return lambda cfg, v: W.IntSlider(v, low, high, description=description, style=STYLE,
                                      layout=_layout())


def checkbox(description):
    return lambda cfg, v: W.Checkbox(v, description=description, indent=False)


def _segments(cfg, v):
    # segments are made in each stack: at most the shortest stack's blocks
    return W.IntSlider(v, 0, min(cfg.checkpoint.stacks), description="ckpt segments",
                       style=STYLE, layout=_layout(),
                       tooltip="0 = off; s = checkpoint_sequential segments in each stack (the "
                               "last segment is never checkpointed)")


def _with_value_of(value, label, options):
    """``options`` and, when ``value`` is none of them, ``value`` as its own option."""
    return options + ([(label, value)] if value and value not in dict(options).values() else [])


def _bucket(cfg, v):
    caps = _with_value_of(v, f"{v:g}", [("torch default", 0.0)] +
                          [(f"{b:g}", float(b)) for b in BUCKET_MIB])
    return W.SelectionSlider(options=caps, value=v, description="bucket MiB", style=STYLE,
                             layout=_layout())


def _link(cfg, v):
    links = _with_value_of(v, f"{v:g} Gbit/s (simulated)", list(LINKS))
    return W.Dropdown(options=links, value=v, description="link", style=STYLE, layout=_layout())


def _zero_is_none(value, cfg):
    return value or None


CONTROLS = [
    Control("world_size", "world_size", slider("world size", 1, 8)),
    # 0 on the slider is no checkpointing; the setting is bound to the config's stacks
    Control("segments", "checkpoint", _segments,
            to_config=lambda v, cfg: cfg.checkpoint.with_value(v or None),
            from_config=lambda cfg: cfg.checkpoint.segment_count or 0, live=True,
            mark=lambda v, setting: setting.with_value(v).label()),
    Control("use_reentrant", "use_reentrant", checkbox("use_reentrant")),
    Control("accum_steps", "accum_steps", slider("accum steps", 1, 16), live=True,
            mark=lambda v, setting: f"accum {v}"),
    Control("micro_batch", "micro_batch", slider("micro batch", 1, 64)),
    Control("precision", "precision",
            lambda cfg, v: W.Dropdown(options=list(PRECISIONS), value=v, description="precision",
                                      style=STYLE, layout=_layout())),
    Control("no_sync", "no_sync", checkbox("no_sync")),
    Control("steps", "steps",
            lambda cfg, v: W.BoundedIntText(v, 1, 100_000, description="steps", style=STYLE,
                                            layout=_layout())),
    # [timeline] DDP's bucket size (0: torch's default, 25 MiB) and the simulated link (0: the
    # real transport); both make a new DDP wrapper, so they are fixed while a run goes
    Control("bucket_cap_mb", "bucket_cap_mb", _bucket, to_config=_zero_is_none,
            from_config=lambda cfg: float(cfg.bucket_cap_mb or 0)),
    Control("link_gbps", "link_gbps", _link, to_config=_zero_is_none,
            from_config=lambda cfg: float(cfg.link_gbps or 0)),
]


def control(name):
    """The row of the control named ``name``."""
    return next(c for c in CONTROLS if c.name == name)


def live_fields():
    """The config fields a run takes mid-run: what the Lab sends its ranks."""
    return list(dict.fromkeys(c.field for c in CONTROLS if c.live))


def change_text(rec, setting=None):
    """A short label for a mid-run change: 'step 12: 2 segments per stack', 'step 30: accum 4':
    each changed field as its control's row marks it (``setting``: the run's checkpoint
    setting, whose stacks a checkpoint change is read on)."""
    marks = {c.field: c.mark for c in CONTROLS if c.mark is not None}
    parts = []
    for field in rec["changed"].split(","):
        mark = marks.get(field)
        if mark is None or (field == "checkpoint" and setting is None):
            parts.append(field)
        else:
            parts.append(mark(rec.get(field, "?"), setting))
    return f"step {rec['step']}: " + ", ".join(parts)
