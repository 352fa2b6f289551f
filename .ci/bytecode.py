"""Write the bytecode of the installed packages and of ddpkit, one share of the files per core.

Usage: python .ci/bytecode.py DIR...

Where PYTHONDONTWRITEBYTECODE is set (these machines set it) no process writes bytecode, so every
process, each rank included, would compile its imports again: with no bytecode at all the full
test run took 1.5x. `pip` compiles on one core, and `python -m compileall -j 0` sends the files
to its workers one at a time, which doubled its CPU time here (49 CPU-s for site-packages against
25 in one process). So each worker here gets a few large shares.

Skipped: what a ddpkit process does not import. Packages' test folders, pip and setuptools, and
transformers' ~450 model families: a family is compiled when a model of it is first built, in
~10 ms (GPT-2's modelling file: 8 ms). Measured by the access times of the bytecode after a full
test run: 4,527 of 15,930 files were read, 40 of them in the skipped folders (ten families).
A file that does not compile (a package's test data) is left as compileall leaves it.
"""
import compileall
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

SKIP = re.compile(r"[/\\](tests?|pip|setuptools)[/\\]|[/\\]transformers[/\\]models[/\\]")


def sources(roots):
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and not SKIP.search(path):
                    yield path


def compile_share(paths):
    return sum(not compileall.compile_file(p, quiet=2) for p in paths)


def main(roots):
    files = sorted(sources(roots))
    workers = os.cpu_count() or 1
    shares = [files[i::4 * workers] for i in range(4 * workers)]  # a few each: they even out
    with ProcessPoolExecutor(workers) as pool:
        failed = sum(pool.map(compile_share, shares))
    print(f"bytecode: {len(files) - failed} files compiled or current, {failed} left as source")


if __name__ == "__main__":
    main(sys.argv[1:])
