"""Ship a job to the ranks by value, keeping tracebacks readable.

cloudpickle sends notebook functions and classes by value, but renames every code object's file
to ``<dynamic-code>``, so a rank's traceback would show line numbers and no source. Here the real
file names are kept and the source lines of those files (notebook cells live only in the kernel's
``linecache``) travel with the job, so a rank's traceback reads like a local one.

Modules travel by name, whatever their class. cloudpickle sends a plain module by name when it is
in ``sys.modules``, and records with a function the submodules it reaches by attribute
(``torch.backends.cudnn`` for ``torch.backends.cudnn.allow_tf32``). But its rule is keyed on the
exact type ``types.ModuleType``, and torch puts ``ModuleType`` subclasses in ``sys.modules``
(``torch.backends`` is a ``GenericModule``, ``torch.backends.cudnn`` a ``CudnnModule``, and
``torch.ops``, ``torch._VF``, the config modules); pickle then tries the instance itself and fails
("cannot pickle 'CudnnModule' object"). Any module is sent here as ``import_module(name)``: the
rank imports it as the kernel did, subclass and all.
"""
from __future__ import annotations

import importlib
import io
import linecache
import pickle
import sys
import types

import cloudpickle


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.filenames = set()

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            ctor, args = cloudpickle.Pickler._dispatch_table[types.CodeType](obj)
            self.filenames.add(obj.co_filename)
            return ctor, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return _by_name(obj)  # plain modules: cloudpickle's own rule, the same in effect
        return super().reducer_override(obj)


def _by_name(module):
    """A module subclass's reduction: imported by name on the rank."""
    name = module.__name__
    if sys.modules.get(name) is not module:
        raise pickle.PicklingError(
            f"module {name!r} (a {type(module).__name__}) is not sys.modules[{name!r}], so a rank "
            f"cannot import it by name; import it inside the function instead")
    return importlib.import_module, (name,)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    sources = {}
    for name in pickler.filenames:
        lines = linecache.getlines(name)
        if lines:
            sources[name] = lines
    return pickle.dumps((sources, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    sources, blob = pickle.loads(data)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return cloudpickle.loads(blob)
