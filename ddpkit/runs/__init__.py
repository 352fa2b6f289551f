"""Real runs from the kernel, and their records read: above the predictions, which they are set
beside, and below the Lab, which drives them.

`train.py` (`train`: checks, the doctor, a launch of `engine.loop.train_rank`) · `predicted.py`
(the run's step time and peak predicted beside it, on a low-priority thread) · `result.py`
(`TrainResult`: summary, timeline, overlap, swimlanes) · `sweep.py` (`sweep`: one run per grid
point, measured beside predicted) · `timeline.py` (the timeline's rows as DataFrames, exposed
communication, DDP's own statistics beside them) · `figures.py` (the static figures:
swimlanes measured and predicted, exposed communication, bytes sent by collective) ·
`report.py` (the trade-off, the demo's HTML report) · `demo.py` (``ddpkit demo``: a sweep
written as that report) · `prose.py` (`say`: a sentence with its figures, from the values:
Markdown in a notebook, plain text elsewhere).
"""
