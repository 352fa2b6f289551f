"""The training engine: everything a rank needs to train the `spec.plan.RankPlan` it is handed,
and nothing about how it was started (it reads the plan and a `Context`-like ``ctx``; it never
imports the config, the launcher or the rank's plumbing).

`policies.py` (`CheckpointPolicy`: a checkpoint setting installed on a model's blocks) ·
`regions.py` (a segment as one region on a loop the model owns) · `data.py` (the built-in
synthetic data, your dataset, per-rank batches) · `strategies.py` (ddp, ZeRO-1, ZeRO-2, FSDP,
HSDP: wrap after checkpointing; compression hooks) · `step.py` (one optimizer step,
rank-agnostic) · `probes.py` (activations, comm hook, time, FLOPs) · `collectives.py` (every
collective, counted at the dispatcher) · `memory.py` (the step's peak: Peak, the CPU/CUDA
probe) · `ledger.py` (what the bytes at a moment of the step are, frees on gloo's thread
included) · `measure.py` (the probes a run turned on and when each reads) ·
`timeline.py` (the timeline probe and the simulated link) · `saving.py` (atomic checkpoints,
exact resume) · `loop.py` (`train_rank`: the loop each rank runs).
"""
