"""Prose with figures in it, said from the values: ``ddpkit.say(f"...")`` shows Markdown in a
notebook (the cell's output, drawn as a markdown cell is) and prints plain text elsewhere (a
script, a terminal, a log). A sentence of the curriculum that carries a measured or predicted
figure is said so, in the cell that computes it, and cannot go stale: the test of the notebooks'
prose fails on a figure typed into a markdown cell (tests/test_notebook_prose.py)."""
from __future__ import annotations

import re

_MARKUP = re.compile(r"\*\*(.+?)\*\*|`([^`]*)`")


def in_notebook():
    """True in a Jupyter kernel (the shell has a kernel); False in a script or IPython's
    terminal, which draw no Markdown."""
    try:
        from IPython import get_ipython
    except ImportError:  # IPython comes with the lab extra; a script may run without it
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def say(text):
    """Show ``text`` (Markdown) as the cell's output in a notebook; elsewhere print it as plain
    text (no ``**`` or backticks). Returns None, so a cell that ends with it shows it once."""
    if in_notebook():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(_MARKUP.sub(lambda m: m[1] if m[1] is not None else m[2], text))
