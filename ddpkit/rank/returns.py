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

import ctypes
import io
import os
import pickle
import sys

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
    return (t.layout == torch.strided and not t.is_nested and not t.is_quantized
            and not t.is_mkldnn and not t.is_conj() and not t.is_neg()
            and not t._is_zerotensor() and not t.__dict__)


def _storage(buf):
    """The kernel's side of an out-of-band storage. ``buf`` is the uint8 tensor `read_buffers`
    read the bytes into: its storage becomes the tensor's, no copy (torch's own allocation, so
    resizable as any). Any other buffer (a value loaded in one process) is copied into one."""
    if not isinstance(buf, torch.Tensor):
        view = memoryview(buf).cast("B")
        buf = torch.empty(len(view), dtype=torch.uint8)
        _memory(buf.untyped_storage())[:] = view
    return buf.untyped_storage()


def _memory(storage):
    """A writable memoryview of a CPU storage's bytes that keeps the storage alive as long as
    it lives (through ctypes: ``.numpy()`` would also mark the storage not resizable)."""
    array = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    array.storage = storage
    return memoryview(array).cast("B")


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
            return _storage, (pickle.PickleBuffer(_memory(obj)),)
        return super().reducer_override(obj)


def dumps_for_kernel(value):
    """``(blob, buffers)``: the value pickled with every tensor on CPU, and the bytes of its
    storages, in order, as buffers that still point into the storages (no copy)."""
    buffers, f = [], io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    return f.getvalue(), [b.raw() for b in buffers]


def loads_from_rank(blob, buffers):
    return pickle.loads(blob, buffers=buffers)


def write_buffers(conn, buffers):
    """Each buffer's bytes to the rank's pipe ``conn`` (a `multiprocessing.connection.Connection`),
    whole: the kernel knows their sizes already. On POSIX straight to the pipe's descriptor
    (the Connection neither buffers nor reads ahead, so the two never mix)."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        if not _RAW:
            conn.send_bytes(view)
            continue
        while view:
            view = view[os.write(conn.fileno(), view):]


def read_buffers(conn, sizes):
    """What `write_buffers` wrote: one uint8 tensor per size, read straight into its memory.
    EOFError if the rank went away meanwhile."""
    out = []
    for n in sizes:
        buf = torch.empty(n, dtype=torch.uint8)
        view, got = _memory(buf.untyped_storage()), 0
        if not _RAW:
            conn.recv_bytes_into(view)
            got = n
        while got < n:
            k = os.readv(conn.fileno(), [view[got:]])
            if k == 0:
                raise EOFError(f"the rank's pipe closed {got} bytes into a {n}-byte buffer")
            got += k
        out.append(buf)
    return out


# a Connection's fileno() is a descriptor on POSIX (a socketpair), a handle on Windows
_RAW = sys.platform != "win32" and hasattr(os, "readv")
