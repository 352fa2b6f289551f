"""The lab as a person uses it: JupyterLab in headless Chromium, a click on Run, a slider moved
mid-run, and the plots answering; at 1280x800 and at 1920x1080 nothing is cut or clipped. Then
the block control of three transformers GPT-2 labs, 12, 32 and 80 blocks, at both sizes: every
block's toggle seen whole and reachable, named as the model names it. One JupyterLab for both
tests. Needs Debian's chromium (`.ci/run` installs it) and the playwright Python package (never
`playwright install`: it downloads, and fails here)."""
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="needs Debian's chromium (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# every FigureWidget's traces, as plotly.js holds them in the page
TRACES = """() => Array.from(window.jupyterapp.shell.currentWidget.node
    .querySelectorAll('.js-plotly-plot')).map(gd =>
    (gd.data || []).map(t => ({name: t.name, opacity: t.opacity === undefined ? 1 : t.opacity,
                              y: Array.from(t.y || [])})))"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# blocks -> the lab's checkpoint setting: a few blocks, segments, every other one
BLOCKS = {12: "[True] * 10 + [False, True]", 32: "4", 80: "[i % 2 == 0 for i in range(80)]"}
# three small labs, each the value of its own cell: a transformers GPT-2 of 12, 32 and 80 blocks
BLOCKS_CELLS = ["""import ddpkit
from transformers import GPT2Config, GPT2LMHeadModel

def gpt2(n_layer):
    def make():
        return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=64,
                                          n_positions=32, bos_token_id=0, eos_token_id=0))
    return make

