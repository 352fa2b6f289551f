"""Figures that fit their box whenever the box changes, not only when the window does.

A plotly ``FigureWidget`` with ``autosize`` takes its div's width when it is drawn, and after that
only on the window's ``resize`` event (plotly's ``responsive`` config). A view drawn before its
div is laid out (a fresh Lab output, a figure added to a box later) gets plotly's
default of 700 px and keeps it until the window is resized: in a 490 px grid column (a
1920 px window) it spills over its neighbour, in an 848 px one it leaves a gap. Opening
JupyterLab's side panel or dragging a split changes the box and sends no window event at all.

`fitted(fig)` makes a figure responsive and marks it. One small anywidget per kernel (`_Fitter`,
never displayed: a front-end model runs its ``initialize`` when it is created) looks for marked
plot divs twice a second, puts a ``ResizeObserver`` on each, and redraws a figure (through the
handler plotly gave it for the window's event) when its div's width is not the width it was drawn
at. A redraw takes the div's height too, so `grid`, which holds these figures, aligns its items at
the start (a stretched grid item would make a plot as tall as the tallest in its row).
"""
from __future__ import annotations

import anywidget

CLASS = "ddpkit-figure"


class _Fitter(anywidget.AnyWidget):
    _esm = """
    // one watcher per page, whichever kernel's fitter comes first
    function initialize({ model }) {
      if (window.__ddpkitFit) return;
      const observed = new Set();
      const fit = new ResizeObserver(entries => {
        for (const e of entries) {
          // the width plotly itself reads when it sizes an autosized plot
          const gd = e.target, w = parseFloat(getComputedStyle(gd).width);
          const drawn = gd._fullLayout && gd._fullLayout.width;
          if (!(drawn && w > 0 && Math.abs(drawn - w) > 1)) continue;
          // the handler of the plotly.js that drew it (the page may hold two), which skips a
          // hidden plot: the next change of its box fits it
          if (gd._responsiveChartHandler) gd._responsiveChartHandler();
          else if (window.Plotly) window.Plotly.Plots.resize(gd).catch(() => {});
        }
      });
      const marked = document.getElementsByClassName('""" + CLASS + """');  // live, no layout
      window.__ddpkitFit = setInterval(() => {
        for (const gd of observed) if (!gd.isConnected) { fit.unobserve(gd); observed.delete(gd); }
        for (const gd of marked) {  // plotly drew it: its view's div holds the plot
          if (gd._fullLayout && !observed.has(gd)) { observed.add(gd); fit.observe(gd); }
        }
      }, 500);
    }
    export default { initialize };
    """


_fitter = None


def fitted(fig):
    """``fig`` (a FigureWidget), marked to be redrawn at its box's width whenever that changes.
    It is made responsive too: the handler the page's fitter calls is plotly's for that."""
    global _fitter
    if _fitter is None or _fitter.comm is None:  # none yet, or closed (Widget.close_all)
        _fitter = _Fitter()
    fig._config = {"responsive": True, "displaylogo": False}
    fig.add_class(CLASS)
    return fig


def grid(children):
    """A grid of figures (and widgets beside them) that fills the cell's width: as many 440 px
    or wider columns as fit, each item as tall as itself."""
    import ipywidgets as W

    return W.GridBox(children, layout=W.Layout(
        grid_template_columns="repeat(auto-fill, minmax(440px, 1fr))", grid_gap="4px 8px",
        width="100%", align_items="flex-start"))
