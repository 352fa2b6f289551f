"""Where a model's repeated blocks are: the unit that checkpointing, FSDP and the estimate act on.

`find_blocks(model)` takes the longest ``nn.ModuleList`` or ``nn.Sequential`` whose children all
share one class: ``blocks`` in the built-in models, ``transformer.h`` in GPT-2, ``model.layers``
in Llama, ``encoder.layer`` in BERT. ``blocks="dotted.path"`` names them instead.
"""
from __future__ import annotations

import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


def _repeated(module):
    kids = list(module)
    return len(kids) >= 2 and len({type(k) for k in kids}) == 1


def find_blocks(model, path=None):
    """(dotted path, container) of the model's repeated blocks."""
    if path is not None:
        return path, resolve_blocks(model, path)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, CONTAINERS) and _repeated(mod) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        lists = [n for n, m in model.named_modules() if isinstance(m, CONTAINERS) and len(m)]
        raise ValueError(
            f"TrainConfig.blocks=None: found no repeated blocks in {type(model).__name__} (an "
            f"nn.ModuleList or nn.Sequential of two or more modules of one class); put the "
            f"blocks in one, or pass blocks='path.to.container' (containers here: "
            f"{lists[:6] or 'none'})")
    return best


def resolve_blocks(model, path):
    """The container at a dotted path, with an error naming ``blocks=`` if it is not one."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        options = [n for n, m in model.named_modules() if isinstance(m, CONTAINERS) and len(m)]
        raise ValueError(f"TrainConfig.blocks={path!r}: {type(model).__name__} has no submodule "
                         f"there; pass one of {options[:6]} or blocks=None to find them") from None
    if not isinstance(mod, CONTAINERS) or not len(mod):
        raise ValueError(f"TrainConfig.blocks={path!r} is a {type(mod).__name__}, not a non-empty "
                         f"nn.ModuleList or nn.Sequential; name the container that holds the blocks")
    return mod


def block_names(path, container):
    """Each block's full module name, e.g. 'transformer.h.3'."""
    prefix = f"{path}." if path else ""
    return [f"{prefix}{i}" for i in range(len(container))]