labs = {}"""] + [f"labs[{n}] = ddpkit.Lab(ddpkit.TrainConfig(model=gpt2({n}), micro_batch=2, "
                 f"seq_len=16, checkpoint={c}))\nlabs[{n}]" for n, c in BLOCKS.items()] + [
    "import json\nwith open('labs.json', 'w') as fh:  # what the kernel says, for the test\n"
    "    json.dump({n: dict(tooltips=[t.tooltip for t in lab.block_toggles], mask=lab.config()"
    ".checkpoint.mask, label=lab.config().checkpoint.label(), heights=[f.layout.height "
    "for f in (lab.plots.loss, lab.plots.memory, lab.peaks.figure, lab.plots.timing, "
    "lab.timeline.lanes, lab.timeline.exposed)]) for n, lab in labs.items()}, fh)\n"
    "print('labs ready')"]


def write_notebook(path, cells):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, str(path))


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lab")
    work = tmp_path / "nb"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "08_lab.ipynb", work)
    write_notebook(work / "blocks.ipynb", BLOCKS_CELLS)
    # the server's own settings, not the machine's: no "news?" toast over the page (it asks once,
    # at a moment of its own, and a click to dismiss it could land mid-animation)
    notification = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = free_port(), secrets.token_hex(16)
    # `-m jupyterlab`, not `-m jupyter lab`: the latter runs the `jupyter-lab` script, whose
    # shebang may name another environment's Python (a copied venv), and so its ddpkit
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "jupyter.log", "w"),
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline, (tmp_path / "jupyter.log").read_text()[-3000:]
            time.sleep(0.5)
    try:
        yield base, token, tmp_path
    finally:
        # the server, its kernels and their ranks: the ranks notice their kernel is gone
        # within a second or so (an orphan is no child of ours, so each is waited for by pid)
        tree = [psutil.Process(proc.pid)]
        with contextlib.suppress(psutil.Error):
            tree += tree[0].children(recursive=True)
        os.killpg(proc.pid, 15)  # the server and the kernels it started (and their ranks)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        psutil.wait_procs(tree, timeout=30)


# the labs of the notebook on show (JupyterLab keeps other notebooks' panels in the page)
LABS = "window.jupyterapp.shell.currentWidget.node.querySelectorAll('.ddpkit-lab')"
# every box that must fit: the plots inside the window and their own container, and each
# control's text inside its element (a clipped label has scrollWidth > clientWidth)
FIT = """(i) => {
  const lab = """ + LABS + """[i];
  const bad = [], vw = document.documentElement.clientWidth, labBox = lab.getBoundingClientRect();
  for (const gd of lab.querySelectorAll('.js-plotly-plot')) {
    // drawn width: plotly's own (the svg's width attribute): in a cell the page skips
    // (content-visibility) the svg's box can lag behind what plotly drew until it is shown
    const r = gd.getBoundingClientRect(), svg = gd.querySelector('.main-svg');
    const w = svg ? parseFloat(svg.getAttribute('width')) : 0;
    if (r.width < 300) bad.push(['plot too narrow', r.width]);
    if (r.right > vw + 0.5) bad.push(['plot past the window', r.right, vw]);
    if (r.right > labBox.right + 0.5) bad.push(['plot past the lab', r.right, labBox.right]);
    // which plot, and what the page's fitter works from: plotly's drawn width, its config
    const who = [(gd.querySelector('.gtitle') || {}).textContent || '(untitled)', gd.className,
                 gd._fullLayout && gd._fullLayout.width, !!(gd._context && gd._context.responsive)];
    // a figure the page drew from a half-made state: no title, plotly's default config
    if (!who[3] || who[0] === '(untitled)') bad.push(['drawn half made', ...who]);
    if (w > r.width + 0.5) bad.push(['plot wider than its box', w, r.width, ...who]);
    if (w < r.width - 1.5) bad.push(['plot narrower than its box', w, r.width, ...who]);
  }
  const texts = lab.querySelectorAll('.widget-label, .widget-label-basic, button, ' +
                                     '.widget-checkbox label, .widget-dropdown select');
  for (const el of texts) {
    if (!el.offsetParent || !el.textContent.trim()) continue;
    const r = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1) bad.push(['clipped', el.textContent.trim()]);
    if (r.right > vw + 0.5) bad.push(['past the window', el.textContent.trim()]);
  }
  return {bad: bad, plots: lab.querySelectorAll('.js-plotly-plot').length,
          checked: texts.length};
}"""
# the labels of mid-run changes on the loss plot: none may overlap another
MARKS = """() => Array.from(window.jupyterapp.shell.currentWidget.node
    .querySelectorAll('.ddpkit-lab .js-plotly-plot')[0]
    .querySelectorAll('.annotation')).map(a => { const r = a.getBoundingClientRect();
    return [r.left, r.top, r.right, r.bottom]; })"""
SIZES = [(1280, 800), (1920, 1080)]
# the height of each plot of lab i, in the page's order
HEIGHTS = """(i) => Array.from(""" + LABS + """[i].querySelectorAll('.js-plotly-plot'))
    .map(gd => Math.round(gd.querySelector('.main-svg').getBoundingClientRect().height))"""
# the swimlane figure (issue #20): bars drawn for each rank, and every label of it (title, lane
# names, legend, ticks) inside the figure's own box
SWIMLANES = """() => {
  const gd = document.querySelector('.ddpkit-lab .ddpkit-swimlanes.js-plotly-plot, ' +
                                    '.ddpkit-lab .ddpkit-swimlanes .js-plotly-plot');
  if (!gd) return {missing: true};
  const box = gd.getBoundingClientRect(), bad = [];
  for (const t of gd.querySelectorAll('.gtitle, .ytick text, .xtick text, .legendtext, .xtitle')) {
    const r = t.getBoundingClientRect();
    if (!r.width) continue;
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 ||
        r.bottom > box.bottom + 0.5) bad.push(['label outside the figure', t.textContent]);
  }
  const title = gd.querySelector('.gtitle'), legend = gd.querySelector('.legend .bg');
  if (title && legend) {
    const a = title.getBoundingClientRect(), b = legend.getBoundingClientRect();
    if (Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1 &&
        Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1) bad.push(['legend over the title']);
  }
  const lanes = Array.from(gd.querySelectorAll('.ytick text')).map(t => t.textContent);
  const bars = (gd.data || []).reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
  return {bad: bad, lanes: lanes, bars: bars, title: gd.layout.title.text};
}"""


# a lab's figures: loss, memory, step time, the peak panel's bars, the two timeline figures
PLOTS = 6


# every plot of the notebook on show (or of lab i only) drawn to its box's width: plotly
# redraws after its box changes, at its own pace (18 plots for the three block labs, more than
# 1.5 s on busy cores)
REDRAWN = """(i) => Array.from((i === null ? window.jupyterapp.shell.currentWidget.node :
    """ + LABS + """[i]).querySelectorAll('.js-plotly-plot')).every(gd => {
    const svg = gd.querySelector('.main-svg');  // plotly's drawn width, as FIT reads it
    const w = svg && parseFloat(svg.getAttribute('width')), box = gd.getBoundingClientRect().width;
    return svg && w <= box + 0.5 && w >= box - 1.5; })"""
# the box width of lab i's first plot
BOX = f"(i) => {LABS}[i].querySelector('.js-plotly-plot').getBoundingClientRect().width"


def resize(page, size):
    """The window at ``size``, once every plot has redrawn to its new width (or 30 s have passed:
    then the checks that follow say which plot is wrong)."""
    w, h = size
    before = page.evaluate(BOX, 0)
    page.set_viewport_size({"width": w, "height": h})
    redrawn(page, was=before)


def redrawn(page, i=None, was=None):
    """Wait until every plot (of lab ``i``) has redrawn to its box, or 30 s have passed: then
    the checks that follow say which plot is wrong. ``was``: the width lab ``i``'s (or the first
    lab's) first plot had before a change of its box, which JupyterLab lays out at its own pace:
    until the box has moved, its plots still fit the old one."""
    from playwright.sync_api import TimeoutError as PageTimeout

    with contextlib.suppress(PageTimeout):
        if was is not None:
            page.wait_for_function(f"([i, was]) => Math.abs(({BOX})(i) - was) > 0.5",
                                   arg=[i or 0, was], timeout=30_000, polling=100)
        # every 0.1 s, not every frame: each check lays the page out, on plotly's one thread
        page.wait_for_function(REDRAWN, arg=i, timeout=30_000, polling=100)


def fits(page, size, i=0):
    """The FIT checks on lab ``i`` of the notebook on show."""
    fit = page.evaluate(FIT, i)
    assert fit["plots"] == PLOTS and fit["checked"] > 10, fit
    assert fit["bad"] == [], (size, i, fit["bad"])


def check_fits(page, tmp, size):
    from playwright.sync_api import TimeoutError as PageTimeout

    w, h = size
    resize(page, size)
    # scrolled by the page itself: playwright's scroll waits for the element to stop moving,
    # and a plot that gains points every 0.1 s never does
    page.evaluate(f"() => {LABS}[0].querySelector('.js-plotly-plot').scrollIntoView()")
    redrawn(page, 0)  # a plot in a cell the page skipped is fitted when shown
    fits(page, size)
    boxes = page.evaluate(MARKS)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = min(a[2], b[2]) - max(a[0], b[0]) > 1 and min(a[3], b[3]) - max(a[1], b[1]) > 1
            assert not overlap, (size, boxes)
    keep(page, tmp / f"lab-{w}x{h}.png")
    page.evaluate("() => document.querySelector('.ddpkit-lab .ddpkit-swimlanes').scrollIntoView()")
    with contextlib.suppress(PageTimeout):  # its labels laid out once shown; else said below
        page.wait_for_function(f"() => {{ const s = ({SWIMLANES})(); return !s.missing &&"
                               " s.bad.length == 0 && s.bars > 20; }", timeout=30_000,
                               polling=100)
    lanes = page.evaluate(SWIMLANES)
    assert lanes.get("bad") == [] and lanes["bars"] > 20, (size, lanes)
    assert lanes["lanes"] == ["rank 1 all-reduce", "rank 1 compute", "rank 0 all-reduce",
                              "rank 0 compute"], lanes
    keep(page.locator(".ddpkit-lab .ddpkit-swimlanes").first, tmp / f"swimlanes-{w}x{h}.png")
    return len(boxes)


def keep(target, path):
    """A screenshot of ``target`` (a page or an element) at ``path``, kept in
    DDPKIT_SCREENSHOT_DIR too when that is set."""
    target.screenshot(path=str(path), timeout=90_000)
    assert path.stat().st_size > 5_000
    if os.environ.get("DDPKIT_SCREENSHOT_DIR"):
        shutil.copy(path, Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / path.name)


def traces_named(page, fig, name):
    """Every run's trace `name` in figure `fig`, oldest first (old runs are faded overlays)."""
    return [t for t in page.evaluate(TRACES)[fig] if t["name"] == name]


