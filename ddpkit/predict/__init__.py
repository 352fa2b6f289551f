"""Predictions: what a config will cost per rank, before any rank starts. Nothing here runs a
rank or draws a widget; imports point one way, down this list.

`units.py` (byte units) · `gpus.py` (cards and the bytes each leaves a step) · `attention.py`
(what each device's SDPA kernel keeps) · `fakeworld.py` (the fake process group a simulated
rank runs in, and what it adjusts) · `trace.py` (one micro-batch traced on fake tensors:
activations per setting and block, FLOPs) · `simulate.py` (one rank's whole step simulated on
fake tensors: every live byte after every op) · `datadep.py` (what sizes a data-dependent op:
the batch's values, the routing assumed, an upper bound) · `layouts.py`, `pieces.py`,
`compose.py` (a large model's step composed from per-block pieces of the model cut to a few
blocks) · `scale.py` (a large model's op stream, for the step time, from 3 and 4 blocks) ·
`peak.py` (the step's peak, answered and memoised) · `fits.py` (`fits`,
`largest_micro_batch`) · `estimate.py` (`estimate`: bytes per rank, by formula or trace) ·
`zero.py` (the ZeRO paper's Table 1 and communication rule) · `plan.py` (`plan`: which blocks
to checkpoint under a memory budget).
"""
