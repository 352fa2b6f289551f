"""Figures that fit their box whenever the box changes, not only when the window does.

A plotly ``FigureWidget`` with ``autosize`` takes its div's width when it is drawn, and after that
only on the window's ``resize`` event (plotly's ``responsive`` config). A view drawn before its
div is laid out (a fresh Lab output, a figure added to a box later) gets plotly's
default of 700 px and keeps it until the window is resized: in a 490 px grid column (a
1920 px window) it spills over its neighbour, in an 848 px one it leaves a gap. Opening
JupyterLab's side panel or dragging a split changes the box and sends no window event at all.

`opened(fig)` makes a figure responsive (`figure(layout)` makes one so). One small anywidget per kernel (`_Fitter`, never
displayed: a front-end model runs its ``initialize`` when it is created) keeps every responsive
plot of the page at its box's width, ddpkit's or not, through the handler plotly gave it for the
window's event: responsive is taken to mean what a reader expects of it. A figure with a fixed
width is left as it is. The plots are found by what plotly drew (a plot div whose config is
responsive), not by a class: ipywidgets adds a view's classes only once the view is attached,
and one view drawn in a test run never got them. A ``ResizeObserver`` on each plot answers a
change of its box at once; a check twice a second catches what an observer never reports (a
plot redrawn at another width in a box that stayed), retrying a plot at most once a second.
A plot in a cell the page skips (JupyterLab's ``content-visibility``) is fitted when shown.
A redraw takes the div's height too, so `grid`, which holds these figures, aligns its items at
the start (a stretched grid item would make a plot as tall as the tallest in its row).

A figure's comm opens only when the figure is whole (`held`, then `opened`): its layout, first
traces, config and classes go in the one message that opens it. A plain ``FigureWidget`` opens
its comm empty and sends its layout and config after, in later messages. JupyterLab 4.6 sends
a widget's comm messages on a subshell of the kernel, so when a page (re)connects, the
kernel answers its ``request_states`` on another thread while the cell still runs. That
snapshot can hold a figure half made: layout ``{}``, no config. The page applies it after the
figure's own later messages, and draws a blank plot, 700 px wide and never fitted. This is
seen in `tests/browser`; ``bench/widget_race.py`` catches such a snapshot in a kernel.
Plotly keeps that state (``_widget_layout``, ``_widget_data``) as the figure was made, and so a
late snapshot undid a figure's changes: a swimlane figure drawn after one showed no bars. Here
it follows each change the figure sends (the live points the feeder draws are written into the
figure when a run ends, `LivePlots.sync`).
"""
from __future__ import annotations

import copy
import hashlib
import json

import anywidget


class _Fitter(anywidget.AnyWidget):
    _esm = """
    // one watcher per page, whichever kernel's fitter comes first; a newer ddpkit's replaces an
    // older one's (a kernel restarted on a new version, the page not reloaded)
    const VERSION = 2;
    function initialize({ model }) {
      const old = window.__ddpkitFit;
      if (old && old.version >= VERSION) return;
      if (old !== undefined) clearInterval(typeof old === 'number' ? old : old.id);
      const plots = document.getElementsByClassName('js-plotly-plot');  // live, no layout
      const observed = new Set();
      // a responsive, autosized plot whose drawn width is not its box's: redrawn through the
      // handler of the plotly.js that drew it (the page may hold two), which skips a hidden plot
      function fit(gd, now) {
        const svg = gd.querySelector('.main-svg'), handler = gd._responsiveChartHandler;
        // a fixed width, or a config plotly sizes by other rules: not this watcher's to fit
        const c = gd._context || {};
        if (!svg || !handler || (gd.layout && gd.layout.width)) return;
        if (c.fillFrame || c.frameMargins) return;
        if (gd.checkVisibility && !gd.checkVisibility({contentVisibilityAuto: true})) return;
        // the width plotly itself reads when it sizes an autosized plot
        const w = parseFloat(getComputedStyle(gd).width);
        const drawn = parseFloat(svg.getAttribute('width'));
        // (plotly draws 10 px at the least, and fits to within 1 px)
        if (!(w >= 10 && drawn > 0 && Math.abs(drawn - w) > 1)) return;
        if (now !== undefined && now < (gd.__ddpkitFitAt || 0)) return;  // a retry: once a second
        gd.__ddpkitFitAt = performance.now() + 1000;
        handler();
      }
      const onResize = new ResizeObserver(entries => { for (const e of entries) fit(e.target); });
      const id = setInterval(() => {
        const now = performance.now();
        for (const gd of observed) {
          if (!gd.isConnected) { onResize.unobserve(gd); observed.delete(gd); }
        }
        for (const gd of plots) {
          if (!(gd._context && gd._context.responsive)) continue;
          if (!observed.has(gd)) { observed.add(gd); onResize.observe(gd); }
          fit(gd, now);
        }
      }, 500);
      window.__ddpkitFit = {version: VERSION, id: id};
    }
    export default { initialize };
    """


