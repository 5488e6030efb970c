"""Compiled -> the save direction: for each checkpoint tensor, the runtime regions that write it.

A block says `dest[offsets + x] = S[base + coeff . x]`, then its value steps. Saving reads it
backwards. Each element of a checkpoint tensor S must be written once: where several blocks hold
the same region of S (a tied embedding taken by two rules, `repeat`), the first in rule-file
order writes it. A region of S that no runtime tensor holds (a `slice` dropped it, a `drop`
removed S) cannot be written, and a cast that loses values on load (float32 read into bfloat16)
cannot be undone: both fail the save before any byte is written (E501-E503), unless the caller
chose what happens to the dropped tensors (`dropped="copy"` or `"omit"`, remapdsl/runtime/save.py).
"""

from __future__ import annotations

from itertools import chain, repeat
from math import prod
from operator import attrgetter, eq
from typing import NamedTuple

from ..dtypes import BY_NAME
from ..errors import Diagnostic, RemapError, Span
from ..indexmap import box_overlap, cut, source_box, volume
from ..quant import get_format
from .model import Block, Compiled, LogicalTensor

# (exponent bits, mantissa bits) of the float types: a cast keeps every value iff neither shrinks
_FLOAT_BITS = {"float64": (11, 52), "float32": (8, 23), "bfloat16": (8, 7), "float16": (5, 10),
               "float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}


class Writer(NamedTuple):
    """One block that writes (part of) a checkpoint tensor, with the value steps that undo the
    load's: applied to the runtime values, they give the checkpoint's values in its dtype."""

    runtime_key: str
    block: Block
    steps: tuple[tuple[str, str | float], ...]
    rule: Span | None = None  # the rule that made the runtime tensor, for errors found when planning


_CKPT_KEY, _PARTS = attrgetter("ckpt_key"), attrgetter("parts")
_SOURCE_KEY, _STEPS, _SIZES = attrgetter("source_key"), attrgetter("steps"), attrgetter("sizes")
_DTYPE, _SHAPE, _FORMAT = attrgetter("dtype"), attrgetter("shape"), attrgetter("format")
DROPPED = ("error", "copy", "omit")  # what a save does with the checkpoint tensors the rules drop


def writers(compiled: Compiled, *, allow_lossy: bool = False, requantize: bool = False,
            dropped: str = "error") -> list[Writer]:
    """The blocks that write every checkpoint tensor the compiled rules read, each region once;
    raises RemapError naming every tensor that cannot be written back. A tensor the rules drop is
    an error only with `dropped="error"`: otherwise the caller copies or omits it (`dropped_keys`)."""
    logical = compiled.logical_by_key()
    ckpt = compiled.ckpt_tensors
    ckpt_keys = list(map(_CKPT_KEY, ckpt))
    order = sorted(compiled.runtime_tensors, key=lambda d: (d.rule.path, d.rule.line, d.rule.column)
                   if d.rule else ("", 0, 0))
    first: dict[str, Writer] = {}  # key -> its first writer (most tensors have no other)
    more: dict[str, list[Writer]] = {}  # key -> the parts of later blocks that earlier ones left
    covered: dict[str, _Covered] = {}
    partial: dict[str, _Covered] = {}  # the tensors whose first writer does not cover them whole
    problems: list[Diagnostic] = []
    refused: set[str] = set()  # reported already (E502, E503): one error per tensor
    undone: dict[tuple, tuple] = {}  # (load steps, checkpoint dtype) -> (inverse steps, lossy cast)
    writable: dict[str, bool] = {}  # format -> whether it writes back (as asked)
    known = dict(zip(ckpt_keys, ckpt))  # key -> the checkpoint tensor or logical tensor it names
    known.update(logical)
    new = tuple.__new__  # a Writer without its Python-level argument handling

    def at_once(d) -> bool:
        """Make every block of `d` its tensor's first writer, as the loop below would, where it
        would: keys all distinct, none written yet (a refused key has problems raised anyway), one
        load step chain and checkpoint dtype that undo without loss (or are allowed to), formats
        that write back. False, with nothing done, otherwise. A stack of experts is one such tensor
        of hundreds of blocks."""
        blocks = d.blocks
        keys = list(map(_SOURCE_KEY, blocks))
        if None in keys or len(set(keys)) != len(keys) or not covered.keys().isdisjoint(keys):
            return False
        sources = list(map(known.__getitem__, keys))
        chains = set(zip(map(_STEPS, blocks), map(_DTYPE, sources)))
        if len(chains) != 1:
            return False
        pair = chains.pop()
        found = undone.get(pair)
        if found is None:
            found = undone[pair] = _inverse_steps(*pair)
        steps, lossy = found
        if lossy and not allow_lossy:
            return False
        kinds = set(map(type, sources))  # checkpoint tensors, logical tensors: one kind at once
        if len(kinds) != 1:
            return False
        for name in set(map(_FORMAT, sources)) if kinds == {LogicalTensor} else ():
            if name not in writable:
                writable[name] = _writes_back(name, requantize)
            if not writable[name]:
                return False
        made = map(new, repeat(Writer), zip(repeat(d.runtime_key), blocks, repeat(steps), repeat(d.rule)))
        first.update(zip(keys, made))
        if all(map(eq, map(_SIZES, blocks), map(_SHAPE, sources))):  # each block its source's shape
            covered.update(dict.fromkeys(keys, _ALL))
            return True
        for key, block, source in zip(keys, blocks, sources):
            whole = prod(block.sizes) == prod(source.shape)
            covered[key] = _ALL if whole else partial.setdefault(key, _Covered(source.shape, block))
        return True

    for d in order:
        if at_once(d):
            continue
        for block in d.blocks:
            key = block.source_key
            if key is None or key in refused:
                continue  # a pad region (not in the checkpoint), or a tensor already reported
            cover = covered.get(key)
            source = known[key]
            if cover is None and key in logical:
                if source.format not in writable:
                    writable[source.format] = _writes_back(source.format, requantize)
                if not writable[source.format]:
                    refused.add(key)
                    problems.append(_unwritable(d, source, requantize))
                    continue
            found = undone.get(pair := (block.steps, source.dtype))
            if found is None:
                found = undone[pair] = _inverse_steps(block.steps, source.dtype)
            steps, lossy = found
            if lossy and not allow_lossy:
                refused.add(key)
                problems.append(Diagnostic(
                    code="E502", span=d.rule, message=f"`{d.runtime_key}` reads `{key}` through "
                    f"`{lossy}`, which loses values: the checkpoint cannot be written back exactly",
                    hint="pass allow_lossy=True to write the rounded values"))
                continue
            if cover is None:  # the tensor's first writer: all of its block is new
                if prod(block.sizes) == prod(source.shape):
                    covered[key] = _ALL
                else:
                    covered[key] = partial[key] = _Covered(source.shape, block)
                first[key] = new(Writer, (d.runtime_key, block, steps, d.rule))
                continue
            for piece in _new_parts(block, source.shape, cover):  # what earlier rules left: first rule wins
                more.setdefault(key, []).append(Writer(d.runtime_key, piece, steps, d.rule))
    # what is not written whole: the checkpoint tensors the rules read as they are (the parts of
    # a dequantized tensor go through it, its scales are copied) and the logical tensors
    whole = first.keys() - {k for k, c in partial.items() if c.left}
    dequantized = set(chain.from_iterable(map(_PARTS, logical.values())))
    left = set(ckpt_keys).difference(dequantized, whole, refused)
    checked = [(k, s) for k, s in zip(ckpt_keys, ckpt) if k in left] if left else []
    left = logical.keys() - whole - refused
    checked += [(k, s) for k, s in logical.items() if k in left] if left else []
    choice, dropped = dropped, set(compiled.dropped)
    bound = None  # the keys the rules read, made only for an empty tensor (no block names it)
    for key, source in checked:
        total = volume(source.shape)
        if total == 0:
            bound = bound if bound is not None else {k for b in compiled.bindings for k in b.ckpt_keys}
            if key in bound:
                continue  # no element to write; its file keeps its (empty) entry
        held = total - covered[key].left if key in first else 0  # blocks stay inside their source
        if key in dropped and not held and choice != "error":
            continue  # copied from `like` or left out by the caller
        if key in dropped and not held:
            problems.append(Diagnostic(code="E501", message=f"checkpoint tensor `{key}` is dropped by the "
                                       "rules: no runtime tensor holds it",
                                       hint="the save writes back only what the load read: pass "
                                       "dropped=\"copy\" (`--dropped copy`) to copy it unchanged from `like`, "
                                       "or dropped=\"omit\" (`--dropped omit`) to leave it out of the output"))
        elif not held:
            why = "is read by no rule"
            problems.append(Diagnostic(code="E501", message=f"checkpoint tensor `{key}` {why}: no runtime "
                                       "tensor holds it", hint="the save writes back only what the load read"))
        elif held != total:
            problems.append(Diagnostic(code="E501", message=f"checkpoint tensor `{key}` {list(source.shape)}: "
                                       f"the runtime tensors hold {held} of its {total} "
                                       "elements (a `slice` left the rest out)",
                                       hint="the save writes back only what the load read"))
    if problems:
        raise RemapError(tuple(problems))
    if not more:
        return list(first.values())
    return [w for key, head in first.items() for w in (head, *more.get(key, ()))]


def _writes_back(format_name: str, requantize: bool) -> bool:
    """Whether a format writes a dequantized tensor back (with new scales, if `requantize`)."""
    fmt = get_format(format_name)
    return fmt.requantizes if requantize else fmt.encodes


def _unwritable(d, source, requantize: bool) -> Diagnostic:
    """E503: a tensor is held dequantized in a format that cannot write it back (as asked)."""
    return Diagnostic(
        code="E503", span=d.rule, message=f"`{d.runtime_key}` holds `{source.logical_key}` dequantized "
        f"({source.format}); writing it back in that format" + (" with new scales" if requantize else "")
        + " is not supported yet",
        hint="move the stored values as they are (`quantized`), or save a dequantized checkpoint")


def copied_parts(compiled: Compiled) -> list[str]:
    """Scales of dequantized tensors: a save writes the values back with them, so they are copied
    from the checkpoint the output is like, byte for byte."""
    return sorted(part for source in compiled.logical for part in source.parts[1:])


def dropped_keys(compiled: Compiled, inventory) -> list[str]:
    """The checkpoint tensors (of `inventory`, the checkpoint the rules read) that the rules drop: a
    save copies them unchanged from that checkpoint, or leaves them out."""
    return [k for k in compiled.dropped if k in inventory.tensors]


class _Covered:
    """The elements of one checkpoint tensor already written, as its writers' blocks: each turned
    into disjoint strided boxes of the tensor's index (`indexmap.source_box`) only when a later
    block must be checked against it, so the bookkeeping grows with blocks, never with rows."""

    def __init__(self, shape: tuple[int, ...], first: Block | None = None) -> None:
        self.shape = shape
        self.blocks: list[Block] = []  # writers not yet turned into boxes
        self.boxes: list[tuple] = []
        self.left = volume(shape)  # elements no writer covers yet
        if first is not None:
            self.add(first)

    def overlap(self, box: tuple) -> int:
        """How many of the box's elements are covered (asked only while some are not)."""
        for block in self.blocks:
            self.boxes.extend(_boxes(block, self.shape))
        self.blocks.clear()
        return sum(box_overlap(box, other) for other in self.boxes)

    def add(self, block: Block, box: tuple | None = None) -> None:
        """Cover a block none of whose source elements is covered yet (its box, if known)."""
        self.left -= volume(block.sizes)
        if box is None:
            self.blocks.append(block)
        else:
            self.boxes.append(box)


_ALL = _Covered(())  # a tensor its first writer covers whole (left == 0)
_ALL.left = 0


def _new_parts(block: Block, shape: tuple[int, ...], cover: _Covered) -> list[Block]:
    """The parts of a block whose source elements no earlier block covers (then marked covered):
    the whole block, nothing (a tied embedding's second reader, a `repeat` copy), or, where it
    overlaps earlier blocks in part, its pieces cut in halves along its largest dim until each is
    all new or all covered. A block reads each of its source elements once (no op broadcasts)."""
    n = volume(block.sizes)
    if not n or not cover.left:
        return []
    box = source_box(block, shape)
    if box is not None:
        seen = cover.overlap(box)
        if seen == n:
            return []
        if seen == 0:
            cover.add(block, box)
            return [block]
    return [part for piece in _halves(block) for part in _new_parts(piece, shape, cover)]


def _boxes(block: Block, shape: tuple[int, ...]) -> list[tuple]:
    """A block's source elements as strided boxes: its own, or its halves' where it is not one."""
    box = source_box(block, shape)
    if box is not None:
        return [box]
    return [b for piece in _halves(block) for b in _boxes(piece, shape)]


def _halves(block: Block) -> tuple[Block, Block]:
    """A block cut in two along its largest dim."""
    dim = max(range(len(block.sizes)), key=lambda j: block.sizes[j])
    start, size = block.offsets[dim], block.sizes[dim]
    return cut(block, dim, start, start + size // 2), cut(block, dim, start + size // 2, start + size)


def _inverse_steps(steps, source_dtype: str) -> tuple[tuple, str | None]:
    """The steps that undo a block's load steps, and the first lossy cast among them (or None)."""
    dtype, before, lossy = source_dtype, [], None
    for kind, value in steps:
        before.append(dtype)
        if kind == "cast":
            if lossy is None and not _lossless(dtype, value):
                lossy = f"cast({value})"
            dtype = value
    inverse = []
    for (kind, value), prior in zip(reversed(steps), reversed(before)):
        if kind == "cast":
            inverse.append(("cast", prior))
        elif kind == "scale":
            inverse.append(("scale", 1.0 / value))
        else:
            inverse.append(("add", -value))
    return tuple(inverse), lossy


def _lossless(a: str, b: str) -> bool:
    if a == b:
        return True
    if a in _FLOAT_BITS and b in _FLOAT_BITS:
        return all(x <= y for x, y in zip(_FLOAT_BITS[a], _FLOAT_BITS[b]))
    kind_a, kind_b = BY_NAME[a], BY_NAME[b]
    return kind_a.kind == kind_b.kind and kind_a.kind in ("int", "uint") and kind_a.bits <= kind_b.bits
