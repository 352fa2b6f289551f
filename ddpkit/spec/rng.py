"""The process's global RNG, forked by one thread at a time.

ddpkit builds models and simulates steps on the kernel's threads (the Lab's read-out runs on
daemon threads) inside ``torch.random.fork_rng``, so that the kernel's RNG is left as it was:
building a model seeds it. But the CPU generator is one per process. A second thread that draws
from it, or reads it, while the first is inside its fork sees the first's seeded state, and the
first's restore then throws away what the second drew. The doctor reads it (did backward move
the RNG? then checkpointing recomputed dropout without its state) and found dropout in a model
with none, while the Lab simulated a step beside it.

`forked()` is ``fork_rng`` under one process-wide lock, and `LOCK` is what a reader of the RNG
holds across the span it compares.
"""
from __future__ import annotations

import contextlib
import threading

import torch

LOCK = threading.RLock()


@contextlib.contextmanager
def forked():
    """``torch.random.fork_rng`` over the CPU generator (CUDA's are per device and untouched by
    fake or meta builds), one thread at a time."""
    with LOCK, torch.random.fork_rng(devices=[]):
        yield
