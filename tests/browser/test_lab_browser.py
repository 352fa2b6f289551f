"""The lab as a person uses it: JupyterLab in headless Chromium, a click on Run, a slider moved
mid-run, and the plots answering; at 1280x800 and at 1920x1080 nothing is cut or clipped. Needs Debian's chromium (`.ci/run` installs it) and the
playwright Python package (never `playwright install`: it downloads, and fails here)."""
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="needs Debian's chromium (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# every FigureWidget's traces, as plotly.js holds them in the page
TRACES = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd =>
    (gd.data || []).map(t => ({name: t.name, opacity: t.opacity === undefined ? 1 : t.opacity,
                              y: Array.from(t.y || [])})))"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter(tmp_path):
    work = tmp_path / "nb"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "08_lab.ipynb", work)
    port, token = free_port(), secrets.token_hex(16)
    # `-m jupyterlab`, not `-m jupyter lab`: the latter runs the `jupyter-lab` script, whose
    # shebang may name another environment's Python (a copied venv), and so its ddpkit
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
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
        os.killpg(proc.pid, 15)  # the server and the kernels it started (and their ranks)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        time.sleep(1.5)  # ranks notice their kernel is gone within a second


# every box that must fit: the plots inside the window and their own container, and each
# control's text inside its element (a clipped label has scrollWidth > clientWidth)
FIT = """() => {
  const lab = document.querySelector('.ddpkit-lab');
  const bad = [], vw = document.documentElement.clientWidth, labBox = lab.getBoundingClientRect();
  for (const gd of lab.querySelectorAll('.js-plotly-plot')) {
    const r = gd.getBoundingClientRect(), svg = gd.querySelector('.main-svg');
    const w = svg ? svg.getBoundingClientRect().width : 0;
    if (r.width < 300) bad.push(['plot too narrow', r.width]);
    if (r.right > vw + 0.5) bad.push(['plot past the window', r.right, vw]);
    if (r.right > labBox.right + 0.5) bad.push(['plot past the lab', r.right, labBox.right]);
    if (w > r.width + 0.5) bad.push(['plot wider than its box', w, r.width]);
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
MARKS = """() => Array.from(document.querySelectorAll('.ddpkit-lab .js-plotly-plot')[0]
    .querySelectorAll('.annotation')).map(a => { const r = a.getBoundingClientRect();
    return [r.left, r.top, r.right, r.bottom]; })"""
SIZES = [(1280, 800), (1920, 1080)]
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


def check_fits(page, tmp, size):
    w, h = size
    page.set_viewport_size({"width": w, "height": h})
    page.wait_for_timeout(1500)  # plotly redraws to its new width on the window's resize
    # scrolled by the page itself: playwright's scroll waits for the element to stop moving,
    # and a plot that gains points every 0.1 s never does
    page.evaluate("() => document.querySelector('.ddpkit-lab .js-plotly-plot').scrollIntoView()")
    page.wait_for_timeout(300)
    fit = page.evaluate(FIT)
    assert fit["plots"] == 6 and fit["checked"] > 10, fit  # 3 live plots, the peaks, 2 timeline
    assert fit["bad"] == [], (size, fit["bad"])
    boxes = page.evaluate(MARKS)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = min(a[2], b[2]) - max(a[0], b[0]) > 1 and min(a[3], b[3]) - max(a[1], b[1]) > 1
            assert not overlap, (size, boxes)
    path = tmp / f"lab-{w}x{h}.png"
    page.screenshot(path=str(path), timeout=90_000)
    assert path.stat().st_size > 10_000
    page.evaluate("() => document.querySelector('.ddpkit-lab .ddpkit-swimlanes').scrollIntoView()")
    page.wait_for_timeout(300)
    lanes = page.evaluate(SWIMLANES)
    assert lanes.get("bad") == [] and lanes["bars"] > 20, (size, lanes)
    assert lanes["lanes"] == ["rank 1 all-reduce", "rank 1 compute", "rank 0 all-reduce",
                              "rank 0 compute"], lanes
    swim = tmp / f"swimlanes-{w}x{h}.png"
    page.locator(".ddpkit-lab .ddpkit-swimlanes").first.screenshot(path=str(swim), timeout=90_000)
    for p in (path, swim):
        if os.environ.get("DDPKIT_SCREENSHOT_DIR"):
            shutil.copy(p, Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / p.name)
    return len(boxes)


def traces_named(page, fig, name):
    """Every run's trace `name` in figure `fig`, oldest first (old runs are faded overlays)."""
    return [t for t in page.evaluate(TRACES)[fig] if t["name"] == name]


