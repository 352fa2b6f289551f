"""The report ``ddpkit demo`` writes, as a person opens it: headless Chromium at 1280x800. The
table shows predicted beside measured for the step time and the peak; no text label leaves its
plot's area (a frontier's label once ran off the first plot's edge), nothing is wider than the
window, and no blank band splits the page (a plotly table kept a fixed share of one tall figure,
blank under its rows). Needs Debian's chromium (`.ci/run` installs it) and the playwright Python
package (never `playwright install`: it downloads, and fails here).

The predictions are those of a machine of round rates cached for the test (no calibration runs);
the report is the demo's, of its 8-block MLP rather than its GPT (the same page).
"""
import contextlib
import os
import shutil
from pathlib import Path

import pytest

import ddpkit
from ddpkit.predict.units import fmt_bytes
from ddpkit.runs.demo import DEMO, SEGMENTS, demo
from test_predicted import calibrate_with_round_rates

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="needs Debian's chromium (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# the demo's 8 blocks and 4 settings (its table's rows, its labels), on the built-in MLP (its
# simulated steps, which the predictions need, take a tenth of the GPT's) and short
SMALL = dict(model="mlp", width=32, micro_batch=2, accum_steps=1, steps=3)
BAND_PX = 80
"""The tallest strip across the page with nothing drawn in it that still reads as spacing (the
report's own gaps are under 50 px; the band under the old plotly table was 185 px)."""

# every check of the page, in the page: labels in their plot's area (each cartesian subplot's
# drag rectangle is its plot area), the figure's own labels in its box, cells whole, and the
# vertical extent of everything drawn (text, tables, plot areas), to find the widest gap
LAYOUT = """() => {
  const bad = [], vw = document.documentElement.clientWidth, ink = [];
  const inside = (r, box, pad) => r.left >= box.left - pad && r.right <= box.right + pad &&
                                  r.top >= box.top - pad && r.bottom <= box.bottom + pad;
  const add = (el) => { const r = el.getBoundingClientRect();
    if (r.width > 0 && r.height > 0) ink.push([r.top + scrollY, r.bottom + scrollY]); };
  document.querySelectorAll('h1, p.how, table td, table th').forEach(add);
  for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    const box = gd.getBoundingClientRect();
    const title = (gd.querySelector('.gtitle') || {}).textContent;
    if (box.right > vw + 0.5) bad.push(['plot past the window', title, box.right, vw]);
    for (const drag of gd.querySelectorAll('.draglayer .nsewdrag')) {
      const area = drag.getBoundingClientRect(), id = drag.getAttribute('data-subplot');
      add(drag);
      for (const t of gd.querySelectorAll(`.cartesianlayer .subplot.${id} .textpoint text, ` +
                                          `.cartesianlayer .subplot.${id} text.bartext`)) {
        const r = t.getBoundingClientRect();
        if (r.width && !inside(r, area, 1)) bad.push(['label leaves its plot', title, t.textContent]);
      }
    }
    for (const t of gd.querySelectorAll('.table .cell-rect')) add(t);
    for (const t of gd.querySelectorAll('.gtitle, .xtick text, .ytick text, .legend .bg, ' +
        '.legendtext, .xtitle, .ytitle, .annotation-text')) {
      const r = t.getBoundingClientRect();
      if (!r.width) continue;
      add(t);
      if (!inside(r, box, 0.5)) bad.push(['label outside its figure', title, t.textContent]);
    }
  }
  for (const c of document.querySelectorAll('table td, table th'))
    if (c.scrollWidth > c.clientWidth + 1) bad.push(['clipped cell', c.textContent]);
  if (document.documentElement.scrollWidth > vw + 0.5)
    bad.push(['page wider than the window', document.documentElement.scrollWidth, vw]);
  ink.sort((a, b) => a[0] - b[0]);
  let reach = ink[0][1], widest = [0, 0];
  for (const [top, bottom] of ink) {
    if (top - reach > widest[1]) widest = [Math.round(reach), Math.round(top - reach)];
    reach = Math.max(reach, bottom);
  }
  const head = Array.from(document.querySelectorAll('table thead th')).map(th => th.textContent);
  return {bad: bad, widest: widest, plots: document.querySelectorAll('.js-plotly-plot').length,
          head: head, rows: Array.from(document.querySelectorAll('table tbody tr')).map(
            tr => Array.from(tr.children).map(td => td.textContent)),
          labels: Array.from(document.querySelectorAll('.textpoint text')).map(t => t.textContent)};
}"""


@pytest.fixture
def report(tmp_path, monkeypatch):
    """The demo's report, its settings predicted on a machine of round rates."""
    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path / "cache"))
    cfg = ddpkit.TrainConfig(**{**DEMO, **SMALL})
    calibrate_with_round_rates(*[cfg.replace(checkpoint=c) for c in SEGMENTS])
    out = tmp_path / "report.html"
    table = demo(out=str(out), progress=False, predict=None, **SMALL)
    return out, table


def test_the_report_reads_cleanly_at_1280x800(report):
    playwright = pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import TimeoutError as PageTimeout

    path, table = report
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(path.as_uri())
            # each figure drawn (plotly draws on load; its responsive sizing follows)
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg')"
                                   ".length >= 4", timeout=60_000)
            # and the layout as asserted below once plotly's responsive sizing has settled it
            # (past 30 s, the asserts say what is wrong)
            with contextlib.suppress(PageTimeout):
                page.wait_for_function(f"() => {{ const g = ({LAYOUT})(); return g.plots == 4 &&"
                                       f" g.bad.length == 0 && g.widest[1] < {BAND_PX}; }}",
                                       timeout=30_000)
            got = page.evaluate(LAYOUT)
            shot = path.with_name("report-1280x800.png")
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("DDPKIT_SCREENSHOT_DIR"):
                shutil.copy(shot, Path(os.environ["DDPKIT_SCREENSHOT_DIR"]) / shot.name)
        finally:
            browser.close()
    assert got["plots"] == 4 and got["bad"] == [], got["bad"]
    assert got["widest"][1] < BAND_PX, ("a blank band across the page", got["widest"])
    # predicted beside measured, for the step time and for the peak, as the sweep has them
    assert got["head"][2:5] == ["step time (ms)", "activations", "peak"]
    assert got["head"][6:15] == ["measured", "IQR", "predicted", "error", "measured", "predicted",
                                 "measured", "predicted", "error"]
    assert [r[4] for r in got["rows"]] == [f"{v:.2f}" for v in table.predicted_step_ms]
    assert [r[9] for r in got["rows"]] == [fmt_bytes(v) for v in table.predicted_peak_bytes]
    assert "checkpoint=4" in [r[0] for r in got["rows"]] and got["labels"], got["labels"]
