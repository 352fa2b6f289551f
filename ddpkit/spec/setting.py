"""`CheckpointSetting`: which of a model's blocks are checkpointed, as one value.

It is bound to the model's stacks (one cannot be made without them), validates itself against
them, lays the blocks out in *segments* (runs of
consecutive blocks, each either checkpointed or plain), has one text form (``str(setting)``:
what records, tables and the CLI carry, and `parse` reads back) and one label a person reads
(`label`). The engine's `policies.CheckpointPolicy` installs it on a model.

Blocks are counted over all the model's stacks in order (`blocks.find_stacks`: T5's 4 encoder
blocks, then its 4 decoder blocks, are blocks 0-7), and no segment crosses a stack:

* ``None``: one plain segment per stack.
* ``s`` (int): as ``torch.utils.checkpoint.checkpoint_sequential(segments=s)`` counts them, in
  each stack: s segments of ``n // s`` blocks, the last one taking the rest, and **the last
  segment is never checkpointed** (its activations are needed at once by backward). So ``s=1``
  checkpoints nothing and ``s=n`` checkpoints every block but the last of each stack.
* ``"full"``: every block is its own checkpointed segment (the last one too).
* a list of booleans (selective): block i is checkpointed on its own where the list says True.

A checkpointed segment is one region: only its input is kept, and backward recomputes the
whole segment at once (so its recompute peak grows with its length, as
``checkpoint_sequential``'s does).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class CheckpointSetting:
    """A checkpoint setting bound to a model's stacks. ``value`` is what people write: None, an
    int (segments), 'full', or a tuple of booleans (one per block). ``stacks``: the blocks of
    each stack, in order: ``(6,)`` (an int, 6, says the same) for one stack of 6, ``(4, 4)`` for
    T5's encoder and decoder. Segments never cross a stack: an int setting makes its segments in
    each stack, as ``checkpoint_sequential`` would run each.

    A setting equals another of the same value on the same stacks, and the plain value it
    holds (``cfg.checkpoint == 2``, ``== [True, False]``, ``== None``), so code that compared
    the plain value compares the setting alike."""
    value: object
    stacks: tuple

    def __post_init__(self):
        stacks = (self.stacks,) if isinstance(self.stacks, int) else tuple(self.stacks or ())
        if not stacks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1
                             for k in stacks):
            raise ValueError(f"CheckpointSetting: stacks={self.stacks!r} must be the blocks of "
                             f"each of the model's stacks (positive counts; an int for one "
                             f"stack): TrainConfig.checkpoint is bound to its model's stacks")
        object.__setattr__(self, "stacks", stacks)
        v, n = self.value, self.n_blocks
        if isinstance(v, list):
            object.__setattr__(self, "value", v := tuple(v))
        if v is None or v == "full":
            return
        if isinstance(v, bool):
            raise ValueError(f"TrainConfig.checkpoint={v!r}: ambiguous; pass 'full', None, "
                             f"a segment count, or a list of {n} booleans")
        if isinstance(v, int):
            self._check_segments(v)
            return
        if isinstance(v, tuple):
            if len(v) != n or not all(isinstance(b, bool) for b in v):
                raise ValueError(f"TrainConfig.checkpoint: a selective list needs exactly "
                                 f"n_blocks={n} booleans (one per block), got {list(v)!r}")
            return
        raise ValueError(f"TrainConfig.checkpoint={v!r}: pass None, an int (segments), 'full', "
                         f"or a list of {n} booleans")

    def _check_segments(self, v):
        n = self.n_blocks
        if len(self.stacks) == 1:
            if not 1 <= v <= n:
                raise ValueError(f"TrainConfig.checkpoint={v}: segments must be between 1 and "
                                 f"n_blocks={n}; pass checkpoint<={n}, 'full', or None")
            return
        shortest = min(self.stacks)
        if not 1 <= v <= shortest:
            raise ValueError(f"TrainConfig.checkpoint={v}: segments are made in each of the "
                             f"model's {len(self.stacks)} stacks (as checkpoint_sequential runs "
                             f"each), and the shortest has {shortest} blocks; pass "
                             f"checkpoint<={shortest}, 'full', None, or a list of {n} booleans")

    @classmethod
    def of(cls, value, stacks):
        """The setting of ``value`` on ``stacks``: a plain value (None, an int, 'full', a list),
        its text form (`parse`), or a setting (bound again, and checked, when its stacks
        differ)."""
        if isinstance(value, cls):
            return value if value.stacks == cls(None, stacks).stacks else cls(value.value, stacks)
        if isinstance(value, str) and value != "full":
            value = cls.parse(value)
        return cls(value, stacks)

    @classmethod
    def from_mask(cls, mask, stacks):
        """A selective setting from one boolean per block (all False is None)."""
        mask = tuple(bool(b) for b in mask)
        return cls(mask if any(mask) else None, stacks)

    def with_value(self, value):
        """Another value (plain, text, or a setting) on these stacks."""
        return CheckpointSetting.of(value, self.stacks)

    @property
    def n_blocks(self):
        """Blocks over all stacks."""
        return sum(self.stacks)

    @property
    def several(self):
        """Does the model have several stacks (segments then count per stack)?"""
        return len(self.stacks) > 1

    @property
    def spans(self):
        """[(start, stop), ...]: each stack's blocks, counted over all stacks in order."""
        out, start = [], 0
        for k in self.stacks:
            out.append((start, start + k))
            start += k
        return out

    @staticmethod
    def parse(text):
        """The plain value of the setting's text form (``str(setting)``, what records, tables
        and the CLI carry): ``none`` | ``S`` or ``S per stack`` (segments) | ``full`` |
        ``1,0,1,0,`` (one 0/1 per block; a list always has a comma, so ``1,`` is one block and
        ``1`` one segment)."""
        text = text.strip()
        if text.lower() in ("none", "off"):
            return None
        if text.lower() == "full":
            return "full"
        if "," in text:
            return [t.strip().lower() in ("1", "true") for t in text.split(",") if t.strip()]
        try:
            return int(text.lower().removesuffix("per stack").strip())
        except ValueError:
            raise ValueError(f"TrainConfig.checkpoint={text!r}: write none, a segment count, "
                             f"full, or one 0/1 per block with commas (1,0,1,0,)") from None

    @property
    def plain(self):
        """The value as one writes it (a list, not a tuple, for a selective one): for the edges
        that take plain data (JSON, ``TrainConfig.to_dict``)."""
        return list(self.value) if isinstance(self.value, tuple) else self.value

    @property
    def segment_count(self):
        """An int setting's segments (per stack), else None: the Lab's segments control."""
        v = self.value
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def names_blocks(self):
        """Does it name blocks ('full', or one boolean per block) rather than count segments?
        Then the Lab's per-block control shows it, not the segments control."""
        return isinstance(self.value, (tuple, str))

    def __eq__(self, other):
        if isinstance(other, CheckpointSetting):
            return (self.value, self.stacks) == (other.value, other.stacks)
        if isinstance(other, list):
            other = tuple(other)
        if other is None or isinstance(other, (int, str, tuple)):
            return self.value == other
        return NotImplemented

    def __hash__(self):
        return hash(self.value)  # equal plain values hash alike (a list has no hash)

    def __repr__(self):
        return f"CheckpointSetting({self.plain!r}, stacks={self.stacks})"

    @property
    def segments(self):
        """[(start, stop, checkpointed), ...] covering range(n_blocks), none crossing a stack."""
        v = self.value
        if v == "full":
            return [(i, i + 1, True) for i in range(self.n_blocks)]
        if isinstance(v, tuple):
            return [(i, i + 1, on) for i, on in enumerate(v)]
        out = []
        for a, b in self.spans:
            if v is None:
                out.append((a, b, False))
                continue
            size = (b - a) // v  # as checkpoint_sequential lays out one stack
            out += [(a + i * size, a + (i + 1) * size, True) for i in range(v - 1)]
            out.append((a + (v - 1) * size, b, False))
        return out

    @property
    def regions(self):
        """[(start, stop), ...]: the checkpointed segments, each recomputed as one region."""
        return [(a, b) for a, b, on in self.segments if on]

    @property
    def mask(self):
        """One boolean per block: is it inside a checkpointed segment?"""
        out = [False] * self.n_blocks
        for start, stop in self.regions:
            out[start:stop] = [True] * (stop - start)
        return out

    def label(self):
        """What a person reads, short at any block count: 'no checkpointing', '2 segments',
        'blocks 0, 2', 'blocks 0-9, 11', 'blocks 0-78, every 2nd', 'every block'."""
        v, mask = self.value, self.mask
        if not any(mask):
            return "no checkpointing"
        if v == "full" or (isinstance(v, tuple) and all(v)):
            return "every block"
        if isinstance(v, int):
            return f"{v} segments" + (" per stack" if self.several else "")
        on = [i for i, b in enumerate(mask) if b]
        return ("block " if len(on) == 1 else "blocks ") + _indices_text(on, self.n_blocks)

    def __str__(self):
        """The one text form: 'none', '2' ('2 per stack' on several stacks), 'full',
        '1,0,1,0,' (`parse` reads it back)."""
        v = self.value
        if v is None:
            return "none"
        if isinstance(v, tuple):
            return ",".join("1" if b else "0" for b in v) + ","
        return f"{v} per stack" if isinstance(v, int) and self.several else str(v)



def _indices_text(on, n, most=6):
    """Block indices as a person reads them: '0, 2'; runs of three or more as '0-9'; a regular
    stride as '0-78, every 2nd'; past ``most`` parts, the first and the last with the count."""
    step = on[1] - on[0] if len(on) > 1 else 0
    if len(on) >= 4 and step > 1 and all(b - a == step for a, b in zip(on, on[1:])):
        nth = {2: "2nd", 3: "3rd"}.get(step, f"{step}th")
        return f"{on[0]}-{on[-1]}, every {nth}"
    runs = []
    for i in on:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [p for a, b in runs for p in ([f"{a}-{b}"] if b - a >= 2 else map(str, range(a, b + 1)))]
    if len(parts) > most:
        return ", ".join(parts[:most - 2] + ["…", parts[-1]]) + f" ({len(on)} of {n})"
    return ", ".join(parts)