@contextlib.contextmanager
def notebook_page(jupyter, name):
    """A fresh Chromium on notebook ``name`` of the shared JupyterLab, its kernel ready; on a
    failure, what the page showed goes to DDPKIT_SCREENSHOT_DIR."""
    playwright = pytest.importorskip("playwright.sync_api")
    base, token, tmp = jupyter
    with playwright.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp / f"profile-{name}"),
                                                   executable_path=CHROMIUM, headless=True,
                                                   args=FLAGS,
                                                   viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        console = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.console = console
        try:
            # ?reset: a fresh workspace, not the notebooks the last test left open
            page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session",
                                   timeout=60_000)
            yield page, tmp
        except Exception:
            if os.environ.get("DDPKIT_SCREENSHOT_DIR"):  # what the page showed when it failed
                out = Path(os.environ["DDPKIT_SCREENSHOT_DIR"])
                page.screenshot(path=str(out / f"failed-{name}.png"))
                (out / f"failed-{name}.html").write_text(page.content())
                (out / f"console-{name}.txt").write_text("\n".join(console))
            raise
        finally:
            ctx.close()
            shutdown_kernels(base, token)


def shutdown_kernels(base, token):
    """End the server's kernels (and so their labs' ranks) before the next test: the server
    is shared, and each test leaves no process of its own behind."""
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}",
                                     method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
    server = [p for p in psutil.Process().children() if "jupyterlab" in " ".join(p.cmdline())]
    deadline = time.monotonic() + 20
    while any(s.children(recursive=True) for s in server) and time.monotonic() < deadline:
        time.sleep(0.2)  # ranks notice their kernel is gone within a second


