"""One checkpoint region per segment of blocks that the model calls in its own loop.

A transformers model runs ``for layer in self.layers: h = layer(h, mask=..., ...)``: ddpkit
cannot wrap that loop in a function, as ``checkpoint_sequential`` wraps an ``nn.Sequential``.
It can still make a segment of blocks one region, around the blocks' own forwards, as
``torch.distributed._composable.checkpoint`` does for one module with hooks:

* the segment's first block's forward enters torch's non-reentrant checkpoint
  (``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, private: the generator
  torch's own ``checkpoint`` and its composable API use), with the block's tensor arguments as
  the region's inputs, the only ones kept; its last block's forward leaves it. In between,
  what the blocks save goes to the region (nothing is kept; backward recomputes it). The
  blocks' ``forward`` is wrapped (an attribute of each block, as `policies` sets for reentrant
  blocks), not hooked: it runs where a pre-hook registered last and a forward hook registered
  first would (after every pre-hook, FSDP's all-gather included, before every forward hook),
  and a block without hooks keeps ``nn.Module.__call__``'s fast path, which hooks take it off
  (each block of a region is called twice a micro-batch, forward and recompute, even where
  ``policies`` runs an ``nn.Sequential``'s segments itself and the wrapper only passes the
  call on: bench.overhead's GPT ran 7,727 Python lines a micro-batch with the hooks, 7,592
  with the wrappers, 7,555 with neither, 7,528 with torch's ``checkpoint_sequential``);
* the recompute replays the blocks that ran, in order, through their ``__call__`` (FSDP's
  hooks gather the parameters) with this policy's hooks off: the first from the region's
  inputs, each next one with the arguments it received and, as its input, the output the replay
  just made; torch restores the RNG and autocast state of the region's start, and the replay
  sets each block's own RNG state again (code between blocks may draw from it: LayerDrop);
* the guard: a block's input must be the very tensor the block before it returned (or an alias
  of it, as FSDP passes it on), unchanged. When it is not (the model changed the hidden state
  between them, or wrote into it), that block's input is kept, as a
  per-block region would keep it, and the policy says so; code between blocks runs outside
  the region (its saved tensors are saved as they would be without checkpointing), so the
  replay never needs it. A block called out of the segment's order, or a forward that ends
  with a region open, closes the region where the blocks stopped.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (_checkpoint_without_reentrant_generator, get_device_states,
                                    noop_context_fn, set_device_states)


# a torch whose generator has no early_stop parameter: pass it only where there is one
_EARLY_STOP = (True,) if "early_stop" in inspect.signature(
    _checkpoint_without_reentrant_generator).parameters else ()


def _outer_hooks():
    """The saved-tensor hooks in force now (the activation probe's, or none: identity)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)
    return top(False) or (lambda t: t, lambda t: t)


def _first_tensor(out):
    return next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)


def _chains(leaf, out, version):
    """Is ``leaf`` the tensor ``out`` that the block before returned, unchanged since? The very
    tensor, or an alias of it (the same memory, shape and strides: FSDP passes a block's inputs
    through an autograd function that returns such views), not written in place since."""
    if not isinstance(leaf, torch.Tensor) or out is None or leaf._version != version:
        return False
    if leaf is out:
        return True
    return (leaf.untyped_storage()._cdata == out.untyped_storage()._cdata and
            leaf.shape == out.shape and leaf.stride() == out.stride() and
            leaf.storage_offset() == out.storage_offset() and leaf.dtype == out.dtype)


def _top_level(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class _Call:
    """One block call inside a region: its arguments (flattened), and what the replay needs."""

    def __init__(self, index, args, kwargs, chain=None, rng=None):
        self.index = index
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.chain = chain  # the leaf that is the previous block's output (replaced on replay)
        if chain is not None:
            self.leaves[chain] = None  # not kept: the replay makes it again
        self.rng = rng

    def arguments(self, chained):
        leaves = list(self.leaves)
        if self.chain is not None:
            leaves[self.chain] = chained
        return tree_unflatten(leaves, self.spec)


def _rng_state(tensors):
    """The RNG states a block draws from: the CPU's, and those of its tensors' devices."""
    devices, states = get_device_states(*tensors)
    kind = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), None)
    return torch.get_rng_state(), devices, states, kind


def _set_rng_state(state):
    cpu, devices, states, kind = state
    torch.set_rng_state(cpu)
    if devices:
        set_device_states(devices, states, device_type=kind)


