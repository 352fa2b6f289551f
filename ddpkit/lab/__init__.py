"""The Lab: a notebook's controls and live figures for one run at a time. Its widgets only edit
a config; runs go through `ddpkit.runs`, predictions through `ddpkit.predict`.

`lab.py` (`Lab`, put together) · `view.py` (the widgets) · `blocks.py` (the per-block
checkpoint control) · `controls.py` (controls <-> config, the read-out) · `runner.py` (the
shared pool, the doctor's banner) · `follow.py` (one run followed: records to figures, the
culprit's traceback) · `history.py` (the runs so far, a row each) · `plots.py` (`LivePlots`:
loss, memory and time per rank) · `peak_panel.py` (the step's peak beside the memory plot) ·
`timeline.py` (the swimlanes and exposed communication, live; the bucket and link controls) ·
`plan_panel.py` (the planner box) · `fit.py` (each figure opened whole, redrawn to its box's
width) · `background.py` (the read-out's simulations on threads).
"""
