"""ddpkit's figures are responsive, so the page's fitter redraws them at their box's width (the
page's side is tests/browser/test_lab_browser.py), the kernel always holds a live fitter, and a
figure's comm opens with the whole figure in its opening message (fit.py says why)."""
import plotly.graph_objects as go

from ddpkit.lab import fit


def test_a_figure_is_responsive_and_the_kernel_holds_one_live_fitter():
    assert not go.FigureWidget()._config.get("responsive")  # plotly's default: the fitter
    a = fit.figure(dict(title=dict(text="a")))  # leaves such plots be
    assert a._config["responsive"]  # the page's fitter finds it so, and redraws through the
    # handler plotly gives a responsive plot
    first = fit._fitter
    fit.figure(dict(title=dict(text="b")))
    assert fit._fitter is first and first.comm is not None  # one per kernel


def test_a_closed_fitter_is_made_again():
    fit.figure({})
    closed = fit._fitter
    closed.close()  # as Widget.close_all() does (not called here: other tests' widgets live on)
    assert closed.comm is None
    fig = fit.figure({})
    assert fit._fitter is not closed and fit._fitter.comm is not None
    assert fig._config["responsive"]


def test_a_figure_opens_its_comm_with_all_of_it(opening):
    """A plain FigureWidget opens its comm empty and sends its layout and config after: a page
    that takes a snapshot of the kernel's widgets in between draws a blank plot, never fitted.
    A held figure sends nothing until it is opened, then its comm opens with its layout, the
    traces added meanwhile, its config and classes; nothing follows."""
    plain = go.FigureWidget(layout=dict(title=dict(text="plain")))
    assert opening[plain.comm.comm_id]["_widget_layout"] == {}  # what ddpkit's figures avoid

    fig = fit.held(dict(title=dict(text="loss"), height=330))
    fig.add_scatter(x=[0, 1], y=[2.0, 3.0], name="rank 0")
    with fig.batch_update():
        fig.layout.yaxis.title.text = "loss"
    assert fig.comm is None  # nothing sent, nothing to send to
    updates, send = [], fig._send
    fig._send = lambda msg, buffers=None: (updates.append(msg), send(msg, buffers))
    assert fit.opened(fig, classes=["ddpkit-swimlanes"]) is fig
    state = opening[fig.comm.comm_id]
    assert state["_widget_layout"]["title"]["text"] == "loss"
    assert state["_widget_layout"]["yaxis"]["title"]["text"] == "loss"
    assert state["_widget_layout"]["height"] == 330
    assert [t["name"] for t in state["_widget_data"]] == ["rank 0"]
    assert list(state["_widget_data"][0]["y"]) == [2.0, 3.0]
    assert state["_config"]["responsive"] and list(state["_dom_classes"]) == ["ddpkit-swimlanes"]
    assert updates == []
    # and it stays a live figure: a later change goes to the page as plotly sends it
    fig.add_scatter(x=[0], y=[1.0], name="rank 1")
    assert [m["state"].get("_py2js_addTraces", {}) for m in updates
            if "_py2js_addTraces" in m["state"]][0]["trace_data"][0]["name"] == "rank 1"


def test_what_a_page_is_handed_is_the_figure_as_it_is_now(opening):
    """A page that connects or reloads mid-run asks for every widget's state. Plotly keeps a
    figure's as it was made, so a late answer undid a figure's changes on the page (a swimlane
    figure drawn after one showed no bars). Each change still goes to the page as plotly's own
    message, and the state follows it without a message of its own."""
    fig = fit.figure(dict(title=dict(text="step -: what each rank did")))
    updates, send = [], fig._send
    fig._send = lambda msg, buffers=None: (updates.append(msg), send(msg, buffers))
    with fig.batch_update():
        fig.add_bar(x=[1.0, 2.0], y=["rank 0", "rank 1"], name="forward")
        fig.layout.title.text = "step 40: what each rank did"
    fig.add_bar(x=[3.0], y=["rank 0"], name="backward")
    fig.data[0].x = [1.5, 2.5]
    state = fig.get_state()  # what ipywidgets hands a page that asks
    assert state["_widget_layout"]["title"]["text"] == "step 40: what each rank did"
    assert [(t["name"], list(t["x"])) for t in state["_widget_data"]] == [
        ("forward", [1.5, 2.5]), ("backward", [3.0])]
    assert updates and not any(k.startswith("_widget_") for m in updates for k in m["state"])
    fig.data = [fig.data[1]]
    assert [t["name"] for t in fig.get_state()["_widget_data"]] == ["backward"]
    # a plain FigureWidget hands over the figure as it was made
    plain = go.FigureWidget(layout=dict(title=dict(text="made")))
    plain.layout.title.text = "changed"
    assert plain.get_state()["_widget_layout"]["title"]["text"] == "made"
