"""ddpkit: explore DDP, activation checkpointing, gradient accumulation and precision, live.

Light at import: rank processes import this package too, so the notebook-only parts
(widgets, plots) load on first use.
"""
from .errors import RankError, RankStalled
from .launcher import Pool, RunHandle, RunResult, launch
from .config import TrainConfig
from .estimate import Estimate, estimate  # binds the function over the submodule's name
from .doctor import Finding, doctor  # likewise; doctor.py needs only torch at import
from .plan import plan  # likewise
from .policies import CheckpointSetting
from .rank import Context
from .train import TrainResult, sweep, train

__version__ = "0.1.0"

# loaded on first use: name -> module (the attribute of the same name, or the module itself)
_LAZY = {"Lab": ".widgets", "LivePlots": ".plots", "pitfalls": ".pitfalls", "tradeoff": ".report"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(_LAZY[name], __name__)
        return module if module.__name__.endswith("." + name) else getattr(module, name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


__all__ = ["CheckpointSetting", "Context", "Estimate", "Finding", "Pool", "RankError", "RankStalled", "RunHandle",
           "RunResult", "TrainConfig", "TrainResult", "doctor", "estimate", "launch", "plan",
           "sweep", "train"]
