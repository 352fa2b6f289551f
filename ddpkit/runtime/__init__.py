"""The kernel side of a run: start the rank processes, follow them, end them.

`launch.py` (`launch`; ``pool=`` in one meaning, "shared" | "fresh" | a `Pool`, and the one
check that a pool fits) → `job.py` (a launch's job and the checks made before any process
exists) → `group.py` (the rank processes, their pipes, the rendezvous store, reaping) →
`handle.py` (`RunHandle`: the drain thread that reads the ranks, names a culprit, watches for
stalls; `RunResult`) · `pool.py` (`Pool`: warm ranks between runs; the kernel's shared pools)
· `start.py` (how ranks start: forkserver or spawn). Nothing here knows about models: a job is
a function.
"""
