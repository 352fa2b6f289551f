"""Where a model's repeated blocks are: the unit that checkpointing, FSDP and the estimate act on.

A model keeps its blocks in one or more **stacks**: an ``nn.ModuleList`` or ``nn.Sequential``
of two or more blocks of one class (``blocks`` in the built-in models, ``transformer.h`` in
GPT-2, ``model.layers`` in Llama, ``encoder.layer`` in BERT; ``encoder.block`` and
``decoder.block`` in T5; ``text_model.encoder.layers`` and ``vision_model.encoder.layers`` in
CLIP). `find_stacks(model)` takes every such container whose blocks hold parameters and that
is not inside another one (Swin's stages, not the layers inside each stage), in the model's
own order (the order of ``named_modules()``: an encoder's before its decoder's).
``blocks="dotted.path"`` or ``blocks=["encoder.block", "decoder.block"]`` names them instead.

Blocks are counted over all stacks in that order: block ``i`` of the model is the ``i``-th of
the stacks laid end to end, named by its path (`block_names`).
"""
from __future__ import annotations

import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


def _repeated(module):
    kids = list(module)
    return (len(kids) >= 2 and len({type(k) for k in kids}) == 1
            and all(any(True for _ in k.parameters()) for k in kids))


def _containers(model):
    return [n for n, m in model.named_modules() if isinstance(m, CONTAINERS) and len(m)]


def paths_of(blocks):
    """``blocks=`` as a tuple of dotted paths: one path, several, or a comma list ('a,b')."""
    if isinstance(blocks, str):
        return tuple(p.strip() for p in blocks.split(",") if p.strip())
    return tuple(blocks)


def find_stacks(model, blocks=None):
    """[(dotted path, container), ...]: the stacks ``blocks=`` names, or every stack of repeated
    blocks (None: see the module's note)."""
    if blocks is not None:
        return resolve_stacks(model, blocks)
    stacks = []
    for name, mod in model.named_modules():  # pre-order: a stack comes before what it holds
        if any(name.startswith(f"{path}.") or not path for path, _ in stacks):
            continue  # inside a stack found already
        if isinstance(mod, CONTAINERS) and _repeated(mod):
            stacks.append((name, mod))
    if not stacks:
        raise ValueError(
            f"TrainConfig.blocks=None: found no repeated blocks in {type(model).__name__} (an "
            f"nn.ModuleList or nn.Sequential of two or more modules of one class that hold "
            f"parameters); put the blocks in one, or pass blocks='path.to.container' "
            f"(containers here: {_containers(model)[:6] or 'none'})")
    return stacks


def resolve_stacks(model, blocks):
    """[(path, container), ...] at the dotted path(s) ``blocks`` names, with an error naming
    ``blocks=`` where one is not a container of blocks or two overlap."""
    paths = paths_of(blocks)
    if not paths:
        raise ValueError(f"TrainConfig.blocks={blocks!r} names no container; pass a dotted path, "
                         f"a list of them, or blocks=None to find them")
    stacks = [(p, _resolve_one(model, p, blocks)) for p in paths]
    for p in paths:
        inside = [q for q in paths if q != p and (p.startswith(f"{q}.") or not q)]
        if inside or paths.count(p) > 1:
            why = f"lies inside {inside[0]!r}" if inside else "is named twice"
            raise ValueError(f"TrainConfig.blocks={blocks!r}: {p!r} {why}; name each stack "
                             f"once, none inside another")
    return stacks


def _resolve_one(model, path, blocks):
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        where = "there" if path == blocks else f"at {path!r}"
        raise ValueError(f"TrainConfig.blocks={blocks!r}: {type(model).__name__} has no submodule "
                         f"{where}; pass one of {_containers(model)[:6]} (or several) or "
                         f"blocks=None to find them") from None
    if not isinstance(mod, CONTAINERS) or not len(mod):
        raise ValueError(f"TrainConfig.blocks={blocks!r}: {path!r} is a {type(mod).__name__}, not "
                         f"a non-empty nn.ModuleList or nn.Sequential; name the container that "
                         f"holds the blocks")
    return mod


def resolve_blocks(model, blocks):
    """Every block of the stacks ``blocks`` names (a path or several), in order: one list."""
    return [b for _, container in resolve_stacks(model, blocks) for b in container]


def stack_sizes(stacks):
    """The number of blocks in each stack, in order."""
    return tuple(len(container) for _, container in stacks)


def block_names(stacks):
    """Each block's full module name over all stacks, e.g. 'encoder.block.3', 'decoder.block.0'.
    ``stacks``: [(path, container or block count), ...]."""
    names = []
    for path, blocks in stacks:
        prefix = f"{path}." if path else ""
        n = blocks if isinstance(blocks, int) else len(blocks)
        names += [f"{prefix}{i}" for i in range(n)]
    return names
