"""The set-up stays one story: pyproject.toml, environment.yml, README and .ci/run agree."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def pyproject_reqs():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + [r for extra in meta["optional-dependencies"].values()
                                   for r in extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def environment_reqs():
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    out = {}
    for line in lines[start + 1:]:
        item = line.strip()
        if not item.startswith("- ") or item.startswith("- -e"):
            continue
        req = Requirement(item[2:])
        out[req.name.lower()] = req
    return out


def test_environment_yml_lists_the_same_packages_as_pyproject():
    py, env = pyproject_reqs(), environment_reqs()
    assert set(py) == set(env)
    for name, req in env.items():
        # each pin/range in environment.yml must satisfy pyproject's range
        pinned = [s.version for s in req.specifier if s.operator in ("==", ">=")]
        assert pinned, f"{name}: environment.yml needs a version"
        assert py[name].specifier.contains(pinned[0], prereleases=True), (name, req, py[name])


def test_pyproject_asks_for_the_torch_releases_ddpkit_supports():
    from ddpkit.torch_private import CHECKED, SUPPORTED

    (major, minor), _ = SUPPORTED
    assert str(pyproject_reqs()["torch"].specifier) == f">={major}.{minor}"
    assert environment_reqs()["torch"].specifier.contains(CHECKED[1])  # the default, checked


def test_environment_yml_pins_the_cpu_torch_the_setup_installs():
    assert str(environment_reqs()["torch"].specifier) == "==2.13.0"
    assert "torch==2.13.0" in (ROOT / ".ci" / "setup").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^```(?:bash|sh)\n(.*?)\n```", readme, re.S | re.M)
    test_cmd = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd.strip() in ci.splitlines()


def test_the_hf_extra_is_in_the_dev_tools_too():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(meta["hf"]) <= set(meta["dev"])


def test_the_lab_extra_is_a_workshop_set_up_and_in_the_dev_tools_too():
    """`pip install "ddpkit[lab]"` is an attendee's whole set-up: JupyterLab, its kernel and
    what the notebooks import (the hf extra); a developer's set-up runs the workshop too."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lab = {Requirement(r).name for r in meta["lab"]}
    assert {"jupyterlab", "ipykernel"} <= lab and set(meta["hf"]) <= set(meta["lab"])
    assert set(meta["lab"]) <= set(meta["dev"])


def test_the_slow_list_names_tests_that_exist():
    """tests/slow_tests.txt (the quick tier leaves these out) must not name a test that was
    renamed or removed: it would then mark nothing, and the quick tier would grow unseen."""
    import re
    from pathlib import Path

    here = Path(__file__).parent
    entries = [line for line in (here / "slow_tests.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert len(entries) > 50
    missing = []
    for entry in entries:
        path, func = entry.split("::")
        source = here.parent / path
        if not source.exists() or not re.search(rf"^def {func}\(", source.read_text(), re.M):
            missing.append(entry)
    assert missing == [], missing


def test_every_test_file_and_notebook_has_its_seconds():
    """tests/file_seconds.txt orders the full run's files longest first, so that the two xdist
    workers end together; a file it does not list starts last, and a long one there ends one
    worker late (test_step_time, test_datadep and test_named_hardware did: about 70 s of tests
    behind every listed file). Every test file and notebook is listed, and nothing else."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    listed = [line.split()[1] for line in (root / "tests" / "file_seconds.txt").read_text()
              .splitlines() if line.strip() and not line.startswith("#")]
    files = {p.relative_to(root).as_posix() for p in
             [*(root / "tests").rglob("test_*.py"), *(root / "notebooks").glob("*.ipynb")]}
    assert sorted(set(listed) - files) == [] and sorted(files - set(listed)) == []
    assert len(listed) == len(set(listed))
