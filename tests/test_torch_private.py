"""The torch releases ddpkit supports: every private torch name it uses is listed in
`ddpkit.torch_private` and resolves on this torch (bench/torch_matrix.sh runs this on each
supported release), and a torch outside the range fails ``import ddpkit`` with the fix."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
from ddpkit import torch_private

ROOT = Path(ddpkit.__file__).parent

# private names of other libraries that ddpkit reaches (not torch's): plotly, ipywidgets,
# cloudpickle, multiprocessing, transformers, collections' namedtuples
NOT_TORCH = {"_repr_mimebundle_", "_config", "_dom_classes", "_trait_values", "_widget_layout",
             "_widget_data", "_responsiveChartHandler", "_context", "_dispatch_table",
             "_forkserver", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd",
             "_lock", "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa",
             "_gradient_checkpointing_func", "_fields", "_local", "_exit", "_filters_mutated",
             "_data", "_layout_obj", "_props", "_py2js_",
             # pieces of op and setting names, not names (the whole op names are listed)
             "_backward", "_view", "_foreach_", "_scaled_dot_product_", "_attention",
             # predict/optrace.py's list of free ops names it; no torch 2.11-2.15 has that op
             "_to_copy_view"}


def _trees():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT.parent), ast.parse(path.read_text())


def _own_names(trees):
    """Private names ddpkit defines itself: functions, classes, module and class variables,
    attributes it assigns, keywords it declares."""
    own = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                own.update(a.arg for a in node.args.args + node.args.kwonlyargs
                           if not isinstance(node, ast.ClassDef)) \
                    if not isinstance(node, ast.ClassDef) else None
            elif isinstance(node, (ast.Name, ast.Attribute)) and \
                    isinstance(node.ctx, ast.Store):
                own.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.slice, ast.Constant):
                own.add(node.slice.value)  # obj.__dict__["_name"] = ...
    return {n for n in own if isinstance(n, str) and n.startswith("_")}


def used_private_names():
    """(name, file) for every private torch name the package's source reaches: imports from
    torch's private modules or of private names, private attributes, and private names in
    strings (``getattr(obj, "_name")``); ddpkit's own and other libraries' left out."""
    trees = list(_trees())
    own = _own_names(trees) | NOT_TORCH
    out = set()
    for path, tree in trees:
        pieces = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
        for node in ast.walk(tree):
            if id(node) in pieces:  # a piece of an f-string, not a name
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("torch.") and "._" in node.value:
                out.add((node.value, path))  # sys.modules["torch._dynamo"]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                hidden = any(p.startswith("_") for p in node.module.split("."))
                out.update((f"{node.module}.{a.name}", path) for a in node.names
                           if hidden or a.name.startswith("_"))
            elif isinstance(node, ast.Import):
                out.update((a.name, path) for a in node.names if a.name.startswith("torch.") and
                           any(p.startswith("_") for p in a.name.split(".")))
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            else:
                continue
            if isinstance(node, (ast.Attribute, ast.Constant)) and name.startswith("_") and \
                    name.isidentifier() and not name.startswith("__") and name not in own:
                out.add((name, path))
    return out


def test_every_private_torch_name_the_package_uses_is_listed():
    listed = torch_private.PRIVATE
    parts = {p for name in listed for p in name.split(".")}
    unlisted = sorted(f"{name} ({path})" for name, path in used_private_names()
                      if not (name in parts or any(k.startswith(name + ".") or k == name
                                                   for k in listed)))
    assert not unlisted, ("private torch names used but not listed in ddpkit/torch_private.py "
                          "(add each, with where it is used): " + ", ".join(unlisted))


def test_every_listed_private_name_resolves_on_this_torch():
    import torch

    assert torch_private.missing() == [], torch.__version__


def test_a_torch_outside_the_range_is_refused_with_the_range_and_the_fix(monkeypatch):
    import torch.utils.checkpoint

    with pytest.raises(ImportError, match=r"ddpkit supports torch 2\.11 to 2\.15 \(checked on "
                                          r"2\.11\.0, 2\.13\.0, 2\.15\.0\); this Python has "
                                          r"torch 2\.10\.1\+cu128.*pip install 'torch>=2\.11'"):
        torch_private.check_torch("2.10.1+cu128")
    torch_private.check_torch("2.11.0+cu130")  # the lent GPU machines' torch
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0 is newer than the releases ddpkit "
                                         r"was checked on"):
        torch_private.check_torch("2.16.0")
    # a newer torch that dropped a name ddpkit uses
    monkeypatch.delattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop")
    with pytest.raises(ImportError, match=r"torch 2\.16\.0 is newer and lacks private names "
                                          r"ddpkit uses: torch\.utils\.checkpoint\."
                                          r"_enable_checkpoint_early_stop\. Install torch<=2\.15"):
        torch_private.check_torch("2.16.0")


def test_import_ddpkit_fails_at_once_on_an_older_torch():
    env = {k: v for k, v in os.environ.items() if k != "DDPKIT_TORCH_CHECK"}
    out = subprocess.run([sys.executable, "-c", "import torch; torch.__version__ = '2.9.0'; "
                          "import ddpkit"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "ImportError: ddpkit supports torch 2.11 to 2.15" in out.stderr.splitlines()[-1]
