"""Boxes and affine index maps: the one place for the arithmetic of regions, blocks and byte runs,
in plain ints (no torch, no per-element loop)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache
from math import gcd, prod
from operator import le, mul
from typing import NamedTuple

from .dtypes import BY_NAME


class Box(NamedTuple):
    """A region of a tensor, [offsets, offsets + sizes), in plain ints."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class Block(NamedTuple):
    """The runtime box [offsets, offsets + sizes) takes, at index x, element
    `base + coeff . (x - offsets)` of tensor `source_key` (coeff: [source dim][runtime dim]): a
    checkpoint key, or a `dequantize`'s logical key, then its value `steps`: ("cast", dtype),
    ("scale", x) or ("add", x). A block without a key is a fill with `fill`, never read. `view` is the
    shape `base` and `coeff` index: the source's flat view (one dim) once a reshape merged dims affine
    only in its flat index; () for the source's own shape. A named tuple: checkpoints compile to ~10^5."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source_key: str | None
    base: tuple[int, ...] = ()
    coeff: tuple[tuple[int, ...], ...] = ()
    steps: tuple[tuple[str, str | float], ...] = ()
    fill: float | None = None
    view: tuple[int, ...] = ()


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
    """The part of a block inside the box [offsets, offsets + sizes), re-based: `cut` on every dim at
    once (called once a piece: plain comparisons, no min/max calls)."""
    if block.offsets == offsets and block.sizes == sizes:  # the box is the block: nothing to cut
        return block
    low, size = [], []
    moved = False
    for o, n, start, extent in zip(block.offsets, block.sizes, offsets, sizes):
        lo = o if o > start else start
        hi = o + n if o + n < start + extent else start + extent
        if lo >= hi:
            return None
        low.append(lo)
        size.append(hi - lo)
        moved = moved or lo != o
    base = block.base
    if moved and block.source_key is not None:
        shift = [lo - o for lo, o in zip(low, block.offsets)]
        base = tuple(b + sum(c * m for c, m in zip(row, shift)) for b, row in zip(block.base, block.coeff))
    return Block(tuple(low), tuple(size), block.source_key, base, block.coeff, block.steps, block.fill, block.view)


class Runs(NamedTuple):
    """Runs of a file or a flat index repeating with constant strides: one run of `length` units (elements
    or bytes) at `first`, repeated along each dim (outermost first) `counts[d]` times, `strides[d]`
    apart. Plans hold this, never an object a run: a column shard is one `Runs`, whatever its rows."""

    first: int
    length: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """How many runs."""
        return prod(self.counts)

    @property
    def total(self) -> int:
        """Units over all runs (bytes, for a byte run set)."""
        return self.length * self.count

    @property
    def end(self) -> int:
        """One past the last unit of the last run."""
        return self.first + self.length + sum((n - 1) * t for n, t in zip(self.counts, self.strides)) \
            if self.count else self.first

    def starts(self):
        """Each run's first unit, in order: for a few runs, or a bounded chunk of them (`chunks`)."""
        firsts = [self.first]
        for n, t in zip(self.counts, self.strides):
            firsts = [f + t * i for f in firsts for i in range(n)]
        return firsts

    def chunks(self, most: int):
        """The runs, in order, as `Runs` of at most `most` runs each (the inner dims that fit kept whole)."""
        inner, kept = 1, len(self.counts)
        while kept > 0 and inner * self.counts[kept - 1] <= most:
            kept -= 1
            inner *= self.counts[kept]
        if kept == 0:
            yield self
            return
        n, t = self.counts[kept - 1], self.strides[kept - 1]
        step = max(1, most // inner)
        outer = Runs(self.first, self.length, self.counts[:kept - 1], self.strides[:kept - 1])
        for f in outer.starts():
            for i in range(0, n, step):
                yield Runs(f + i * t, self.length, (min(step, n - i),) + self.counts[kept:],
                           (t,) + self.strides[kept:])

    def in_bytes(self, byte_offset: int, itemsize: int) -> Runs:
        """These element runs as byte runs of a tensor whose data starts at `byte_offset`."""
        return Runs(byte_offset + self.first * itemsize, self.length * itemsize, self.counts,
                    tuple(t * itemsize for t in self.strides))


def source_runs(start: int, flat: list[int], sizes: tuple[int, ...]) -> tuple[Runs, tuple[int, ...]]:
    """The contiguous runs of source elements a block covers (flat map `start`, `flat`, runtime
    `sizes`), and each runtime dim's stride into their concatenation. By ascending source stride, dims
    continuing a run merge into it; the rest repeat the runs, merged where one continues the next."""
    moving = sorted((abs(t), j) for j, t in enumerate(flat) if sizes[j] > 1)
    if any(flat[j] < 0 for _, j in moving):  # no op of the language reverses a dim today
        raise NotImplementedError("negative source strides")
    length, k = 1, 0
    while k < len(moving) and moving[k][0] == length:
        length *= sizes[moving[k][1]]
        k += 1
    strides = [0] * len(sizes)
    for t, j in moving[:k]:
        strides[j] = t
    step = length
    counts: list[int] = []  # innermost first, while building
    steps: list[int] = []
    for t, j in moving[k:]:
        strides[j] = step
        step *= sizes[j]
        if counts and t == steps[-1] * counts[-1]:
            counts[-1] *= sizes[j]
        else:
            counts.append(sizes[j])
            steps.append(t)
    if not all(sizes):
        return Runs(start, length, (0,), (0,)), tuple(strides)
    return Runs(start, length, tuple(reversed(counts)), tuple(reversed(steps))), tuple(strides)


@lru_cache(maxsize=4096)
def byte_runs(shape: tuple[int, ...], coeff: tuple[tuple[int, ...], ...], sizes: tuple[int, ...],
               itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...], Runs, tuple[int, ...]]:
    """A block map's layout in its source's row-major flat index, whatever its base: the source's
    strides, the flat stride per runtime dim, the byte runs from byte 0, and the element strides into
    their concatenation. Cached: a checkpoint's many blocks share a few."""
    major = row_major_strides(shape)
    flat = tuple(sum(major[k] * coeff[k][j] for k in range(len(shape))) for j in range(len(sizes)))
    runs, strides = source_runs(0, list(flat), sizes)
    return tuple(major), flat, runs.in_bytes(0, itemsize), strides


