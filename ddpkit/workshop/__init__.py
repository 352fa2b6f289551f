"""The workshop: the curriculum that ships with the package (`curriculum`), the pre-flight that
says whether this machine runs it (`check`, `packages`), and JupyterLab started on a copy of it
(`jupyter`). ``ddpkit check`` and ``ddpkit workshop [DIR]`` are its command lines.

Nothing here is imported by the rest of ddpkit; it uses the runtime (a real 2-rank launch) and
nothing above it.
"""
