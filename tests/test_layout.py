"""The package's folders are its architecture: imports point one way, and every import resolves.

Read from the source (every import statement, those inside functions too), not from what a
session happens to have imported, so a lazy import that points upward or at a moved name fails
here rather than in the one notebook cell that reaches it.
"""
import ast
import dataclasses
import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import ddpkit

ROOT = Path(ddpkit.__file__).parent

# part -> the parts it may import (besides itself). Low to high: the shared leaves; what a run
# is (spec/: the models and how to read them without memory, their stacks, the checkpoint
# setting, the strategy names, the RankPlan), which both sides read; what runs inside a rank
# (rank/) and the training engine (engine/, which reads only a RankPlan), which know nothing of
# each other; the config (checked in spec's words, knowing nothing of the engine: it makes the
# RankPlan) and the kernel-side runtime (which knows nothing of models); the pitfalls and doctor;
# the predictions (nothing runs); real runs and their records; the Lab; the workshop (the
# curriculum and its check: it launches ranks, nothing more); the command line and the
# package root.
LEAVES = {"errors", "devices", "shipping", "slurm", "torch_private"}
ALLOWED = {
    "errors": set(),
    "devices": set(),
    "shipping": set(),
    "slurm": set(),
    "torch_private": set(),
    "spec": {"errors"},
    "engine": {"spec", "devices", "errors"},
    "rank": {"devices", "errors", "shipping"},
    "config": {"spec", "devices", "slurm"},
    "runtime": {"rank", "devices", "errors", "shipping"},
    "pitfalls": {"spec", "engine", "config", "runtime", "rank", *LEAVES},
    "predict": {"spec", "engine", "config", "runtime", *LEAVES},  # runtime: calibrate() runs ranks
    "runs": {"spec", "engine", "config", "runtime", "pitfalls", "predict", *LEAVES},
    "lab": {"spec", "engine", "config", "runtime", "predict", "runs", *LEAVES},
    # the workshop's check launches real ranks and asks where they would run; nothing more
    "workshop": {"runtime", "devices"},
    "cli": {"spec", "engine", "config", "runtime", "rank", "predict", "runs", "workshop", *LEAVES},
    "__main__": {"cli"},
    "__init__": {"spec", "engine", "config", "runtime", "rank", "predict", "runs", "lab",
                 "pitfalls", *LEAVES},
}


