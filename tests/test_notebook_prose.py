"""The curriculum says what it shows: a figure in a notebook's prose is said by the cell that
computed it (``ddpkit.say(f"...")``), never typed into a markdown cell, where it goes stale the
day the code moves (issue #46: twelve such sentences contradicted their own outputs). And every
notebook ends alike: take-aways, ``ddpkit.shutdown()``, a check that no process is left."""
import ast
import json
import re
from pathlib import Path

import pytest

import ddpkit
from ddpkit.predict import gpus

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

_NUM = r"(?<![\w.,\-])\d[\d,]*(?:\.\d+)?(?:\s*[-–]\s*\d[\d,]*(?:\.\d+)?)?"
FIGURE = re.compile(
    _NUM + r"(?:\s*[KMGT]i?B\b|\s+B\b|\s*bytes?\b|\s*%|\s*(?:ms|µs|us|s|min|minutes?|seconds?)\b"
           r"|[×x](?!\w))|\*\*[~≈]?\d[\d,.]*\*\*")
"""A byte, KiB/MiB/GiB, %, ms, s or × figure, as prose types one ("139 KB", "2-3 minutes",
"1.16×"), or a bare number set in bold ("about **1.16**"); not a model's name ("Llama-3-8B",
"H100-80GB") or a product of counts ("4 × 4")."""

# What prose may type: formulas and published figures, each with where it comes from. A constant
# of this package or of torch is checked against its source below, so it cannot go stale either.
ALLOWED = {
    r"16 bytes per\s+parameter": "the ZeRO paper's mixed-precision Adam (2 + 2 + 12 bytes)",
    r"5 bytes per score": "Korthikanti et al. 2022, their attention scores' bytes",
    r"(?<![\d.])1\.5×|(?<![\d.])1×": "the ZeRO paper's communication volume (§7): 1.5× DDP's",
    r"2\s+bytes": "a bf16 number's size (torch.finfo(torch.bfloat16).bits / 8)",
    r"25 MiB": "DDP's default bucket_cap_mb (torch's DistributedDataParallel docs)",
    r"1 MiB": "DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)",
    r"30 minutes": "torch's default process-group timeout (default_pg_timeout)",
    r"80 GB": "an 80 GB card's name (H100-80GB, A100-80GB: NVIDIA's data sheets)",
    r"within 3%|contract is 10%": "the estimates' contracts: the peak, activations (README)",
    r"within 0\.1% of each other": "two phases tie (ddpkit.engine.memory.TIE)",
    r"CUDA\s+context \(0\.5 GiB\)": "ddpkit.predict.gpus.CUDA_CONTEXT",
    r"allocator\s+reserve \(5%\)|5% allocator\s+reserve": "ddpkit.predict.gpus.ALLOCATOR_RESERVE",
}


def markdown_cells():
    for nb in NOTEBOOKS:
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield nb.name, i, "".join(cell["source"])


def typed_figures(text):
    """The figures typed into ``text`` that no entry of `ALLOWED` covers."""
    allowed = [m.span() for pattern in ALLOWED for m in re.finditer(pattern, text)]
    return [m[0] for m in FIGURE.finditer(text)
            if not any(a <= m.start() and m.end() <= b for a, b in allowed)]


def test_no_figure_is_typed_into_a_notebooks_prose():
    typed = [f"{name} cell {i}: {found}" for name, i, text in markdown_cells()
             if (found := typed_figures(text))]
    assert not typed, ("a figure typed by hand goes stale: say it from the value, in the cell "
                       "that computes it (ddpkit.say(f'...')):\n" + "\n".join(typed))


@pytest.mark.parametrize("text, found", [
    ("139 KB each, against 89 KB", ["139 KB", "89 KB"]), ("about 2-3 minutes", ["2-3 minutes"]),
    ("1.16× the FLOPs", ["1.16×"]), ("1.3x the sum", ["1.3x"]), ("off by 5,128 B", ["5,128 B"]),
    ("shows about **1.16**", ["**1.16**"]),
    ("10.29 GiB, 40%, ~50 ms a rank, ~1.5 s", ["10.29 GiB", "40%", "50 ms", "1.5 s"]),
    ("Llama-3-8B on an H100-80GB, 4 × 4 samples, 16Ψ/N, 5 steps", []),
    ("16 bytes per parameter, ZeRO-3 1.5× that, 25 MiB by default", []),
])
def test_the_scanner_finds_what_prose_types(text, found):
    assert typed_figures(text) == found


def test_the_allowed_constants_are_the_packages_and_torchs():
    import torch
    import torch.distributed.constants

    from ddpkit.engine.memory import TIE

    assert gpus.CUDA_CONTEXT == 2**29 and gpus.ALLOCATOR_RESERVE == 0.05 and TIE == 1e-3
    assert torch.distributed.constants.default_pg_timeout.total_seconds() == 30 * 60
    assert torch.distributed._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert torch.finfo(torch.bfloat16).bits == 16


def _ending(nb):
    cells = json.loads(nb.read_text())["cells"]
    text = lambda c: "".join(c["source"])
    last_md = max(i for i, c in enumerate(cells) if c["cell_type"] == "markdown")
    return cells, text, last_md


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_ends_with_take_aways_a_shutdown_and_no_process_left(nb):
    cells, text, last_md = _ending(nb)
    # the take-aways are the last prose, a list, and only the closing cell comes after them
    takeaways = text(cells[last_md])
    assert re.search(r"^## Take-aways\n", takeaways, re.M), f"{nb.name}: no take-aways at the end"
    assert len(re.findall(r"^\* ", takeaways.split("## Take-aways", 1)[1], re.M)) >= 2
    assert last_md == len(cells) - 2 and cells[-1]["cell_type"] == "code", nb.name
    # the closing cell ends the kernel's shared ranks, then asserts no child process is left
    tree = ast.parse(text(cells[-1]))
    calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    asserts = [n for n in tree.body if isinstance(n, ast.Assert)]
    assert "ddpkit.shutdown" in calls, f"{nb.name}: no ddpkit.shutdown() at the end"
    assert "psutil.Process().children" in calls and asserts, f"{nb.name}: no process check"
    shutdown = next(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "ddpkit.shutdown")
    assert asserts[-1].lineno > shutdown


def test_say_prints_plain_text_outside_a_notebook(capsys):
    assert ddpkit.say(f"the peak, **{1234:,d} B** in the `backward`") is None
    assert capsys.readouterr().out == "the peak, 1,234 B in the backward\n"


def test_say_shows_markdown_in_a_notebook():
    kernel = pytest.importorskip("ipykernel.inprocess.manager")
    km = kernel.InProcessKernelManager()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        msg_id = kc.execute("import ddpkit\nddpkit.say(f'the peak, **{1234:,d} B**')")
        shown = []
        while True:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] in ("display_data", "stream", "error"):
                shown.append((msg["msg_type"], msg["content"].get("data", msg["content"])))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert [(kind, data.get("text/markdown")) for kind, data in shown] == [
        ("display_data", "the peak, **1,234 B**")]
