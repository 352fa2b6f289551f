"""ddpkit: explore DDP, activation checkpointing, gradient accumulation and precision, live.

The folders are the architecture, and imports point one way (tests/test_layout.py checks it):
``errors``, ``devices``, ``shipping`` (shared by kernel and ranks) ← ``spec/`` (what a run is:
models, stacks, the checkpoint setting, strategy names, the `RankPlan`) ← ``engine/`` (trains a
`RankPlan` on a rank) and ``rank/`` (inside a rank process) ← ``config`` (checked in spec's
words; makes the `RankPlan`, imports no engine) and ``runtime/`` (the kernel side of a run) ←
``pitfalls/`` (the catalogue and the doctor) ←
``predict/`` (estimate, the step's peak, plan: nothing runs) ← ``runs/`` (train, sweep, their
results) ← ``lab/`` (the Lab: widgets and live figures) ← ``cli`` and this file.

Light at import: rank processes import this package too, so the notebook-only parts
(widgets, plots) and the pitfall runners load on first use.

The torch here is checked first (`torch_private.check_torch`): a release outside the supported
range fails this import with the range and the fix, not a run deep inside.
"""
from .torch_private import check_torch

check_torch()

from .errors import RankError, RankStalled, TraceError
from .runtime.handle import RunHandle, RunResult
from .runtime.launch import launch
from .runtime.pool import Pool, shutdown
from .config import TrainConfig
from .predict.estimate import Estimate, estimate
from .pitfalls.doctor import Finding, doctor  # needs only torch at import
from .predict.fits import fits, largest_micro_batch
from .predict.planner import plan
from .predict.calibrate import calibrate
from .spec.setting import CheckpointSetting
from .rank.context import Context
from .runs.prose import say
from .runs.result import TrainResult
from .runs.sweep import sweep
from .runs.train import train

__version__ = "0.1.0"

# loaded on first use: name -> module (the attribute of the same name, or the module itself)
_LAZY = {"Lab": ".lab.lab", "LivePlots": ".lab.plots", "pitfalls": ".pitfalls",
         "tradeoff": ".runs.demo", "comm_figure": ".runs.figures"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(_LAZY[name], __name__)
        return module if module.__name__.endswith("." + name) else getattr(module, name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


__all__ = ["CheckpointSetting", "calibrate", "Context", "Estimate", "Finding", "Pool", "RankError",
           "RankStalled", "RunHandle", "RunResult", "TraceError", "TrainConfig", "TrainResult",
           "doctor", "estimate", "fits", "largest_micro_batch", "launch", "plan", "say",
           "shutdown", "sweep", "train"]
