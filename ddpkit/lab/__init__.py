"""The Lab: a notebook's controls and live figures for one run at a time. Its widgets only edit
a config; runs go through `ddpkit.runs`, predictions through `ddpkit.predict`.

`lab.py` (`Lab`, put together) · `controls.py` (the table of its controls, one row each: field,
widget, to-config, from-config, live or not, the plots' mark) · `view.py` (the widgets, made
from the table) · `blocks.py` (the per-block checkpoint control) · `sync.py` (controls <->
config, the read-out, what is sent mid-run) · `runner.py` (starts runs on the shared pool, the
doctor's banner) · `follow.py` (one run followed: records to figures, the culprit's traceback) ·
`history.py` (the runs so far, a row each) · `plots.py` (`LivePlots`: loss, memory and time
per rank) · `peak_panel.py` (the step's peak beside the memory plot) · `timeline.py` (the
swimlanes and exposed communication, live) · `plan_panel.py` (the planner box, reporting to a
callback) · `fit.py` (each figure opened whole, redrawn to its box's width) · `background.py`
(the Lab's one predictor thread, which `Lab.close` ends; `Pace`, the figures' one rate limit).
"""
