"""Ship a job to the ranks by value, keeping tracebacks readable.

cloudpickle sends notebook functions and classes by value, but renames every code object's file
to ``<dynamic-code>``, so a rank's traceback would show line numbers and no source. Here the real
file names are kept and the source lines of those files (notebook cells live only in the kernel's
``linecache``) travel with the job, so a rank's traceback reads like a local one.
"""
from __future__ import annotations

import io
import linecache
import pickle
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
        return super().reducer_override(obj)


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
