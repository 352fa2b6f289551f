"""The pitfall lab: the known DDP + checkpointing + accumulation faults, each one a real run.

``ddpkit.pitfalls.catalog()``, ``get(name)``, ``run(name, fixed=False)``. The doctor
(`ddpkit.doctor`) lives here too and is imported with ddpkit; the catalogue, its runners and
the rank code load on first use, so a rank process never pays for them.
"""

_LAZY = {"catalog": ".runs", "get": ".runs", "run": ".runs", "Pitfall": ".runs",
         "PitfallResult": ".runs"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ddpkit.pitfalls' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