def block_runs(block: Block, shape, byte_offset: int, itemsize: int
               ) -> tuple[Runs, tuple[int, ...], tuple[int, ...]]:
    """A block's byte runs in its source (row-major `shape`, data at `byte_offset`), the element
    strides into their concatenation, and each runtime dim's flat stride in the source."""
    major, flat, runs, strides = byte_runs(block.view or tuple(shape), block.coeff, block.sizes, itemsize)
    first = byte_offset + itemsize * sum(map(mul, major, block.base))
    return Runs(first, runs.length, runs.counts, runs.strides), strides, flat


class FirstDimIndex:
    """Entries with blocks of one tensor, ordered by the blocks' first offset, so that the few meeting a
    box are found by bisection instead of trying every block."""

    __slots__ = ("entries", "starts", "reach")

    def __init__(self, entries, blocks) -> None:
        starts = [b.offsets[0] for b in blocks]
        if all(map(le, starts, starts[1:])):  # in order already, as a stack's experts are
            self.entries, self.starts = list(entries), starts
        else:
            order = sorted(range(len(starts)), key=starts.__getitem__)  # stable: ties keep their order
            self.entries = list(map(entries.__getitem__, order))
            self.starts = list(map(starts.__getitem__, order))
        self.reach = max((b.sizes[0] for b in blocks), default=0)

    def meeting(self, offsets, sizes) -> list:
        """The entries whose block may meet the box [offsets, offsets + sizes) (along dim 0)."""
        lo = bisect_right(self.starts, offsets[0] - self.reach)
        return self.entries[lo:bisect_left(self.starts, offsets[0] + sizes[0])]


Progression = tuple[int, int, int]  # (first, count, step) of indices along one source dim