class _Region:
    """One open region: torch's checkpoint entered at its first block, the calls since."""

    def __init__(self, owner, index, stop, args, kwargs):
        self.owner, self.stop = owner, stop
        first = _Call(index, args, kwargs)
        # every tensor argument of the first block is a region input: torch saves them
        slots = [k for k, leaf in enumerate(first.leaves) if isinstance(leaf, torch.Tensor)]
        inputs = [first.leaves[k] for k in slots]
        for k in slots:
            first.leaves[k] = None
        self.slots, self.calls = slots, [first]
        self.last, self.output, self.version, self.gap = index, None, None, None
        owner.policy.report(_top_level(args, kwargs))
        # what code between blocks saves goes where it would go without this region
        self.outer = _outer_hooks()
        name = f"block {index}" if stop == index + 1 else f"blocks {index}-{stop - 1}"
        self.gen = _checkpoint_without_reentrant_generator(
            owner.policy.timed(self.replay, name), owner.policy.preserve_rng_state, noop_context_fn, "default", False,
            *_EARLY_STOP, *inputs)
        next(self.gen)

    def replay(self, *inputs):
        """Run the region's blocks again, in order, from its inputs (the recompute)."""
        owner = self.owner
        owner.replaying = True  # this policy's hooks stand aside
        try:
            out = None
            for k, call in enumerate(self.calls):
                if k == 0:
                    leaves = list(call.leaves)
                    for slot, t in zip(self.slots, inputs):
                        leaves[slot] = t
                    args, kwargs = tree_unflatten(leaves, call.spec)
                else:
                    args, kwargs = call.arguments(out)
                    if call.rng is not None:
                        _set_rng_state(call.rng)
                out = _first_tensor(owner.blocks[call.index](*args, **kwargs))
        finally:
            owner.replaying = False

    def between(self, output):
        """After a block that is not the segment's last: the model's own code runs next."""
        self.output = output
        self.version = output._version if output is not None else None
        self.gap = saved_tensors_hooks(*self.outer)
        self.gap.__enter__()

    def end_gap(self):
        if self.gap is not None:
            self.gap.__exit__(None, None, None)
            self.gap = None

    def add(self, index, args, kwargs):
        """Block ``index`` runs inside this region. Returns False if it chains on no output of
        the block before (its input is then kept, as a per-block region would keep it)."""
        leaves = tree_flatten((args, kwargs))[0]
        chain = next((k for k, leaf in enumerate(leaves)
                      if _chains(leaf, self.output, self.version)), None)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        rng = _rng_state(tensors) if self.owner.policy.preserve_rng_state else None
        call = _Call(index, args, kwargs, chain, rng)
        self.calls.append(call)
        self.last, self.output = index, None
        kept = [t for t in _top_level(args, kwargs) if chain is None or t is not leaves[chain]]
        self.owner.policy.report(kept)
        return chain is not None

    def close(self):
        self.end_gap()
        try:
            next(self.gen)
        except StopIteration:
            return
        raise RuntimeError("torch's checkpoint generator was not exhausted")


class LoopRegions:
    """The wrapped forwards that make each checkpointed segment of ``blocks`` one region, for a
    model that calls the blocks in its own loop. ``regions``: [(start, stop), ...]."""

    def __init__(self, policy, blocks, regions):
        self.policy, self.blocks = policy, blocks
        self.segment = {i: (a, b) for a, b in regions for i in range(a, b)}
        self.open = None
        self.replaying = False
        self.handles = []
        self.wrapped = {}  # block index -> (its wrapper, the forward it wraps, was it its own)

    def install(self, root):
        for i in sorted(self.segment):
            block = self.blocks[i]
            # inside __call__, after every pre-hook (FSDP's all-gather: the region opens once
            # the parameters are gathered, installed before or after fully_shard, as torch's
            # composable checkpoint applied before fully_shard does) and before every forward
            # hook (the region closes before FSDP reshards)
            inner = block.forward
            wrapper = functools.partial(self._forward, i, inner)
            self.wrapped[i] = (wrapper, inner, "forward" in block.__dict__)
            block.forward = wrapper
        # a forward that ends with a region open (the segment's last block never ran) closes it
        self.handles.append(root.register_forward_hook(self._end, always_call=True))
        return self

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        for i, (wrapper, inner, own) in self.wrapped.items():
            block = self.blocks[i]
            if block.__dict__.get("forward") is wrapper:
                if own:
                    block.forward = inner
                else:
                    del block.forward
        self.wrapped = {}

    def _forward(self, i, inner, *args, **kwargs):
        """Block ``i``'s forward: the region's marks around the block's own (``inner``)."""
        if self._idle():  # the cheap path: a Sequential's region runs it, or a recompute
            return inner(*args, **kwargs)
        self._pre(i, args, kwargs)
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            self._post(i, None)  # the region ends where the blocks stopped
            raise
        self._post(i, out)
        return out

    def _idle(self):
        return self.replaying or self.policy.in_region or not torch.is_grad_enabled()

    def _pre(self, i, args, kwargs):
        if self._idle():
            return
        self.policy.ran.add("loop")
        region = self.open
        if region is not None:
            region.end_gap()
            if region.last < i < region.stop:  # the segment goes on (a skipped block is fine)
                if not region.add(i, args, kwargs):
                    self.policy.note(
                        f"block {i}'s input is not the tensor block {region.calls[-2].index} "
                        f"returned (the model changes it between them), so block {i} keeps "
                        f"its input, as a region of its own would")
                return
            self.policy.note(f"block {i} ran where the blocks of the region from block "
                             f"{region.calls[0].index} were expected: the region ended there")
            self._close()
        self.open = _Region(self, i, self.segment[i][1], args, kwargs)

    def _post(self, i, output):
        region = self.open
        if region is None or self._idle() or region.last != i:
            return
        if output is None or i == region.stop - 1:  # the segment's last block (or it raised)
            self._close()
        else:
            region.between(_first_tensor(output))

    def _end(self, module, args, output):
        region = self.open
        if region is not None and not self.replaying:
            a, b = region.calls[0].index, region.stop
            self.policy.note(f"the forward ended with the region of blocks {a}-{b - 1} open "
                             f"(block {region.last} ran last): the region ended there")
            self._close()

    def _close(self):
        region, self.open = self.open, None
        region.close()
