"""ddpkit's figures are marked to be redrawn at their box's width (the page's side is
tests/browser/test_lab_browser.py), and the kernel always holds a live fitter for them."""
import plotly.graph_objects as go

from ddpkit.explore import fit


def test_a_figure_is_marked_and_the_kernel_holds_one_live_fitter():
    a, b = go.FigureWidget(), go.FigureWidget()
    assert fit.fitted(a) is a and fit.CLASS in a._dom_classes
    assert a._config["responsive"]  # the page's fitter redraws through plotly's handler for it
    first = fit._fitter
    fit.fitted(b)
    assert fit._fitter is first and first.comm is not None  # one per kernel


def test_a_closed_fitter_is_made_again():
    fit.fitted(go.FigureWidget())
    closed = fit._fitter
    closed.close()  # as Widget.close_all() does (not called here: other tests' widgets live on)
    assert closed.comm is None
    fig = fit.fitted(go.FigureWidget())
    assert fit._fitter is not closed and fit._fitter.comm is not None
    assert fit.CLASS in fig._dom_classes
