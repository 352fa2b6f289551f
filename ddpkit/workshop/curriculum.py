"""The curriculum: the 16 notebooks, what each teaches and needs, where this install keeps them,
their copy into an attendee's folder, and the facilitator's table.

The notebooks live at the repository's top level (``notebooks/``). The wheel carries a copy made
when it is built (``setup.py``: the notebooks and ``notebooks/images/`` into
``ddpkit/workshop/notebooks/``); an editable install has no copy and reads the checkout's.
Each notebook's time and memory on 2 cores are measured by ``python -m bench.curriculum --write``,
which keeps them in ``timings.json`` beside this file and in the README's facilitator table.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

GiB = 2**30
MANIFEST = ".ddpkit-curriculum.json"  # in the attendee's folder: what was copied, by digest
LONG_S = 60  # a notebook estimated at this many seconds or more is named in the check's verdict


@dataclass(frozen=True)
class Notebook:
    name: str  # the file's stem, "01_launch"
    teaches: str  # what it teaches, in one line
    ranks: int = 2  # the most rank processes one of its runs starts (0: predictions only)
    packages: tuple = ()  # what it imports beyond ddpkit's own dependencies

    @property
    def file(self):
        return f"{self.name}.ipynb"

    @property
    def number(self):
        return self.name.split("_")[0]


NOTEBOOKS = (
    Notebook("01_launch", "a function defined in a cell runs on real ranks; a failing rank is "
                          "named with its traceback; warm pools"),
    Notebook("02_checkpointing", "activation memory against recompute as segments change, "
                                 "measured beside the estimate"),
    Notebook("03_accumulation", "accumulation is the big batch's step with one micro-batch's "
                                "activations; `no_sync` and the all-reduces"),
    Notebook("04_pitfalls", "the classic DDP + checkpointing failures: symptom, torch's error, "
                            "cause, fix"),
    Notebook("05_precision", "what bf16 autocast saves (and adds) in memory; compressed "
                             "all-reduces"),
    Notebook("06_sharding", "DDP, ZeRO-1 and FSDP byte for byte, measured and predicted"),
    Notebook("07_save_resume", "a resumed run is the run that never stopped; a rank killed "
                               "mid-save"),
    Notebook("08_lab", "the Lab: move a slider mid-run and watch memory answer"),
    Notebook("09_your_model", "your own model (a transformers GPT-2): its blocks, memory per "
                              "block, a setting measured", packages=("transformers",)),
    Notebook("10_plan", "a checkpoint plan under a memory budget, checked on real ranks",
             packages=("transformers",)),
    Notebook("11_more_pitfalls", "GPT-2's own checkpointing, accumulation-loop slips and three "
                                 "more errors", packages=("transformers",)),
    Notebook("12_peak", "the step's peak by phase and kind: GPT-2 small at real shapes",
             packages=("transformers",)),
    Notebook("13_real_sizes", "Llama-3-8B and a 70B from configs alone: what fits where "
                              "(predictions)", ranks=0, packages=("transformers",)),
    Notebook("14_timeline", "what DDP does during backward: buckets, overlap, a simulated "
                            "slow link"),
    Notebook("15_reading_list", "the papers' claims (ZeRO, PowerSGD, LoRA) from real runs",
             ranks=4, packages=("transformers", "peft")),
    Notebook("16_step_time", "how fast: a step's time predicted beside measured, then on 8 "
                             "and 32 H100s (predictions)", packages=("transformers",)),
)
BY_NAME = {nb.name: nb for nb in NOTEBOOKS}

# A 60-minute session: (notebook, minutes with the room), in order. No transformers needed.
SHORT_TRACK = (("01_launch", 10), ("02_checkpointing", 15), ("03_accumulation", 10),
               ("08_lab", 15), ("04_pitfalls", 10))


def needing(package):
    """The notebooks that import ``package``."""
    return [nb for nb in NOTEBOOKS if package in nb.packages]


def numbers(notebooks):
    """'09, 10 and 12' for those notebooks."""
    n = [nb.number for nb in notebooks]
    return n[0] if len(n) == 1 else ", ".join(n[:-1]) + " and " + n[-1]


def shipped():
    """The curriculum's folder in this install: the wheel's copy, else the checkout's
    ``notebooks/`` (an editable install)."""
    copy = resources.files(__package__) / "notebooks"
    if copy.is_dir():
        return copy
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "notebooks").is_dir():
        return checkout / "notebooks"
    raise FileNotFoundError("this ddpkit install has no curriculum (it was built without "
                            "notebooks/): reinstall it from a wheel, pip install 'ddpkit[lab]'")


def files():
    """(path relative to the curriculum, bytes) of every notebook, then of their images."""
    root = shipped()
    out = [(nb.file, (root / nb.file).read_bytes()) for nb in NOTEBOOKS]
    images = root / "images"
    if images.is_dir():
        out += sorted((f"images/{p.name}", p.read_bytes()) for p in images.iterdir()
                      if p.is_file())
    return out


def version():
    try:
        return metadata.version("ddpkit")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "dev"


def _digest(data):
    return hashlib.sha256(data).hexdigest()


ACTIONS = ("copied", "updated", "up to date", "kept")


@dataclass
class Copied:
    path: str  # relative to the folder
    action: str  # one of ACTIONS
    beside: str | None = None  # for "kept": where the shipped one was put instead


def copy_into(folder):
    """Copy the curriculum into ``folder``, never over a file the attendee changed.

    A file is the attendee's when it differs from both the shipped one and what an earlier copy
    wrote (the digests in ``.ddpkit-curriculum.json``): it is kept, and the shipped one goes
    beside it as ``NAME.ddpkit-VERSION.ipynb``. A file untouched since an earlier copy is
    updated in place. Returns one `Copied` per file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / MANIFEST
    record = json.loads(record_path.read_text())["files"] if record_path.is_file() else {}
    done = []
    for rel, data in files():
        target, digest = folder / rel, _digest(data)
        if not target.exists():
            action = "copied"
        else:
            have = _digest(target.read_bytes())
            action = ("up to date" if have == digest
                      else "updated" if have == record.get(rel) else "kept")
        if action == "kept":  # the record keeps what was copied, so it stays theirs next time
            done.append(Copied(rel, action, _put_beside(target, data, digest)))
            continue
        if action != "up to date":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        record[rel] = digest
        done.append(Copied(rel, action))
    record_path.write_text(json.dumps({"ddpkit": version(), "files": record}, indent=1))
    return done