def part(module):
    """'ddpkit.engine.loop' -> 'engine'; 'ddpkit' -> '__init__'."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        is_pkg = name.endswith(".__init__")
        yield (name[: -len(".__init__")] if is_pkg else name), path, is_pkg


def imports(name, path, is_pkg):
    """(imported module, names taken from it, line) for every import statement in the file."""
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "ddpkit":
                yield base, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ddpkit":
                    yield a.name, [], node.lineno


def test_every_module_imports():
    for info in pkgutil.walk_packages(ddpkit.__path__, "ddpkit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def test_every_import_in_the_package_resolves():
    missing = []
    for name, path, is_pkg in modules():
        for target, names, line in imports(name, path, is_pkg):
            module = importlib.import_module(target)
            for n in names:
                if not hasattr(module, n):
                    try:
                        importlib.import_module(f"{target}.{n}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT.parent)}:{line}: {target}.{n}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_imports_point_one_way():
    upward = []
    for name, path, is_pkg in modules():
        here = "__main__" if name == "ddpkit.__main__" else part(name)
        for target, names, line in imports(name, path, is_pkg):
            targets = [target] if target != "ddpkit" else [f"ddpkit.{n}" for n in names] or [target]
            for t in targets:
                there = part(t)
                if there != here and there not in ALLOWED[here]:
                    upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {here} imports {t}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def _parts_imported(here):
    """The parts of the package that the modules of part ``here`` really import."""
    found = set()
    for name, path, is_pkg in modules():
        if part(name) == here:
            for target, names, _ in imports(name, path, is_pkg):
                targets = [f"ddpkit.{n}" for n in names] if target == "ddpkit" else [target]
                found |= {part(t) for t in targets} - {here}
    return found


def test_the_config_and_the_runtime_know_nothing_of_each_other():
    # read from the code, not from ALLOWED (a table can be edited to let an import through):
    # the config makes the plan the engine reads, in spec's words, and imports no engine; the
    # launcher runs functions, never models
    assert not {"runtime", "rank", "engine"} & _parts_imported("config")
    assert _parts_imported("spec") <= {"errors"}
    assert not {"config", "engine", "predict", "runs", "lab", "pitfalls"} & _parts_imported("runtime")
    assert not {"rank", "config", "runtime"} & _parts_imported("engine")
    assert not {"engine", "config", "runtime"} & _parts_imported("rank")


def test_the_engine_reads_a_rank_plan_not_the_config():
    # the kernel works out what a config derives (its model's blocks, the checkpoint setting on
    # its stacks, the probes) once, into a RankPlan; nothing in engine/ or rank/ names the config
    # or reaches for a method or property of it that a RankPlan does not have (read from the
    # source: an attribute of that name on anything but ``self``)
    from ddpkit.config import TrainConfig
    from ddpkit.spec.plan import RankPlan

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    derived = {n for n, v in vars(TrainConfig).items() if not n.startswith("__")
               and (callable(v) or isinstance(v, property))} - fields
    only_the_config = derived - set(dir(RankPlan)) - {f.name for f in dataclasses.fields(RankPlan)}
    assert {"info", "blocks_path", "rank_plan", "to_cli"} <= only_the_config  # it can fail
    found = []
    for name, path, _ in modules():
        if part(name) not in ("engine", "rank"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            said = ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""
            if (isinstance(node, ast.Name) and node.id in ("TrainConfig", "cfg")) or (
                    isinstance(node, ast.Attribute) and node.attr in only_the_config
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {said}")
    assert not found, "the engine reaches into the config:\n" + "\n".join(found)


# what one person reads in one sitting (README, "Files small enough to read")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 70


def test_modules_and_functions_are_small_enough_to_read():
    long_modules, long_functions = [], []
    for name, path, _ in modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} (line {node.lineno}): {n} lines")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def _uses_outside_the_package():
    """(file, line, module path) for every ddpkit import in tests, bench and notebook cells."""
    import json

    repo = ROOT.parent
    sources = [(p, p.read_text()) for p in [*repo.glob("tests/**/*.py"), *repo.glob("bench/*.py")]]
    for nb in sorted(repo.glob("notebooks/*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        sources.append((nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    for path, text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a notebook cell with IPython syntax: read it line by line below
            tree = ast.parse("\n".join(l for l in text.splitlines()
                                       if l.lstrip().startswith(("import ddpkit", "from ddpkit"))))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] == "ddpkit":
                yield path, node.lineno, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "ddpkit":
                        yield path, node.lineno, a.name, []


def _origin(full, imported_as_module=True):
    """Where ``full`` would be imported from; None for a function or class of the package
    (``from ddpkit import train``), which is no module."""
    parent, _, name = full.rpartition(".")
    if parent and not imported_as_module:
        obj = getattr(importlib.import_module(parent), name, None)
        if obj is not None and not isinstance(obj, types.ModuleType):
            return None
    spec = importlib.util.find_spec(full)
    return "nowhere" if spec is None else spec.origin


def test_tests_bench_and_notebooks_import_this_package_only():
    # a module path that no longer exists here must fail, not be found elsewhere (an older
    # ddpkit installed in the environment would otherwise answer for it, silently)
    wrong = []
    for path, line, module, names in _uses_outside_the_package():
        for full, as_module in [(module, True)] + [(f"{module}.{n}", False) for n in names]:
            origin = _origin(full, as_module)
            if origin is not None and ROOT not in Path(origin).resolve().parents:
                wrong.append(f"{path.name}:{line}: {full} comes from {origin}")
    assert not wrong, "\n".join(wrong)



def _graph():
    """module -> {modules it imports, at any depth of the file (inside functions too)}, read
    from the source; ``from ddpkit.x import y`` counts the submodule ``ddpkit.x.y`` where y is
    one, else ``ddpkit.x``."""
    names = {name for name, _, _ in modules()}
    graph = {}
    for name, path, is_pkg in modules():
        edges = set()
        for target, taken, _ in imports(name, path, is_pkg):
            subs = [f"{target}.{t}" for t in taken if f"{target}.{t}" in names]
            edges |= set(subs) or {target}
            if len(subs) < len(taken):  # names from the module itself, not its submodules
                edges.add(target)
        graph[name] = {e for e in edges if e in names and e != name}
    return graph


def _cycle(graph):
    """One import loop as a list of modules, or None (depth-first search)."""
    colour, stack = {}, []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = "black"
        return None

    for node in sorted(graph):
        if node not in colour:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_loop_between_modules():
    # a package's __init__ re-exports what is below it: its edges to its own submodules are
    # not loops (the submodule never needs the package's names), so they are left out
    graph = {m: {e for e in edges if not e.startswith(m + ".")} for m, edges in _graph().items()}
    loop = _cycle(graph)
    assert loop is None, "an import loop: " + " -> ".join(loop)


def _imports_inside_functions():
    """(file:line, the import, the comment on its line or the line above) for every import of
    a ddpkit module inside a function."""
    out = []
    for name, path, is_pkg in modules():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    own = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                           .startswith("ddpkit"))) or (isinstance(node, ast.Import) and any(
                               a.name.startswith("ddpkit") for a in node.names))
                    if own:
                        line = lines[node.lineno - 1]
                        above = lines[node.lineno - 2] if node.lineno > 1 else ""
                        reason = (line.partition("#")[2] or above.strip().partition("#")[2]).strip()
                        out.append((f"{path.relative_to(ROOT.parent)}:{node.lineno}",
                                    line.strip(), reason))
    return out


def test_imports_inside_functions_are_few_and_each_says_why():
    inside = {(where, what): why for where, what, why in _imports_inside_functions()}
    unexplained = [f"{where}: {what}" for (where, what), why in inside.items() if not why]
    assert not unexplained, ("an import inside a function, with no comment saying why it is not "
                             "at the top of its module:\n" + "\n".join(unexplained))
    assert len(inside) <= 15, f"{len(inside)} imports inside functions: " + "\n".join(
        f"{w}: {i}" for w, i in inside)


def test_import_ddpkit_leaves_fsdps_tensor_package_unimported():
    # every kernel, the rank server and most tests import ddpkit: torch.distributed.tensor
    # (DTensor, about a second of it on two cores) is FSDP's, imported when FSDP is used
    code = "import sys, ddpkit; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])
