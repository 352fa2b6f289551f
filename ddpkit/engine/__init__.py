"""The training engine: everything a rank needs to train a model, and nothing about how it was
started (it reads a config and a `Context`-like ``ctx``; it never imports the config, the
launcher or the rank's plumbing).

`models.py` (the built-in mlp and gpt, synthetic data) · `spec.py` (your own model: factory,
data, loss, what is in it) · `blocks.py` (finding the repeated blocks) · `policies.py`
(`CheckpointSetting` and the checkpoint policy it builds and applies) · `regions.py` (a segment
as one region on a loop the model owns) · `data.py` (datasets and
per-rank batches) · `strategies.py` (ddp, ZeRO-1, FSDP: wrap after checkpointing) · `step.py`
(one optimizer step, rank-agnostic) · `probes.py` (memory, comm, time, FLOPs) · `measure.py`
(the probes a run turned on and when each reads) · `saving.py`
(atomic checkpoints, exact resume) · `rng.py` (the process's RNG, forked by one thread at a
time) · `loop.py` (`train_rank`: the loop each rank runs).
"""
