"""What the curriculum needs installed, each asked of this Python's own package metadata: ddpkit's
requirements (its dependencies and the ``lab`` extra), JupyterLab and the kernel it will start,
the widget front-ends (ipywidgets, anywidget, plotly's FigureWidget) and transformers/peft.

Each ``*_row`` returns ``(status, found, fix)``. "Compatible versions" means what pip means:
every requirement a package declares is met by what is installed (ipywidgets 8.1.9 needs
``jupyterlab_widgets~=3.0.17``), and the front-end JupyterLab loads for a widget package is
the one that package installed (not an older copy in another Jupyter data folder).
"""
from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path

from .curriculum import needing, numbers

LAB_FIX = 'pip install "ddpkit[lab]"'


def installed(dist):
    """The installed version of ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def ddpkit_requires(extra=None):
    """{name: Requirement} of ddpkit's dependencies (``extra=None``) or of one extra alone."""
    from packaging.requirements import Requirement

    out = {}
    try:
        lines = metadata.requires("ddpkit") or []
    except metadata.PackageNotFoundError:  # a checkout run without installing it
        return out
    for line in lines:
        req = Requirement(line)
        in_extra = req.marker is not None and req.marker.evaluate({"extra": extra or ""})
        if (req.marker is None and extra is None) or (extra and in_extra):
            out[_key(req.name)] = req
    return out


def _key(name):
    return name.lower().replace("-", "_").replace(".", "_")


def unmet(dist):
    """What ``dist`` itself requires (extras left out) that is missing or of another version,
    as 'jupyterlab_widgets 3.0.9 (ipywidgets 8.1.9 needs ~=3.0.17)'."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = installed(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have or 'missing'} ({dist} {installed(dist)} needs "
                       f"{req.specifier or 'it'})")
    return out


def versions_problem(dists, wanted, fix):
    """The first of ``dists`` that is missing, below ddpkit's ``wanted`` requirement or whose
    own requirements are unmet, as (dist, found, fix); None when there is none."""
    for dist in dists:
        have, req = installed(dist), wanted.get(_key(dist))
        if have is None:
            return dist, f"{dist} is not installed", fix
        if req is not None and not req.specifier.contains(have, prereleases=True):
            return dist, f"{dist} {have}, ddpkit needs {req.specifier}", fix
        broken = unmet(dist)
        if broken:
            return dist, "; ".join(broken), f"pip install -U {dist} " + " ".join(
                b.split()[0] for b in broken)
    return None


def jupyterlab_row():
    problem = versions_problem(("jupyterlab", "ipykernel"), ddpkit_requires("lab"), LAB_FIX)
    if problem:
        return ("fail", *problem[1:])
    return "ok", f"jupyterlab {installed('jupyterlab')}, ipykernel {installed('ipykernel')}", ""


def kernel_row():
    """The notebooks' kernel (``python3``) must be this Python, where ddpkit is installed."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        return "fail", "no python3 kernel", f"{sys.executable} -m ipykernel install --sys-prefix"
    exe = spec.argv[0]
    # jupyter_client runs sys.executable for these names (KernelManager.format_kernel_cmd)
    own = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
    if exe in own or os.path.realpath(exe) == os.path.realpath(sys.executable):
        return "ok", f"python3 runs this Python ({sys.executable})", ""
    return ("fail", f"the python3 kernel runs {exe}, not this Python ({spec.resource_dir})",
            f"{sys.executable} -m ipykernel install --sys-prefix")


FRONT_ENDS = ("jupyterlab_widgets", "anywidget", "plotly")  # each installs a JupyterLab extension


def _shipped_extensions(dist):
    """{extension name: its package.json} for each JupyterLab extension ``dist`` installed."""
    out = {}
    for f in metadata.files(dist) or []:
        parts = Path(f).parts
        if "labextensions" in parts and parts[-1] == "package.json":
            name = "/".join(parts[parts.index("labextensions") + 1:-1])
            out[name] = Path(metadata.distribution(dist).locate_file(f))
    return out


def _loaded_extension(name):
    """The package.json of extension ``name`` that JupyterLab loads: the first in its path."""
    from jupyter_core.paths import jupyter_path

    for folder in jupyter_path("labextensions"):
        candidate = Path(folder, name, "package.json")
        if candidate.is_file():
            return candidate
    return None


def _version_of(package_json):
    return json.loads(Path(package_json).read_text())["version"]


def front_end_problem():
    """Each widget package's JupyterLab extension, found where JupyterLab looks, and the one
    the package installed; (found, fix) of the first that is not, else (names, None)."""
    seen = []
    for dist in FRONT_ENDS:
        for name, shipped in _shipped_extensions(dist).items():
            loaded = _loaded_extension(name)
            if loaded is None:
                return (f"JupyterLab does not find {dist}'s front-end {name}",
                        f"pip install --force-reinstall --no-deps {dist}")
            if shipped.is_file() and _version_of(loaded) != _version_of(shipped):
                return (f"JupyterLab loads {name} {_version_of(loaded)} from {loaded.parent}, "
                        f"not the {_version_of(shipped)} that {dist} {installed(dist)} installed",
                        f"remove the older one: rm -r '{loaded.parent}'")
            seen.append(f"{name} {_version_of(loaded)}")
    return ", ".join(seen), None


def widgets_row():
    problem = versions_problem(("ipywidgets", "anywidget", "plotly"), ddpkit_requires(),
                               'pip install -U "ddpkit[lab]"')
    if problem:
        return ("fail", *problem[1:])
    import plotly.graph_objects as go

    try:  # plotly's FigureWidget is an anywidget (plotly >= 6): made here as a notebook makes it
        go.FigureWidget().close()
    except Exception as exc:
        return "fail", f"plotly's FigureWidget: {exc}", 'pip install -U plotly anywidget'
    found = (f"ipywidgets {installed('ipywidgets')}, anywidget {installed('anywidget')}, "
             f"plotly {installed('plotly')}")
    if installed("jupyter_core") is None:  # the JupyterLab row says what to install
        return "ok", found + "; front-ends not checked (no JupyterLab)", ""
    seen, fix = front_end_problem()
    if fix:
        return "fail", seen, fix
    return "ok", f"{found}; front-ends: {seen}", ""


def hf_row():
    problem = versions_problem(("transformers", "peft"), ddpkit_requires("lab"), LAB_FIX)
    if problem:
        dist, found, fix = problem
        return "fail", f"{found}: notebooks {numbers(needing(dist))} need it", fix
    return "ok", f"transformers {installed('transformers')}, peft {installed('peft')}", ""
