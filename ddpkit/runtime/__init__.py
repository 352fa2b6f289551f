"""The kernel side of a run: start the rank processes, follow them, end them.

`launch.py` (`launch` and the checks made before any process exists) → `group.py` (the rank
processes, their pipes, the rendezvous store, reaping) → `handle.py` (`RunHandle`: the drain
thread that reads the ranks, names a culprit, watches for stalls; `RunResult`) · `pool.py`
(`Pool`: warm ranks between runs). Nothing here knows about models: a job is a function.
"""
