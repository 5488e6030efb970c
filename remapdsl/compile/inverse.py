"""Compiled -> the save direction: for each checkpoint tensor, the runtime regions that write it.

A block says `dest[offsets + x] = S[base + coeff . x]`, then its value steps. Saving reads it
backwards. Each element of a checkpoint tensor S must be written once: where several blocks hold
the same region of S (a tied embedding taken by two rules, `repeat`), the first in rule-file
order writes it. A region of S that no runtime tensor holds (a `slice` dropped it, a `drop`
removed S) cannot be written, and a cast that loses values on load (float32 read into bfloat16)
cannot be undone: both fail the save before any byte is written (E501-E503), unless the caller
chose what happens to the dropped tensors (`dropped="copy"` or `"omit"`, remapdsl/drivers/save.py).
"""

from __future__ import annotations

from itertools import chain
from math import prod
from operator import attrgetter
from typing import NamedTuple

from ..dtypes import BY_NAME
from ..errors import Diagnostic, RemapError, Span
from ..indexmap import box_overlap, cut, source_box, volume
from ..quant import get_format
from .model import Block, Compiled, LogicalTensor, RuntimeTensor

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
DROPPED = ("error", "copy", "omit")  # what a save does with the checkpoint tensors the rules drop


def writers(compiled: Compiled, *, allow_lossy: bool = False, requantize: bool = False,
            dropped: str = "error") -> list[Writer]:
    """The blocks that write every checkpoint tensor the compiled rules read, each region once;
    raises RemapError naming every tensor that cannot be written back. A tensor the rules drop is
    an error only with `dropped="error"`: otherwise the caller copies or omits it (`dropped_keys`).

    The runtime tensors are taken in rule-file order (`_rule_order`), each block in turn
    (`_Writing.take`): its tensor's first writer, the parts of it no earlier block wrote, or a
    refusal (E502, E503); then the tensors no block writes whole are named (`_unwritten`, E501)."""
    logical = compiled.logical_by_key()
    writing = _Writing(compiled, logical, allow_lossy, requantize)
    for d in _rule_order(compiled.runtime_tensors):
        writing.take(d)
    problems = writing.problems + _unwritten(compiled, logical, writing, dropped)
    if problems:
        raise RemapError(tuple(problems))
    return writing.ordered()


def _rule_order(runtime_tensors) -> list[RuntimeTensor]:
    """The runtime tensors in the order of their rules in the rule files, where the first rule wins
    a region several read (a tensor without a rule span first, as `("", 0, 0)`)."""
    return sorted(runtime_tensors, key=lambda d: (d.rule.path, d.rule.line, d.rule.column) if d.rule else ("", 0, 0))


class _Computed(dict):
    """A dict that computes a missing value once, `compute(key)`: a checkpoint has a few step chains
    and formats, read by thousands of blocks, and a hit stays a plain dict lookup."""

    def __init__(self, compute) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, key):
        value = self[key] = self.compute(key)
        return value


