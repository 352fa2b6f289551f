"""How a rank's return value reaches the kernel: the pickle, then each tensor's bytes beside it.

A return value may be a model's weights: 650 MB for GPT-2 small. Pickled the usual way, every
CPU storage is written with ``torch.save`` into a bytes object inside the pickle, and the
kernel then copied the whole message out of the pipe, unpickled the blob and ran ``torch.load``
once per storage: 5.3 s for GPT-2 small's weights on 2 cores. Here the value is pickled with
protocol 5 and each storage's bytes left out of band (`pickle.PickleBuffer`): the rank writes
them to its pipe straight from the storage, and the kernel reads each one straight into the
buffer its tensor then lives in: 0.4 s for the same weights. Storages shared by several tensors
(tied weights) travel once and stay shared.

Only plain values travel this way: the pickle holds no ``torch.load``, and the buffers are bytes.
A tensor that does not fit the fast path (sparse, quantized, with attributes of its own)
is pickled by torch as before, CUDA ones as their CPU copy.
"""
from __future__ import annotations

import io
import os
import pickle

import cloudpickle
import torch


def cpu_copy(t):
    """A CPU tensor for the kernel: a pickled CUDA tensor is rebuilt on ``cuda:r`` (``storage.py``:
    ``torch.save`` keeps its device), so the kernel would use a GPU."""
    if t.device.type == "cpu":
        return t
    out = t.detach().cpu()
    return out.requires_grad_() if t.requires_grad and t.is_leaf else out


def _plain_strided(t):
    """A dense CPU tensor that is only its storage, dtype, shape and strides."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and not t.__dict__)


def _storage(buf):
    """The kernel's side of an out-of-band storage: ``buf`` (a bytearray read from the pipe)
    becomes the storage's memory, no copy."""
    if len(buf) == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def _tensor(storage, dtype, size, stride, offset, requires_grad):
    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    return t.requires_grad_() if requires_grad else t


class _Pickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj):
        if type(obj) is torch.Tensor:  # a Parameter pickles its .data, a plain tensor: here too
            cpu = cpu_copy(obj)
            if not _plain_strided(cpu):
                return cpu.__reduce_ex__(self.proto)
            # the storage is pickled as its own object, so the memo sends a shared one once
            return _tensor, (cpu.untyped_storage(), cpu.dtype, tuple(cpu.shape), cpu.stride(),
                             cpu.storage_offset(), cpu.requires_grad)
        if type(obj) is torch.UntypedStorage and obj.device.type == "cpu":
            view = torch.empty(0, dtype=torch.uint8).set_(obj).numpy()  # keeps obj alive
            return _storage, (pickle.PickleBuffer(view),)
        return super().reducer_override(obj)


def dumps_for_kernel(value):
    """``(blob, buffers)``: the value pickled with every tensor on CPU, and the bytes of its
    storages, in order, as buffers that still point into the storages (no copy)."""
    buffers, f = [], io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    return f.getvalue(), [b.raw() for b in buffers]


def loads_from_rank(blob, buffers):
    return pickle.loads(blob, buffers=buffers)


def write_buffers(fd, buffers):
    """Each buffer's bytes to the pipe ``fd``, whole (the kernel knows their sizes already)."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while view:
            view = view[os.write(fd, view):]


def read_buffers(fd, sizes):
    """What `write_buffers` wrote: one bytearray per size. EOFError if the rank went away."""
    out = []
    for n in sizes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                raise EOFError(f"the rank's pipe closed {got} bytes into a {n}-byte buffer")
            got += k
        out.append(buf)
    return out
