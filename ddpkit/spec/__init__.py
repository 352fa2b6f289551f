"""What a run is, before anything trains: read alike by the config (which checks a run in these
words) and by the engine (which runs it), so that neither calls the other.

`names.py` (the words: built-in models, precisions, optimizers, probes, strategies, comm hooks,
and how a strategy's settings combine) · `setting.py` (`CheckpointSetting`: which blocks are
checkpointed, bound to the model's stacks; its text form and label) · `builtin.py` (the mlp
and gpt teaching models) · `model.py` (your own model: factory, data, loss given by name,
callable or import path; `ModelInfo` from one build on the meta device; building the model a
plan names, real or fake) · `empty.py` (a model built with no memory and no initialisation:
the order of ways, `TraceError`'s stage and op) · `blocks.py` (every stack of repeated blocks)
· `rng.py` (the process's RNG, forked by one thread at a time) · `plan.py` (`RankPlan`: what one
rank runs, the one thing the engine reads).
"""
