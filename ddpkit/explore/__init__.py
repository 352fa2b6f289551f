"""The kernel-side tools for exploring: train, measure, predict, plan, watch.

`api.py` (`train`, `sweep`, `TrainResult`: checks, then a launch of `engine.loop.train_rank`) ·
`estimate.py` (predicted bytes per rank, traced under FakeTensorMode) · `plan.py` (a checkpoint
choice under a memory budget) · `units.py` (byte units) · `widgets.py` (the `Lab`, put together
from `lab_view.py`, `lab_config.py`, `lab_runs.py`, `lab_follow.py`, `lab_history.py`) · `plots.py`
(live figures) · `plan_panel.py` (the Lab's planner box) · `demo.py` (``ddpkit demo``: a sweep
written as an HTML report).
"""