# the notebook's outputs as the kernel sent them (nbformat JSON), every cell's
OUTPUTS = """() => window.jupyterapp.shell.currentWidget.content.model.toJSON().cells
    .map(c => c.outputs || [])"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def wait_for_output(page, text, timeout_s):
    """Wait until a cell prints ``text`` (returns what that output says); a cell that raises
    fails the test at once with its traceback, and a timeout says what every cell had shown (not
    only that ``text`` never came)."""
    deadline = time.monotonic() + timeout_s
    while True:
        outputs = page.evaluate(OUTPUTS)
        flat = [o for cell in outputs for o in cell]
        said = [t for o in flat if text in (t := "".join(o.get("text", "")))]
        if said:
            return said[0]
        errors = [o for o in flat if o.get("output_type") == "error"]
        if errors:
            e = errors[0]
            pytest.fail(f"a cell raised {e['ename']}: {e['evalue']}\n" +
                        ANSI.sub("", "\n".join(e.get("traceback", [])))[-4000:])
        if time.monotonic() > deadline:
            shown = [ANSI.sub("", "".join(o.get("text", "")))[-300:] for o in flat]
            pytest.fail(f"no {text!r} after {timeout_s} s; the cells showed: {shown}")
        page.wait_for_timeout(500)


def wait_for_points(page, fig, name, done, what, timeout_s=120):
    """Wait until the newest trace ``name`` of figure ``fig`` holds points ``done(y)`` accepts;
    past ``timeout_s`` fail with what it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        y = (traces_named(page, fig, name) or [{"y": []}])[-1]["y"]
        if y and done(y):
            return y
        assert time.monotonic() < deadline, (f"{what} points never came: {name!r} held", y[-10:],
                                             len(y), [len(t["y"]) for t in
                                                      traces_named(page, fig, name)])
        page.wait_for_timeout(300)


# the Lab's figures, as the notebook's kernel names them
FIGURES = ("lab.plots.loss, lab.plots.memory, lab.peaks.figure, lab.plots.timing, "
           "lab.timeline.lanes, lab.timeline.exposed")
DEAD = "[anywidget] Failed to initialize model"


def kernel_says(page, code):
    """What ``code`` prints, run in the notebook's kernel (beside the cells, not as one)."""
    return page.evaluate("""async (code) => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        const future = kernel.requestExecute({code: code, store_history: false});
        let out = '';
        future.onIOPub = (msg) => {
          if (msg.header.msg_type === 'stream') out += msg.content.text;
          if (msg.header.msg_type === 'error') out += msg.content.evalue; };
        await future.done;
        return out; }""", code)


def run_cells(page, first, command):
    """Run the notebook's cells from ``first`` (``notebook:run-cell``: that one; ``-all-below``:
    to the end). Not awaited: the command resolves only when every cell has ended."""
    page.evaluate(f"() => {{ window.jupyterapp.shell.currentWidget.content.activeCellIndex = {first};"
                  f" window.jupyterapp.commands.execute('notebook:{command}'); }}")