def test_lab_in_a_real_browser(jupyter):
    playwright = pytest.importorskip("playwright.sync_api")
    base, token, tmp = jupyter
    with playwright.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp / "profile"), executable_path=CHROMIUM,
                                                   headless=True, args=FLAGS,
                                                   viewport={"width": 1400, "height": 1000})
        try:
            page = ctx.new_page()
            console = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.goto(f"{base}/lab/tree/08_lab.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session",
                                   timeout=60_000)
            # not awaited: the command resolves only when every cell has ended
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.wait_for_selector(".jp-OutputArea-output:has-text('scripted demo done')", timeout=180_000)

            last_run = len(traces_named(page, 0, "rank 0")[-1]["y"])  # the scripted run's
            run = page.locator("button.jupyter-button", has_text="Run").first
            run.scroll_into_view_if_needed()
            run.click()
            # a new run's loss trace fills while the run before stays as a faded overlay
            page.wait_for_function(
                f"() => {{ const t = ({TRACES})()[0].filter(t => t.name === 'rank 0');"
                f" return t.length == 2 && t[1].y.length >= 10 && t[1].y.length < {last_run}"
                f" && t[0].opacity < t[1].opacity; }}", timeout=60_000)
            loss_before = len(traces_named(page, 0, "rank 0")[-1]["y"])
            acts_before = traces_named(page, 1, "activations r0 (measured)")[-1]["y"]

            slider = page.locator(".widget-slider", has_text="ckpt segments").locator(".noUi-handle").first
            slider.focus()
            page.keyboard.press("ArrowRight")
            page.keyboard.press("ArrowRight")  # 0 -> 2 segments, mid-run
            page.wait_for_timeout(1500)
            page.keyboard.press("ArrowLeft")  # 2 -> 1, and again a while later: three marks
            page.wait_for_timeout(1200)
            page.keyboard.press("ArrowRight")
            page.wait_for_timeout(1500)
            news = page.get_by_role("button", name="No", exact=True)  # JupyterLab's "news?" toast
            if news.count() and news.first.is_visible():
                news.first.click(timeout=5_000)
            loss_after = len(traces_named(page, 0, "rank 0")[-1]["y"])
            acts_after = traces_named(page, 1, "activations r0 (measured)")[-1]["y"]
            assert loss_after > loss_before, "the loss plot stopped gaining points"
            assert len(set(acts_before)) == 1, acts_before  # constant before the change
            assert min(acts_after) < acts_before[0], (acts_before[:3], acts_after[-3:])
            # Stop ends the run and the plots keep what it drew (the marks included); the layout
            # is then checked on a still page: a screenshot waits for a settled frame, and on two
            # busy cores a plot redrawn every 0.1 s may not give one within its timeout
            stop = page.locator("button.jupyter-button", has_text="Stop").first
            stop.click()
            page.wait_for_function("() => Array.from(document.querySelectorAll('.ddpkit-lab button'))"
                                   ".some(b => b.textContent.includes('Stop') && b.disabled)",
                                   timeout=60_000)
            # the page draws what had arrived at its own pace (at most a quarter of its time),
            # so the last points may land a moment after the run ended; then nothing moves
            shown = []
            while len(shown) < 2 or shown[-1] != shown[-2]:
                assert len(shown) < 20, ("the plots kept moving after Stop", shown)
                page.wait_for_timeout(700)
                shown.append(len(traces_named(page, 0, "rank 0")[-1]["y"]))
            marks = [check_fits(page, tmp, size) for size in SIZES]
            assert min(marks) >= 2, marks  # the change labels were drawn (and did not overlap)
        except Exception:
            if os.environ.get("DDPKIT_SCREENSHOT_DIR"):  # what the page showed when it failed
                page.screenshot(path=str(Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / "failed.png"))
                (Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / "failed.html").write_text(page.content())
                (Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / "console.txt").write_text("\n".join(console))
            raise
        finally:
            ctx.close()
