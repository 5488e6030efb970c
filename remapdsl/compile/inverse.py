"""Compiled -> the save direction: for each checkpoint tensor, the runtime regions that write it.

A block says `dest[offsets + x] = S[base + coeff . x]`, then its value steps. Saving reads it
backwards. Each element of a checkpoint tensor S must be written once: where several blocks hold
the same region of S (a tied embedding taken by two rules, `repeat`), the first in rule-file
order writes it. A region of S that no runtime tensor holds (a `slice` dropped it, a `drop`
removed S) cannot be written, and a cast that loses values on load (float32 read into bfloat16)
cannot be undone: both fail the save before any byte is written (E501-E503).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from ..dtypes import BY_NAME
from ..indexmap import cut, flat_map, source_runs, volume
from ..quant import get_format
from ..errors import Diagnostic, RemapError
from .model import Block, Compiled

# (exponent bits, mantissa bits) of the float types: a cast keeps every value iff neither shrinks
_FLOAT_BITS = {"float64": (11, 52), "float32": (8, 23), "bfloat16": (8, 7), "float16": (5, 10),
               "float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}


class Writer(NamedTuple):
    """One block that writes (part of) a checkpoint tensor, with the value steps that undo the
    load's: applied to the runtime values, they give the checkpoint's values in its dtype."""

    runtime_key: str
    block: Block
    steps: tuple[tuple[str, str | float], ...]


def writers(compiled: Compiled, *, allow_lossy: bool = False, requantize: bool = False) -> list[Writer]:
    """The blocks that write every checkpoint tensor the compiled rules read, each region once;
    raises RemapError naming every tensor that cannot be written back."""
    logical = compiled.logical_by_key()
    sources = {s.ckpt_key: s for s in compiled.ckpt_tensors}
    order = sorted(compiled.runtime_tensors, key=lambda d: (d.rule.path, d.rule.line, d.rule.column)
                   if d.rule else ("", 0, 0))
    chosen: dict[str, list[Writer]] = {}
    covered: dict[str, _Covered] = {}
    problems: list[Diagnostic] = []
    refused: set[str] = set()  # reported already (E502, E503): one error per tensor
    for d in order:
        for block in d.blocks:
            if block.source_key is None or block.source_key in refused:
                continue  # a pad region (not in the checkpoint), or a tensor already reported
            source = logical.get(block.source_key) or sources[block.source_key]
            fmt = get_format(source.format) if block.source_key in logical else None
            if fmt is not None and not (fmt.requantizes if requantize else fmt.encodes):
                refused.add(block.source_key)
                problems.append(Diagnostic(
                    code="E503", span=d.rule, message=f"`{d.runtime_key}` holds `{block.source_key}` dequantized "
                    f"({source.format}); writing it back in that format"
                    + (" with new scales" if requantize else "") + " is not supported yet",
                    hint="move the stored values as they are (`quantized`), or save a dequantized checkpoint"))
                continue
            steps, lossy = _inverse_steps(block.steps, source.dtype)
            if lossy and not allow_lossy:
                refused.add(block.source_key)
                problems.append(Diagnostic(
                    code="E502", span=d.rule, message=f"`{d.runtime_key}` reads `{block.source_key}` through "
                    f"`{lossy}`, which loses values: the checkpoint cannot be written back exactly",
                    hint="pass allow_lossy=True to write the rounded values"))
                continue
            shape = source.shape
            cover = covered.setdefault(block.source_key, _Covered())
            for piece in _new_parts(block, shape, cover):  # what earlier rules left: first rule wins
                chosen.setdefault(block.source_key, []).append(Writer(d.runtime_key, piece, steps))
    dequantized = {part: source.logical_key for source in logical.values() for part in source.parts}
    checked = [(k, s) for k, s in sources.items() if k not in dequantized] + list(logical.items())
    for key, source in checked:  # the parts of a dequantized tensor: its values through it, scales copied
        if key in refused:
            continue  # E502 or E503 above
        held = sum(volume(w.block.sizes) for w in chosen.get(key, []))
        if key in compiled.dropped or not held:
            why = "is dropped by the rules" if key in compiled.dropped else "is read by no rule"
            problems.append(Diagnostic(code="E501", message=f"checkpoint tensor `{key}` {why}: no runtime "
                                       "tensor holds it", hint="the save writes back only what the load read"))
        elif held != volume(source.shape):
            problems.append(Diagnostic(code="E501", message=f"checkpoint tensor `{key}` {list(source.shape)}: "
                                       f"the runtime tensors hold {held} of its {volume(source.shape)} "
                                       "elements (a `slice` left the rest out)",
                                       hint="the save writes back only what the load read"))
    if problems:
        raise RemapError(tuple(problems))
    return [w for pieces in chosen.values() for w in pieces]


def copied_parts(compiled: Compiled) -> list[str]:
    """Scales of dequantized tensors: a save writes the values back with them, so they are copied
    from the checkpoint the output is like, byte for byte."""
    return sorted(part for source in compiled.logical for part in source.parts[1:])


class _Covered:
    """The elements of one checkpoint tensor already written, as sorted disjoint [start, stop)
    intervals of its row-major flat index."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []

    def overlap(self, start: int, stop: int) -> int:
        """How many of [start, stop) are covered."""
        i = bisect.bisect_right(self.stops, start)
        count = 0
        while i < len(self.starts) and self.starts[i] < stop:
            count += min(stop, self.stops[i]) - max(start, self.starts[i])
            i += 1
        return count

    def add(self, start: int, stop: int) -> None:
        """Cover [start, stop) (not covered yet), merged with a neighbour it touches: runs taken in
        order stay one interval, so the lists stay short."""
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.stops[i - 1] == start:
            self.stops[i - 1] = stop
            if i < len(self.starts) and self.starts[i] == stop:  # now touches the next one too
                self.stops[i - 1] = self.stops.pop(i)
                self.starts.pop(i)
        elif i < len(self.starts) and self.starts[i] == stop:
            self.starts[i] = start
        else:
            self.starts.insert(i, start)
            self.stops.insert(i, stop)


def _new_parts(block: Block, shape: tuple[int, ...], cover: _Covered) -> list[Block]:
    """The parts of a block whose source elements no earlier block covers (then marked covered):
    the whole block, nothing (a tied embedding's second reader, a `repeat` copy), or, where it
    overlaps earlier blocks in part, its pieces cut in halves along its largest dim until each is
    all new or all covered."""
    runs, _ = source_runs(*flat_map(block, shape), block.sizes)
    size = sum(n for _, n in runs)
    seen = sum(cover.overlap(first, first + n) for first, n in runs)
    if seen == size:
        return []
    if seen == 0:
        for first, n in runs:
            cover.add(first, first + n)
        return [block]
    dim = max(range(len(block.sizes)), key=lambda j: block.sizes[j])
    half = block.sizes[dim] // 2
    parts = []
    for lo, n in ((0, half), (half, block.sizes[dim] - half)):
        offsets = block.offsets[dim] + lo
        piece = cut(block, dim, offsets, offsets + n)
        parts.extend(_new_parts(piece, shape, cover))
    return parts


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