def source_box(block: Block, shape) -> tuple[Progression, ...] | None:
    """The source elements a block reads, as a strided box: per source dim, the progression of indices
    it takes. None where its map is not one box (cut such a block along its dims until each piece is)."""
    if block.view and block.view != tuple(shape):
        return _view_box(block, tuple(shape))
    moves: list[list[tuple[int, int]]] = [[] for _ in shape]
    for j, n in enumerate(block.sizes):
        if n <= 1:
            continue
        dims = [k for k in range(len(shape)) if block.coeff[k][j]]
        if len(dims) != 1 or block.coeff[dims[0]][j] < 0:
            return None
        moves[dims[0]].append((block.coeff[dims[0]][j], n))
    return _progressions(block.base, moves)


def _progressions(base, moves: list[list[tuple[int, int]]]) -> tuple[Progression, ...] | None:
    """Per source dim, the one progression its moves (step, count) walk from `base`, or None where
    they leave gaps or overlap."""
    box = []
    for k, moving in enumerate(moves):
        step, count = 1, 1
        for c, n in sorted(moving):
            if count > 1 and c != step * count:
                return None
            if count == 1:
                step = c
            count *= n
        box.append((base[k], count, step))
    return tuple(box)


def _view_box(block: Block, shape: tuple[int, ...]) -> tuple[Progression, ...] | None:
    """`source_box` of a block indexing a flat view of its source: each runtime dim must walk one source
    dim, or whole rows of it and on into the dim outside; else None."""
    viewed = row_major_strides(block.view)
    start = sum(map(mul, viewed, block.base))
    flat = [sum(map(mul, viewed, col)) for col in zip(*block.coeff)]
    major = row_major_strides(shape)
    base = [start // m % n for m, n in zip(major, shape)]
    walks: list[list[int]] = []  # (flat step, count), runtime dims that continue each other merged
    for t, n in sorted((t, n) for t, n in zip(flat, block.sizes) if n > 1):
        if walks and t == walks[-1][0] * walks[-1][1]:
            walks[-1][1] *= n
        else:
            walks.append([t, n])
    moves: list[list[tuple[int, int]]] = [[] for _ in shape]
    for t, n in walks:
        while n > 1:
            if t <= 0:
                return None
            k = next(k for k, m in enumerate(major) if m <= t)  # the dim whose rows the step fits in
            c = t // major[k]
            if t % major[k]:
                return None
            if base[k] + c * (n - 1) < shape[k]:
                moves[k].append((c, n))
                break
            per_row = shape[k] // c  # the walk leaves the row: it must take every c-th index of it
            if k == 0 or shape[k] % c or base[k] >= c or n % per_row:
                return None
            moves[k].append((c, per_row))
            t, n = major[k] * shape[k], n // per_row
    return _progressions(base, moves)  # merged walks nest only where each stays in its row


def box_volume(box: tuple[Progression, ...]) -> int:
    return prod(count for _, count, _ in box)


def common(a: Progression, b: Progression) -> int:
    """How many indices two progressions share (by the Chinese remainder theorem: no listing)."""
    (a0, na, sa), (b0, nb, sb) = a, b
    if not na or not nb:
        return 0
    sa, sb = (sa if na > 1 else 1), (sb if nb > 1 else 1)
    lo, hi = max(a0, b0), min(a0 + (na - 1) * sa, b0 + (nb - 1) * sb)
    if lo > hi:
        return 0
    g = gcd(sa, sb)
    if (b0 - a0) % g:
        return 0
    m = sb // g
    x = a0 + sa * ((b0 - a0) // g * pow(sa // g, -1, m) % m if m > 1 else 0)  # x = a0 (sa), = b0 (sb)
    period = sa * m
    x += -(-(lo - x) // period) * period  # the first shared index >= lo
    return (hi - x) // period + 1 if x <= hi else 0


def box_overlap(a: tuple[Progression, ...], b: tuple[Progression, ...]) -> int:
    """How many source elements two strided boxes share."""
    count = 1
    for pa, pb in zip(a, b):
        count *= common(pa, pb)
        if not count:
            return 0
    return count
