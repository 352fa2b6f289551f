"""The Lab's per-block checkpoint control, for 4 blocks or 80: a range "blocks i to j, every k-th"
with two buttons (checkpoint them, clear them), and one small toggle per block in a grid of ten
columns (a row per ten blocks, so block 37 sits in row 3, column 7), each named as the model names
it (``transformer.h.37``) in its tooltip. A line above says what is checkpointed
(`CheckpointSetting.label`).

The control only edits a `CheckpointSetting`: `setting()` reads it, `show(setting)` sets it
(quietly), and a person's edit (a toggle, a button) calls the ``on_change`` callbacks with the
new setting, once per edit. The blocks come as *stacks* (``[(path, names)]``), each with its own
header and grid; the toggles are one flat list in model order, as the setting counts blocks
(T5's encoder and decoder: two stacks, two grids).
"""
from __future__ import annotations

import html

import ipywidgets as W

from ..spec.setting import CheckpointSetting

COLUMNS = 10  # toggles per row: a row per ten blocks, so a block's row and column read its index
STYLE = {"description_width": "110px"}


class BlockControl:
    """Which blocks are checkpointed. ``stacks``: ``[(path, [block name, ...]), ...]``."""

    def __init__(self, stacks, setting=None):
        self.stacks = [(path, list(names)) for path, names in stacks]
        self.sizes = tuple(len(names) for _, names in self.stacks)  # what a setting is bound to
        n = sum(self.sizes)
        # made showing ``setting`` (none: no block checkpointed), so that each widget's comm
        # opens with its whole state (fit.py says why a later change can be lost on a page)
        setting = setting if setting is not None else CheckpointSetting(None, self.sizes)
        mask = list(setting.mask) + [False] * n
        self.toggles, grids = [], []
        for path, names in self.stacks:
            first = len(self.toggles)
            mine = [W.ToggleButton(mask[first + i], description=name.rsplit(".", 1)[-1],
                                   tooltip=f"checkpoint {name}",
                                   button_style="info" if mask[first + i] else "",
                                   layout=W.Layout(width="auto", height="24px", padding="0",
                                                   margin="0"))
                    for i, name in enumerate(names)]
            self.toggles += mine
            grids.append(self._grid(path, mine, several=len(self.stacks) > 1))
        self._callbacks, self._quiet = [], False
        self.summary = W.HTML(self._text(setting), layout=W.Layout(margin="0 0 2px 4px"))
        self.range = W.IntRangeSlider(value=(0, max(n - 1, 0)), min=0, max=max(n - 1, 0),
                                      description="ckpt blocks", continuous_update=False,
                                      style=STYLE, layout=W.Layout(width="auto",
                                                                   max_width="380px"))
        self.every = W.BoundedIntText(1, min=1, max=max(n, 1), description="every",
                                      style=STYLE, layout=W.Layout(width="170px"))
        self.on_button = W.Button(description="checkpoint", icon="check",
                                  tooltip="checkpoint the blocks the range and 'every' pick",
                                  layout=W.Layout(width="auto"))
        self.off_button = W.Button(description="clear", icon="times",
                                   tooltip="stop checkpointing the blocks the range and "
                                           "'every' pick", layout=W.Layout(width="auto"))
        self.on_button.on_click(lambda _: self._pick(True))
        self.off_button.on_click(lambda _: self._pick(False))
        for t in self.toggles:
            t.observe(lambda change: self._paint(change["owner"]), names="value")
            t.observe(self._on_toggle, names="value")
        row = W.Box([self.every, self.on_button, self.off_button],
                    layout=W.Layout(display="flex", flex_flow="row wrap", align_items="center"))
        self.widget = W.VBox([self.summary, self.range, row, *grids],
                             layout=W.Layout(width="100%"),
                             _dom_classes=["ddpkit-blocks"])  # the browser test finds it so

    @staticmethod
    def _grid(path, toggles, several):
        """One stack's toggles, ten to a row (each cell as wide as a tenth of the column, never
        less than its label); a header names the stack where there are several."""
        grid = W.GridBox(toggles, layout=W.Layout(
            grid_template_columns=f"repeat({COLUMNS}, minmax(28px, 1fr))", grid_gap="2px",
            width="100%"))
        if not several:
            return grid
        head = W.HTML(f"<code>{html.escape(path)}</code>: {len(toggles)} blocks")
        return W.VBox([head, grid])

    def on_change(self, callback):
        """``callback(setting)`` after each edit a person makes (not after `show`)."""
        self._callbacks.append(callback)

    def setting(self):
        """The per-block setting the toggles show (all off: no checkpointing)."""
        return CheckpointSetting.from_mask([t.value for t in self.toggles], self.sizes)

    def show(self, setting):
        """Set the toggles and the line above them to ``setting`` (any form: segments too, as the
        blocks they cover), telling no one."""
        self._quiet = True
        try:
            for t, on in zip(self.toggles, setting.mask):
                t.value = on
        finally:
            self._quiet = False
        self._say(setting)

    @staticmethod
    def _paint(toggle):
        # a checkpointed block in colour: a pressed toggle alone is a shade of grey
        toggle.button_style = "info" if toggle.value else ""

    def picked(self):
        """The block indices the range and 'every' pick: i, i+k, ... up to j."""
        (i, j), k = self.range.value, max(int(self.every.value), 1)
        return range(i, j + 1, k)

    def _say(self, setting):
        self.summary.value = self._text(setting)

    @staticmethod
    def _text(setting):
        return (f"<b>checkpointed</b>: {html.escape(setting.label())} "
                f"<span style='color:#666'>({sum(setting.mask)} of {setting.n_blocks} "
                f"blocks)</span>")

    def _pick(self, on):
        mask = [t.value for t in self.toggles]
        for i in self.picked():
            mask[i] = on
        setting = CheckpointSetting.from_mask(mask, self.sizes)
        self.show(setting)
        self._tell(setting)

    def _on_toggle(self, change):
        if self._quiet:
            return
        setting = self.setting()
        self._say(setting)
        self._tell(setting)

    def _tell(self, setting):
        for callback in self._callbacks:
            callback(setting)
