"""Boxes and affine index maps: the one place for the arithmetic of regions, blocks and byte runs.

A `Box` is a region of a tensor; a `Block` maps a box of a runtime tensor affinely onto a source
tensor. What the compiler, the plans and the save derive from them (a block cut to a box, the
contiguous runs of source elements it covers, element and byte counts) is computed here, in plain
ints: no torch, no tensor data, no per-element loop.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

from .dtypes import BY_NAME


class Box(NamedTuple):
    """A region of a tensor, [offsets, offsets + sizes), in plain ints."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class Block(NamedTuple):
    """The runtime box [offsets, offsets + sizes) takes, at index x, element
    `base + coeff . (x - offsets)` of tensor `source_key` (coeff: [source dim][runtime dim]): a
    checkpoint key, or the logical key of a tensor a `dequantize` made (`Compiled.logical`),
    then its value `steps`: ("cast", dtype), ("scale", x) or ("add", x). A block without a key is
    a fill with `fill`, never read.

    A named tuple, not a model: a DeepSeek-V3-sized checkpoint compiles to ~10^5 blocks, and the
    compiler's own ops build them; pydantic still checks and writes them as fields of RuntimeTensor.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source_key: str | None
    base: tuple[int, ...] = ()
    coeff: tuple[tuple[int, ...], ...] = ()
    steps: tuple[tuple[str, str | float], ...] = ()
    fill: float | None = None


def volume(sizes) -> int:
    """The number of elements of a shape (1 for a scalar)."""
    return prod(sizes)


def nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of a dtype name and shape (4-bit types: two elements a byte)."""
    return prod(shape) * BY_NAME[dtype].bits // 8


def row_major_strides(shape) -> list[int]:
    """Element strides of a contiguous row-major tensor of `shape`."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return strides


def is_row_major(strides, sizes) -> bool:
    """Whether element strides describe one contiguous row-major run of the given sizes."""
    expected = 1
    for t, n in zip(reversed(strides), reversed(sizes)):
        if n != 1 and t != expected:
            return False
        expected *= n
    return True


def column(b: Block, dim: int) -> tuple[int, ...]:
    """How the source index moves per step along runtime dim `dim`."""
    return tuple(row[dim] for row in b.coeff)


def advance(base: tuple[int, ...], col: tuple[int, ...], by: int) -> tuple[int, ...]:
    return tuple(x + c * by for x, c in zip(base, col))


def cut(b: Block, dim: int, start: int, stop: int) -> Block | None:
    """The part of a block inside [start, stop) along one runtime dim, re-based, or None."""
    lo, hi = max(b.offsets[dim], start), min(b.offsets[dim] + b.sizes[dim], stop)
    if lo >= hi:
        return None
    offsets, sizes = list(b.offsets), list(b.sizes)
    base = b.base
    if b.source_key is not None:
        base = advance(b.base, column(b, dim), lo - b.offsets[dim])
    offsets[dim], sizes[dim] = lo, hi - lo
    return b._replace(offsets=tuple(offsets), sizes=tuple(sizes), base=base)


def intersect(block: Block, offsets, sizes) -> Block | None:
    """The part of a block inside the box [offsets, offsets + sizes), re-based: `cut` on every dim
    at once, in one pass."""
    low, size = [], []
    for o, n, start, extent in zip(block.offsets, block.sizes, offsets, sizes):
        lo, hi = max(o, start), min(o + n, start + extent)
        if lo >= hi:
            return None
        low.append(lo)
        size.append(hi - lo)
    moved = [lo - o for lo, o in zip(low, block.offsets)]
    base = block.base
    if block.source_key is not None and any(moved):
        base = tuple(b + sum(c * m for c, m in zip(row, moved)) for b, row in zip(block.base, block.coeff))
    return Block(tuple(low), tuple(size), block.source_key, base, block.coeff, block.steps, block.fill)


def flat_map(block: Block, shape) -> tuple[int, list[int]]:
    """The block's map in the source's row-major flat index: its first element and, per runtime
    dim, the flat stride."""
    strides = row_major_strides(shape)
    start = sum(t * b for t, b in zip(strides, block.base))
    flat = [sum(strides[k] * block.coeff[k][j] for k in range(len(shape))) for j in range(len(block.sizes))]
    return start, flat


def source_runs(start: int, flat: list[int], sizes: tuple[int, ...]):
    """Contiguous runs of source elements (first, length) in ascending order, and each runtime
    dim's stride into their concatenation. Dims are taken by ascending source stride: the inner
    ones that continue a contiguous run merge into it; each remaining dim multiplies the runs."""
    moving = sorted((abs(t), j) for j, t in enumerate(flat) if sizes[j] > 1)
    if any(flat[j] < 0 for _, j in moving):  # no op of the language reverses a dim today
        raise NotImplementedError("negative source strides")
    length, k = 1, 0
    while k < len(moving) and moving[k][0] == length:
        length *= sizes[moving[k][1]]
        k += 1
    outer = moving[k:]  # ascending stride: the last is the outermost
    strides = [0] * len(sizes)
    for t, j in moving[:k]:
        strides[j] = t
    step = length
    for t, j in outer:
        strides[j] = step
        step *= sizes[j]
    firsts = [start]
    for t, j in reversed(outer):  # outermost first, so runs come out in ascending source order
        firsts = [f + t * i for f in firsts for i in range(sizes[j])]
    return [(f, length) for f in firsts], tuple(strides)
