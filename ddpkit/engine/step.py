"""One optimizer step with gradient accumulation. Knows nothing about ranks.

The loop a slide can show::

    for k, batch in enumerate(micro_batches):
        last = k == accum_steps - 1
        with (model.no_sync() if no_sync and not last else nullcontext()):  # all-reduce once
            loss = loss_fn(model, batch) / accum_steps  # scale: gradients sum over micro-batches
            loss.backward()
    optimizer.step(); optimizer.zero_grad()
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from ..spec.model import compute_loss, to_device

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(precision, device):
    """The autocast context for a precision name ('fp32' runs without autocast)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=PRECISION_DTYPES[precision])


@contextmanager
def _fsdp_no_sync(model):
    """FSDP2's counterpart of DDP.no_sync(): no reduce-scatter, and keep the gathered
    parameters between micro-steps (no reshard) since the next forward needs them again."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def skip_sync(model):
    """The context that skips gradient sync for a micro-step, or None if the model has none."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return None


def train_step(model, optimizer, micro_batches, *, accum_steps, no_sync=True, precision="fp32",
               device="cpu", scaler=None, activation_probe=None, inner=None, scale_loss=True,
               scheduler=None, loss_fn=None, phase=None, read_loss=True):
    """Run ``accum_steps`` micro-batches and one optimizer step. Returns the mean loss (float;
    ``read_loss=False``: the 0-dim tensor, unread, as a simulated step under FakeTensorMode needs).

    ``model`` may be DDP-wrapped or FSDP2-sharded (then ``no_sync`` skips the gradient sync of
    all but the last micro-batch) or a plain module. ``inner`` is the unwrapped module, for the activation probe.
    ``scale_loss=False`` reproduces the classic bug (gradients accum_steps times too large).
    A micro-batch is any batch; ``loss_fn(model, batch)`` makes its loss (None: `compute_loss`'s
    conventions, e.g. ``model(*batch)`` for the built-in models' ``(x, y)``).
    ``phase(name)``: a context entered around each forward (with its loss), each backward and the
    optimizer step ('forward', 'backward', 'optimizer'): the peak-memory probe's marks.
    """
    phase = phase or _no_phase
    # summed on the device, read once per step; float64 as the Python float it replaces
    total = torch.zeros((), dtype=torch.float64, device=device)
    batches = list(micro_batches)
    if len(batches) != accum_steps:
        raise ValueError(f"got {len(batches)} micro-batches for accum_steps={accum_steps}")
    for k, batch in enumerate(batches):
        last = k == accum_steps - 1
        sync = (skip_sync(model) if no_sync and not last else None) or nullcontext()
        with sync:
            probe = activation_probe.forward(inner or model) if activation_probe else nullcontext()
            with phase("forward"), probe, autocast_for(precision, device):
                loss = compute_loss(model, to_device(batch, device), loss_fn)
            # no .item() here: on CUDA it would wait for the forward before queuing the backward
            total += loss.detach().double()
            with phase("backward"):
                # scale the loss for gradient accumulation: grads add up over micro-batches
                scaled = loss / accum_steps if scale_loss else loss
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
    with phase("optimizer"):
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    if scheduler is not None:
        scheduler.step()
    mean = total / accum_steps
    return mean.item() if read_loss else mean  # the step's one device-to-host sync


@contextmanager
def _no_phase(name):
    yield


def zero_grad(optimizer):
    optimizer.zero_grad(set_to_none=True)