def _put_beside(target, data, digest):
    """Write ``data`` next to ``target`` under a name of its own (kept when already there)."""
    stem = f"{target.stem}.ddpkit-{version()}"
    for n in range(1, 100):
        beside = target.with_name(f"{stem}{'' if n == 1 else f'-{n}'}{target.suffix}")
        if not beside.exists():
            beside.write_bytes(data)
            return beside.name
        if _digest(beside.read_bytes()) == digest:
            return beside.name
    raise FileExistsError(f"{target}: 99 copies beside it already; remove some")


def timings():
    """The measured figures (``python -m bench.curriculum --write``): ``machine``, ``load``,
    ``probe_s`` (the check's speed probe there) and per notebook ``seconds`` and ``peak_bytes``."""
    return json.loads((resources.files(__package__) / "timings.json").read_text())


def estimate_s(factor, measured=None):
    """Each notebook's seconds here: its measured seconds times ``factor`` (how much slower
    this machine ran the check's probe than the machine that measured them)."""
    measured = measured or timings()
    return {name: row["seconds"] * factor for name, row in measured["notebooks"].items()}


def memory_needed(measured=None):
    """Bytes each notebook's kernel and ranks held together at their peak, as measured."""
    measured = measured or timings()
    return {name: row["peak_bytes"] for name, row in measured["notebooks"].items()}


def _needs(nb, peak_bytes):
    parts = [*nb.packages]
    if nb.ranks > 2:
        parts.append(f"{nb.ranks} ranks")
    parts.append(f"{peak_bytes / GiB:.1f} GiB")
    return ", ".join(parts)


def facilitator_table(measured=None):
    """The README's facilitator table, from the measured figures (markdown)."""
    measured = measured or timings()
    rows = ["| notebook | what it teaches | time on 2 cores | needs (memory: kernel and "
            "ranks at their peak) |", "|---|---|---|---|"]
    for nb in NOTEBOOKS:
        m = measured["notebooks"][nb.name]
        rows.append(f"| `{nb.file}` | {nb.teaches} | {m['seconds']:.0f} s | "
                    f"{_needs(nb, m['peak_bytes'])} |")
    total = sum(m["seconds"] for m in measured["notebooks"].values())
    track = sum(measured["notebooks"][name]["seconds"] for name, _ in SHORT_TRACK)
    steps = " → ".join(f"{name[:2]} ({minutes} min)" for name, minutes in SHORT_TRACK)
    apart = [f"{nb.number} (load average {measured['notebooks'][nb.name]['load']})"
             for nb in NOTEBOOKS if "load" in measured["notebooks"][nb.name]]
    return "\n".join(rows + [
        "", f"All {len(NOTEBOOKS)} run in {total / 60:.0f} min of computing "
            f"({measured['machine']}; load average {measured['load']}"
            + (f"; measured apart, after a change: {', '.join(apart)}" if apart else "") + ").",
        "", f"**60-minute short track** (no transformers needed; "
            f"{track / 60:.1f} min of it is computing): {steps}."])