_fitter = None
_Figure = None


def _figure_class():
    """`HeldFigureWidget`, made when the first figure is (plotly is imported then)."""
    global _Figure
    if _Figure is None:
        import plotly.graph_objects as go

        class HeldFigureWidget(go.FigureWidget):
            """A ``FigureWidget`` whose comm stays closed, made with ``held=True``, until
            `opened`: ipywidgets opens a comm in ``__init__``; this one waits until it is
            whole. Made without ``held`` (plotly's own copies), it is a plain FigureWidget.
            Its front end is plotly's, loaded once per page (`shared_esm`)."""

            _esm = shared_esm(go.FigureWidget._esm)

            def __init__(self, *args, held=False, **kwargs):
                self._held = held  # read by open(), which ipywidgets' __init__ calls
                super().__init__(*args, **kwargs)

            def open(self):
                if not self._held:
                    super().open()

            def send_state(self, key=None):
                super().send_state(key)
                # plotly keeps the state a page is handed (a page that connects or reloads
                # mid-run asks for every widget's) as the figure was made; each change goes as
                # a message of its own (``_py2js_*``, set then reset to None). Once one is sent,
                # that state is the figure as it is now, set without sending (the page had the
                # message), on the thread that changed the figure, and replaced, never edited
                if isinstance(key, str) and key.startswith("_py2js_") and \
                        getattr(self, key) is None:
                    self._keep_state()

            def _keep_state(self):
                """The state a page is handed (``_widget_layout``, ``_widget_data``): the
                figure as it is now, set without a message, replaced and never edited."""
                try:
                    layout = copy.deepcopy(self._layout_obj._props)
                    data = copy.deepcopy(self._data)
                except RuntimeError:  # changed by another thread meanwhile: its own message
                    return  # takes the figure as it is then
                self._trait_values["_widget_layout"] = layout
                self._trait_values["_widget_data"] = data

            def _repr_mimebundle_(self, *args, **kwargs):
                if self._held:
                    raise RuntimeError("this figure is held (ddpkit.lab.fit.held): nothing "
                                       "is sent until fit.opened(fig); call that first")
                return super()._repr_mimebundle_(*args, **kwargs)

        _Figure = HeldFigureWidget
    return _Figure


def shared_esm(esm):
    """Plotly's widget module (``esm``: its five megabytes of source) as a module that the page
    imports once and every figure of it reuses. anywidget imports each model's module anew and
    gives the model two seconds to load and start it; past that it drops every later message to
    the model ("[anywidget] Failed to initialize model": a plot that never updates). A Lab made
    six figures at once, six imports of plotly on the page's one thread: under load they took
    17 s (one import 2.6 s) and the plots stayed blank. Shared, a page pays plotly once: a Lab
    shown again (the cell run again) starts at once."""
    source = str(esm)
    key = "__ddpkitPlotly_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    return (f"// plotly's widget module, imported once per page and shared by every figure\n"
            f"const key = {json.dumps(key)};\n"
            f"const source = {json.dumps(source)};\n"
            "window[key] ??= import(URL.createObjectURL(new Blob([source], "
            "{type: 'text/javascript'})));\n"
            "export default (await window[key]).default;\n")


def held(layout):
    """A figure of ``layout`` whose comm is not open yet: add its first traces, then `opened`.
    Until then nothing it does is sent (there is no page to send it to)."""
    return _figure_class()(layout=layout, held=True)


def opened(fig, classes=()):
    """``fig`` (from `held`), responsive and with ``classes``, its comm opened with all of it
    (layout, traces, config, classes) in the opening message; the page's fitter redraws it at
    its box's width whenever that changes (through the handler plotly gives a responsive plot)."""
    global _fitter
    if _fitter is None or _fitter.comm is None:  # none yet, or closed (Widget.close_all)
        _fitter = _Fitter()
    fig._config = {"responsive": True, "displaylogo": False}
    fig._dom_classes = tuple(classes)
    fig._keep_state()  # what plotly's own __init__ sends after its comm opened: as it is now
    fig._held = False
    fig.open()
    return fig


def figure(layout, classes=()):
    """A responsive figure of ``layout`` with no traces yet, opened whole (`held`, `opened`)."""
    return opened(held(layout), classes)


def grid(children):
    """A grid of figures (and widgets beside them) that fills the cell's width: as many 440 px
    or wider columns as fit, each item as tall as itself."""
    import ipywidgets as W

    return W.GridBox(children, layout=W.Layout(
        grid_template_columns="repeat(auto-fill, minmax(440px, 1fr))", grid_gap="4px 8px",
        width="100%", align_items="flex-start"))
