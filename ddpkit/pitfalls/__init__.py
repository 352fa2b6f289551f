"""The pitfall lab: the known DDP + checkpointing + accumulation faults, each one a real run,
and the doctor that looks for the same faults in your own model.

``ddpkit.pitfalls.catalog()``, ``get(name)``, ``run(name, fixed=False)``.

`known.py` (the catalogue, as data) · `fixes.py` (each fix said once, for catalogue and doctor) ·
`runs.py` (a pitfall's broken and fixed runs on real ranks) · `ranks/` (what those ranks run, by family) ·
`scripts.py` (the pitfalls that need a fresh Python, kept as strings) · `doctor.py` (`doctor`,
imported with ddpkit) over `observe.py` (one watched forward/backward) and `rules.py` (one rule
per hazard). The catalogue, runners and rank code load on first use, so a rank process never
pays for them.
"""

_LAZY = {"catalog": ".known", "get": ".known", "Pitfall": ".known", "run": ".runs",
         "PitfallResult": ".runs"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ddpkit.pitfalls' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
