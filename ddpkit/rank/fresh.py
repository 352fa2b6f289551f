"""What a pool's rank undoes after each job, so the next job sees what a fresh launch would.

A warm rank serves many jobs in one process, and a job may change process-wide state: torch's
default dtype or device, grad mode, anomaly mode, the thread count, the reduced-precision and
attention-kernel switches, ``os.environ``, the working directory, ``sys.path``, the warning
filters, a compiled function's cache. `Baseline` is taken once the rank is up, before its first
job, and put back after every job; then the job's garbage is collected and, on CUDA, the cache
emptied. Before each job, ``os.environ`` and ``sys.path`` become the kernel's of that launch
(`Baseline.enter`), and the RNGs and the kernel's determinism and float32-precision flags are
set (`ddpkit.rank.entry.apply_job_state`), as in a fresh rank.

What a job stores on purpose in a module that outlives it (``some_module.cache = tensor``)
stays: only a new process forgets that. ``tests/test_shared_pool.py`` runs a job that changes
all of the above and checks that the next job gives bitwise the records and weights of a fresh
launch.
"""
from __future__ import annotations

import gc
import os
import sys
import warnings

import torch

_SWITCHES = [  # (getter, setter) of torch's process-wide switches a job may flip
    (lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", v)),
    (lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", v)),
    (lambda: torch.backends.cuda.matmul.allow_fp16_accumulation,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", v)),
    (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    (lambda: torch.backends.cudnn.enabled, lambda v: setattr(torch.backends.cudnn, "enabled", v)),
    (lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    (torch.is_anomaly_check_nan_enabled, None),  # set with anomaly mode below
]


class Baseline:
    """The rank's process-wide state before its first job: ``restore()`` puts it back after each
    job, ``enter(job)`` gives the next job the kernel's environment and import path.
    ``inherited``: the environment the rank started with (the kernel's), so that what the rank
    set for itself at start (RANK, MASTER_PORT, GLOO_SOCKET_IFNAME, ...) is known."""

    def __init__(self, inherited):
        self.own = {k: v for k, v in os.environ.items() if inherited.get(k) != v}
        self.cwd = os.getcwd()
        self.warning_filters = list(warnings.filters)
        self.threads = torch.get_num_threads()
        self.default_dtype = torch.get_default_dtype()
        self.default_device = torch.get_default_device()
        self.anomaly = torch.is_anomaly_enabled()
        self.switches = [get() for get, _ in _SWITCHES]

    def enter(self, job):
        """Before a job: the kernel's ``os.environ`` and ``sys.path`` as they were at its launch
        (a fresh rank inherits those), with this rank's own variables over them. Every job
        carries them (`ddpkit.runtime.launch.make_job`), so `restore` leaves both alone."""
        merged = {**job["environ"], **self.own}
        if merged != dict(os.environ):
            os.environ.clear()
            os.environ.update(merged)
        sys.path[:] = job["sys_path"]

    def restore(self):
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()  # the module's cache of which warnings were already shown
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.default_dtype)
        torch.set_default_device(None if self.default_device == torch.device("cpu")
                                 else self.default_device)
        torch.set_grad_enabled(True)
        for (_, set_), value in zip(_SWITCHES, self.switches):
            if set_ is not None:
                set_(value)
        torch.autograd.set_detect_anomaly(self.anomaly, check_nan=self.switches[-1])
        if "torch._dynamo" in sys.modules:  # compiled code cached for the last job's functions
            sys.modules["torch._dynamo"].reset()


def release_memory(device):
    """The last job's reference cycles freed and, on CUDA, the cached blocks returned, so the
    next job's peak_bytes is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
