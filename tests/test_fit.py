"""ddpkit's figures are responsive, so the page's fitter redraws them at their box's width (the
page's side is tests/browser/test_lab_browser.py), and the kernel always holds a live fitter."""
import plotly.graph_objects as go

from ddpkit.explore import fit


def test_a_figure_is_responsive_and_the_kernel_holds_one_live_fitter():
    a, b = go.FigureWidget(), go.FigureWidget()
    assert not b._config.get("responsive")  # plotly's default: the fitter leaves such plots be
    assert fit.fitted(a) is a
    assert a._config["responsive"]  # the page's fitter finds it so, and redraws through the
    # handler plotly gives a responsive plot
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
    assert fig._config["responsive"]