def show_the_lab(page, tries=3):
    """Run the notebook's Lab cell until every figure of the Lab takes the kernel's changes in
    the page. anywidget (plotly's FigureWidget is one) gives a model two seconds to load its
    module and start; past that it drops every later message to the model for good
    ("[anywidget] Failed to initialize model"), and a renderer starved by busy cores can miss
    that while it loads plotly's five megabytes for each figure at once: the plots then stay as
    first drawn. Such a page is told apart by the change it never shows, and the cell runs again
    (new models)."""
    for n in range(tries):
        page.console.clear()
        run_cells(page, 1, "run-cell")
        page.wait_for_function(f"() => {LABS}.length == 1 && {LABS}[0].querySelectorAll("
                               f"'.js-plotly-plot').length == {PLOTS}", timeout=120_000)
        code = f"for fig in ({FIGURES}):\n    fig.layout.uirevision = 'alive {n}'"
        page.evaluate("(code) => window.jupyterapp.shell.currentWidget.sessionContext.session"
                      ".kernel.requestExecute({code: code})", code)
        from playwright.sync_api import TimeoutError as PageTimeout

        with contextlib.suppress(PageTimeout):
            page.wait_for_function(f"() => Array.from({LABS}[0].querySelectorAll('.js-plotly-plot'))"
                                   f".every(gd => gd.layout && gd.layout.uirevision === 'alive {n}')",
                                   timeout=60_000)
        if not any(DEAD in line for line in page.console) and page.evaluate(
                f"() => Array.from({LABS}[0].querySelectorAll('.js-plotly-plot'))"
                f".every(gd => gd.layout && gd.layout.uirevision === 'alive {n}')"):
            return n
    pytest.fail(f"the Lab's figures never came alive in {tries} tries: {page.console[-10:]}")


def test_lab_in_a_real_browser(jupyter):
    with notebook_page(jupyter, "08_lab.ipynb") as (page, tmp):
        show_the_lab(page)
        run_cells(page, 2, "run-all-below")
        said = wait_for_output(page, "scripted demo done", timeout_s=300)
        # `lab = ddpkit.Lab(cfg)` then `lab`: one lab on the page, not two
        assert page.evaluate(f"() => {LABS}.length") == 1

        # the page draws at its own pace: the scripted run's points may land well after the
        # cell ends on busy cores. The kernel says how many steps the run made; wait for them all
        last_run = int(re.search(r"scripted demo done: (\d+) steps", said)[1])
        assert last_run > 8  # past the first run's 8 steps
        wait_for_points(page, 0, "rank 0", lambda y: len(y) == last_run,
                        f"the scripted run's {last_run}")
        # the live plots found by what plotly drew, not by classes a view may never get (one
        # drawn under two busy cores never got them): with theirs taken off, each plot still
        # gains the run's points
        page.evaluate(f"() => {{ for (const gd of {LABS}[0].querySelectorAll('.js-plotly-plot'))"
                      " for (const c of Array.from(gd.classList))"
                      " if (c.startsWith('ddpkit-plots') || c === 'ddpkit-figure')"
                      " gd.classList.remove(c); }")
        run = page.locator("button.jupyter-button", has_text="Run").first
        run.scroll_into_view_if_needed()
        run.click()
        # a new run's loss trace fills while the run before stays as a faded overlay. The faded
        # trace is the scripted run's (before the click it was the first, 8-step run's): known
        # by its length, not by catching the new run below it, which busy cores can outrun
        page.wait_for_function(
            f"() => {{ const t = ({TRACES})()[0].filter(t => t.name === 'rank 0');"
            f" return t.length == 2 && t[0].y.length == {last_run} && t[1].y.length >= 10"
            f" && t[0].opacity < t[1].opacity; }}", timeout=60_000)
        # each figure draws its points when its own frame comes: the memory plot can be behind
        # the loss plot on busy cores (it had none yet when the loss had 10)
        wait_for_points(page, 1, "activations r0 (measured)", lambda y: len(y) >= 3,
                        "the new run's activation")
        loss_before = len(traces_named(page, 0, "rank 0")[-1]["y"])
        steps_before = len(traces_named(page, 3, "step ms r0")[-1]["y"])  # the timing plot
        acts_before = traces_named(page, 1, "activations r0 (measured)")[-1]["y"]
        assert len(set(acts_before)) == 1, acts_before  # constant before the change

        slider = page.locator(".widget-slider", has_text="ckpt segments").locator(".noUi-handle").first
        slider.focus()
        # three changes mid-run, each once the one before has landed (its mark on the loss plot)
        for n, keys in enumerate((["ArrowRight", "ArrowRight"],  # 0 -> 2 segments
                                  ["ArrowLeft"], ["ArrowRight"]), start=1):  # 2 -> 1 -> 2
            for key in keys:
                page.keyboard.press(key)
            page.wait_for_function(f"() => ({MARKS})().length >= {n}", timeout=90_000)
        # the plots kept gaining points, and the activations fell the step checkpointing landed
        wait_for_points(page, 0, "rank 0", lambda y: len(y) > loss_before, "the loss plot's")
        wait_for_points(page, 3, "step ms r0", lambda y: len(y) > steps_before, "the timing plot's")
        wait_for_points(page, 1, "activations r0 (measured)",
                        lambda y: min(y) < acts_before[0], "the activations' lower")
        # the swimlanes show a probed step of this run (every 50th: step 49 first; the run's
        # start drew them empty) before Stop: on two busy cores the marks above can come
        # sooner than 50 steps, and then a Stop would leave the lanes rightly empty
        page.wait_for_function(f"() => {{ const s = ({SWIMLANES})(); return !s.missing &&"
                               " s.bars > 20 && !s.title.startsWith('step -'); }", timeout=90_000)
        # Stop ends the run and the plots keep what it drew (the marks included); the layout
        # is then checked on a still page: a screenshot waits for a settled frame, and on two
        # busy cores a plot redrawn every 0.1 s may not give one within its timeout
        stop = page.locator("button.jupyter-button", has_text="Stop").first
        stop.click()
        page.wait_for_function(f"() => Array.from({LABS}).flatMap(l => Array.from("
                               "l.querySelectorAll('button')))"
                               ".some(b => b.textContent.includes('Stop') && b.disabled)",
                               timeout=60_000)
        # the page draws what had arrived at its own pace (at most a quarter of its time), so
        # the last points may land a moment after the run ended: the kernel says how many
        ran = int(kernel_says(page, "print(sum(1 for m in lab.metrics if m['rank'] == 0))"))
        wait_for_points(page, 0, "rank 0", lambda y: len(y) == ran, f"the stopped run's {ran}")
        marks = [check_fits(page, tmp, size) for size in SIZES]
        assert min(marks) >= 2, marks  # the change labels were drawn (and did not overlap)


