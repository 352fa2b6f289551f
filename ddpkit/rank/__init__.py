"""What runs inside a rank process.

`entry.py` (how a rank starts, serves its jobs and ends: `rank_main` for spawned ranks,
`torchrun_main` for torchrun's, one teardown) · `context.py` (`Context`, what the user's function
receives) · `output.py` (everything sent to the kernel: records, output lines) · `returns.py`
(a return value: its tensors' bytes beside the pickle) · `process_group.py` (joining, retiming
and destroying the process group).
"""