class _Writing:
    """The writers found so far, taking the runtime tensors in rule-file order: each checkpoint
    tensor's first writer, the parts of later blocks that earlier ones left, and what cannot be
    written back (one error a tensor)."""

    def __init__(self, compiled: Compiled, logical: dict[str, LogicalTensor], allow_lossy: bool,
                 requantize: bool) -> None:
        self.known = dict(zip(map(_CKPT_KEY, compiled.ckpt_tensors), compiled.ckpt_tensors))  # key -> what it names
        self.known.update(logical)
        self.logical, self.allow_lossy, self.requantize = logical, allow_lossy, requantize
        self.first: dict[str, Writer] = {}  # key -> its first writer (most tensors have no other)
        self.more: dict[str, list[Writer]] = {}  # key -> the parts of later blocks that earlier ones left
        self.partial: dict[str, _Covered] = {}  # the tensors whose first writer does not cover them whole
        self.problems: list[Diagnostic] = []
        self.refused: set[str] = set()  # reported already (E502, E503): one error per tensor
        # (load steps, checkpoint dtype) -> (inverse steps, lossy cast); format -> whether it writes back
        self.undone = _Computed(lambda pair: _inverse_steps(*pair))
        self.writable = _Computed(lambda name: _writes_back(name, requantize))

    def take(self, d: RuntimeTensor) -> None:
        """Each block of `d` in turn: a pad's fill (no source) and a tensor already refused are
        passed over; a tensor held in a format that cannot write it back is E503 at its first
        block, a block read through a lossy cast E502 (unless allowed); else the block is its
        tensor's first writer, or a later one that writes only what the earlier left."""
        known, logical, first, refused, undone = self.known, self.logical, self.first, self.refused, self.undone
        runtime_key, rule = d.runtime_key, d.rule
        for block in d.blocks:
            key = block.source_key
            if key is None or key in refused:
                continue
            source = known[key]
            fresh = key not in first
            if fresh and key in logical and not self.writable[source.format]:
                self.refuse(key, _unwritable(d, source, self.requantize))
                continue
            steps, lossy = undone[block.steps, source.dtype]
            if lossy and not self.allow_lossy:
                self.refuse(key, _lossy(d, key, lossy))
                continue
            writer = Writer(runtime_key, block, steps, rule)
            if fresh:  # the tensor's first writer: all of its block is new
                first[key] = writer
                if prod(block.sizes) != prod(source.shape):
                    self.partial[key] = _Covered(source.shape, block)
            else:
                self.later(key, writer, source.shape)

    def refuse(self, key: str, problem: Diagnostic) -> None:
        """A tensor that cannot be written back: its error, and none of its later blocks looked at."""
        self.refused.add(key)
        self.problems.append(problem)

    def later(self, key: str, writer: Writer, shape: tuple[int, ...]) -> None:
        """A block of a tensor an earlier block writes: its parts that no earlier block covers (the
        first rule wins; nothing if the first writer covers the tensor whole)."""
        for piece in _new_parts(writer.block, shape, self.partial.get(key, _ALL)):
            self.more.setdefault(key, []).append(writer._replace(block=piece))

    def ordered(self) -> list[Writer]:
        """Every writer, each tensor's first one followed by its later parts."""
        more = self.more
        return [w for key, head in self.first.items() for w in (head, *more.get(key, ()))]


def _lossy(d: RuntimeTensor, key: str, cast: str) -> Diagnostic:
    """E502: a tensor read through a cast that loses values cannot be written back exactly."""
    return Diagnostic(code="E502", span=d.rule, message=f"`{d.runtime_key}` reads `{key}` through `{cast}`, which "
                      "loses values: the checkpoint cannot be written back exactly",
                      hint="pass allow_lossy=True to write the rounded values")


def _unwritten(compiled: Compiled, logical: dict[str, LogicalTensor], writing: _Writing,
               dropped: str) -> list[Diagnostic]:
    """E501 for each tensor that must be written and that no block writes whole: dropped by the
    rules (unless the caller copies or omits those), read by no rule, or read in part. Only the
    tensors not written whole are looked at: the checkpoint tensors the rules read as they are (the
    parts of a dequantized tensor go through it, its scales are copied) and the logical tensors; a
    tensor already refused (E502, E503) is not named again."""
    first, partial, refused = writing.first, writing.partial, writing.refused
    ckpt_keys = list(map(_CKPT_KEY, compiled.ckpt_tensors))
    whole = first.keys() - {k for k, c in partial.items() if c.left}
    dequantized = set(chain.from_iterable(map(_PARTS, logical.values())))
    left = set(ckpt_keys).difference(dequantized, whole, refused)
    checked = [(k, s) for k, s in zip(ckpt_keys, compiled.ckpt_tensors) if k in left] if left else []
    left = logical.keys() - whole - refused
    checked += [(k, s) for k, s in logical.items() if k in left] if left else []
    dropped_keys = set(compiled.dropped)
    bound = None  # the keys the rules read, made only for an empty tensor (no block names it)
    problems: list[Diagnostic] = []
    for key, source in checked:
        total = volume(source.shape)
        if total == 0:
            bound = bound if bound is not None else {k for b in compiled.bindings for k in b.ckpt_keys}
            if key in bound:
                continue  # no element to write; its file keeps its (empty) entry
        held = total - partial.get(key, _ALL).left if key in first else 0  # blocks stay inside their source
        if key in dropped_keys and not held and dropped != "error":
            continue  # copied from `like` or left out by the caller
        if key in dropped_keys and not held:
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
    return problems


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