# the block control of lab i: each toggle whole (its label not clipped), inside the lab and the
# window, and reachable (scrolled to, the point at its centre is the toggle itself, not
# something over it); its title; the range slider and the buttons there too
BLOCK_TOGGLES = """(i) => {
  const lab = """ + LABS + """[i], ctl = lab.querySelector('.ddpkit-blocks');
  const vw = document.documentElement.clientWidth, box = lab.getBoundingClientRect();
  const toggles = Array.from(ctl.querySelectorAll('button.widget-toggle-button'));
  const bad = [], titles = [], rows = new Set();
  for (const t of toggles) {
    t.scrollIntoView({block: 'center', inline: 'nearest'});
    const r = t.getBoundingClientRect(), name = t.textContent.trim();
    titles.push(t.title);
    rows.add(Math.round(r.top + window.scrollY));
    if (!t.offsetParent || r.width < 20 || r.height < 16) bad.push(['hidden', name, r.width]);
    if (t.scrollWidth > t.clientWidth + 1) bad.push(['clipped', name]);
    if (r.right > vw + 0.5 || r.right > box.right + 0.5 || r.left < box.left - 0.5)
      bad.push(['outside', name, r.left, r.right]);
    const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    if (!hit || !t.contains(hit)) bad.push(['covered', name, hit && hit.className]);
  }
  return {n: toggles.length, titles: titles, bad: bad,
          labels: toggles.map(t => t.textContent.trim()),
          pressed: toggles.map(t => t.classList.contains('mod-active')),
          ranges: ctl.querySelectorAll('.widget-slider').length,
          summary: ctl.querySelector('.widget-html-content').textContent};
}"""


def test_the_block_control_at_12_32_and_80_blocks(jupyter):
    pytest.importorskip("transformers")
    with notebook_page(jupyter, "blocks.ipynb") as (page, tmp):
        # the window's size set before the labs are drawn: each plot must take its box's width
        # with no window event after it (plotly alone drew them 700 px wide, its default, in
        # 490 px boxes), and again when only the box changes (the side panel opens or closes)
        page.set_viewport_size({"width": 1920, "height": 1080})
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        wait_for_output(page, "labs ready", timeout_s=240)
        kernel = json.loads((tmp / "nb" / "labs.json").read_text())
        assert page.evaluate(f"() => {LABS}.length") == len(BLOCKS)  # each lab shown once
        widths = []  # each lab's first plot's, as first drawn
        for toggled, when in enumerate(("drawn at 1920x1080", "side panel toggled")):
            if toggled:
                page.evaluate("() => window.jupyterapp.commands.execute("
                              "'application:toggle-left-area')")
            for i, n in enumerate(BLOCKS):  # each as it is scrolled to (JupyterLab lays out
                page.evaluate(f"() => {LABS}[{i}].scrollIntoView()")  # cells out of view
                # only when they come into view); the side panel toggled moves each box
                redrawn(page, i, was=widths[i] if toggled else None)
                fits(page, when, i)
                # as tall as the kernel made them: a redraw takes its div's height too, and a
                # stretched grid item made the exposed-time plot as tall as the swimlanes
                assert page.evaluate(HEIGHTS, i) == kernel[str(n)]["heights"], (when, n)
                if not toggled:
                    widths.append(page.evaluate(BOX, i))
        # (redrawn waited 30 s at most for the side panel to move the boxes)
        assert abs(page.evaluate(BOX, 0) - widths[0]) > 5, (
            "the side panel left the boxes as they were", widths, page.evaluate(BOX, 0))
        # a plot drawn at another width while its box stays, which no observer reports: the
        # page's own check fits it again (plotly's relayout, then its fixed width taken away)
        page.evaluate(f"() => {{ const gd = {LABS}[0].querySelector('.js-plotly-plot');"
                      " return window.Plotly.relayout(gd, {width: 700})"
                      ".then(() => { delete gd.layout.width; }); }")
        assert page.evaluate(f"() => {LABS}[0].querySelector('.main-svg').getAttribute('width')"
                             ) == "700"
        redrawn(page, 0)
        fits(page, "drawn at 700 in a box that stayed", 0)
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        for w, h in SIZES:
            resize(page, (w, h))
            for i, n in enumerate(BLOCKS):
                got, want = page.evaluate(BLOCK_TOGGLES, i), kernel[str(n)]
                assert got["n"] == n and got["bad"] == [], ((w, h), n, got["bad"])
                assert got["labels"] == [str(b) for b in range(n)]
                # each toggle's tooltip: the model's own name for the block
                assert got["titles"] == want["tooltips"] == [
                    f"checkpoint transformer.h.{b}" for b in range(n)]
                # the page shows the lab's setting: the pressed toggles and the line above them
                assert got["pressed"] == want["mask"] and any(want["mask"])
                assert f"checkpointed: {want['label']} ({sum(want['mask'])} of {n} blocks)" \
                    == got["summary"] and got["ranges"] == 1
                fits(page, (w, h), i)  # the same checks as the lab above: nothing clipped
                control = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .ddpkit-lab "
                                       ".ddpkit-blocks").nth(i)
                if (w, h) == SIZES[-1]:  # the control alone (the same 400 px at both sizes)
                    keep(control, tmp / f"blocks-{n}.png")
                if n == max(BLOCKS):  # the biggest lab, from its top
                    page.evaluate(f"() => {LABS}[{i}].scrollIntoView({{block: 'start'}})")
                    redrawn(page, i)
                    keep(page, tmp / f"lab-{n}-blocks-{w}x{h}.png")
        # the last block of the biggest lab, clicked: the kernel hears it and says so above
        n = max(BLOCKS)
        lab = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .ddpkit-lab").nth(len(BLOCKS) - 1)
        lab.locator("button.widget-toggle-button", has_text=re.compile(f"^{n - 1}$")).click()
        on = sum(kernel[str(n)]["mask"]) + 1
        page.wait_for_function(f"() => {LABS}[{len(BLOCKS) - 1}].querySelector('.ddpkit-blocks "
                               f".widget-html-content').textContent.endsWith('({on} of {n} blocks)')",
                               timeout=30_000)
