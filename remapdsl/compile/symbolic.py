"""Layout ops on symbolic tensors: shapes and blocks only, never data.

A symbolic tensor is a shape, a dtype and blocks that tile it: block b says that the runtime tensor
box [offsets, offsets + sizes) holds, at index x, element `base + coeff . (x - offsets)` of one
checkpoint tensor (coeff has one row per source dim and one column per runtime dim), then its
value steps. Every layout op of the language is an exact index map, so it maps blocks to blocks;
where a map is affine only piecewise (reshape across a partial row), blocks are cut into pieces.
"""

from __future__ import annotations

import itertools
from operator import add, attrgetter, itemgetter, lt, mod, mul
from typing import NamedTuple

from ..indexmap import Block, advance, column, cut, row_major_strides, volume
from ..language.limits import MAX_BLOCKS, MAX_PIECES, MAX_SIZE



class Sym(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    blocks: tuple[Block, ...]


class OpError(Exception):
    """An op that does not fit the shapes it meets; the compiler locates it at the op."""


class LimitError(OpError):
    """An op asked for more than remapdsl's limits allow (language/limits.py): too many pieces, or
    a dim or an element count beyond MAX_SIZE, or a tensor of more than MAX_BLOCKS blocks."""


def _blocks_within(count: int, what: str) -> None:
    """Checked before an op that multiplies blocks builds them: chained `repeat`s, or a reshape
    that splits blocks by rows, could otherwise ask for billions (memory and time, not an error)."""
    if count > MAX_BLOCKS:
        raise LimitError(f"{what} would describe one tensor by {count} blocks: more than 2^20 = {MAX_BLOCKS}, "
                         "the most one tensor may have")


def _count(value: int, what: str) -> int:
    """A count an op cuts or copies by (`groups`, `n`, `times`, `heads`): from 1 to MAX_PIECES."""
    if value < 1:
        raise OpError(f"`{what}` must be at least 1, not {value}")
    if value > MAX_PIECES:
        raise LimitError(f"`{what}={value}` is more than 2^16 = {MAX_PIECES}, the most pieces one op makes")
    return value


def _bounded(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """A shape an op grows a tensor to, within MAX_SIZE elements."""
    if volume(shape) > MAX_SIZE or max(shape, default=0) > MAX_SIZE:
        raise LimitError(f"{what} makes a tensor of shape {list(shape)}, {volume(shape)} elements: more "
                         f"than 2^48 = {MAX_SIZE}, the largest size")
    return shape


_IDENTITY = {n: tuple(tuple(1 if i == j else 0 for j in range(n)) for i in range(n)) for n in range(9)}
_ZEROS = {n: (0,) * n for n in range(9)}


def source(ckpt_key: str, shape: tuple[int, ...], dtype: str, viewable: bool = False) -> Sym:
    """A checkpoint tensor as one block that maps each index to itself. `viewable`: a later reshape
    may index its flat view (`Block.view`), which suits a tensor read as plain bytes."""
    n = len(shape)
    if 0 in shape:
        return Sym(shape, dtype, ())
    identity = _IDENTITY.get(n) or tuple(tuple(1 if i == j else 0 for j in range(n)) for i in range(n))
    zeros = _ZEROS.get(n) or (0,) * n
    block = Block(zeros, shape, ckpt_key, zeros, identity, (), None, shape if viewable else ())
    return Sym(shape, dtype, (block,))


def _dim(dim: int, ndim: int, what: str = "dim") -> int:
    if not -ndim <= dim < ndim:
        raise OpError(f"{what}={dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _shift(b: Block, dim: int, delta: int) -> Block:
    offsets, sizes, key, base, coeff, steps, fill, view = b
    return Block(offsets[:dim] + (offsets[dim] + delta,) + offsets[dim + 1:], sizes, key, base, coeff, steps, fill,
                 view)


def narrow(t: Sym, dim: int, start: int, stop: int) -> Sym:
    """The range [start, stop) of one dim, re-based to start at 0."""
    blocks = []
    for b in t.blocks:
        piece = cut(b, dim, start, stop)
        if piece is not None:
            blocks.append(_shift(piece, dim, -start))
    shape = list(t.shape)
    shape[dim] = stop - start
    return Sym(tuple(shape), t.dtype, tuple(blocks))


def concat(parts: list[Sym], dim: int) -> Sym:
    first = parts[0]
    dim = _dim(dim, len(first.shape))
    _same_except(parts, dim, "concat")
    blocks, at = [], 0
    for p in parts:
        blocks.extend((_shift(b, dim, at) for b in p.blocks) if at else p.blocks)  # the first part stays put
        at += p.shape[dim]
    shape = list(first.shape)
    shape[dim] = at
    return Sym(tuple(shape), first.dtype, tuple(blocks))


def stack(parts: list[Sym], dim: int) -> Sym:
    first = parts[0]
    dim = _dim(dim, len(first.shape) + 1)
    _same_except(parts, None, "stack")
    blocks = []
    widened: dict[tuple, tuple] = {}  # parts usually share one coeff and one shape: widen them once
    grown: dict[tuple, tuple] = {}
    for i, p in enumerate(parts):
        for offsets, sizes, key, base, coeff, steps, fill, view in p.blocks:
            wide = widened.get(coeff)
            if wide is None:
                wide = widened[coeff] = tuple(row[:dim] + (0,) + row[dim:] for row in coeff)
            size = grown.get(sizes)
            if size is None:
                size = grown[sizes] = sizes[:dim] + (1,) + sizes[dim:]
            at = offsets[:dim] + (i,) + offsets[dim:]
            blocks.append(Block(at, size, key, base, wide, steps, fill, view))
    shape = first.shape[:dim] + (len(parts),) + first.shape[dim:]
    return Sym(shape, first.dtype, tuple(blocks))


def unstack(t: Sym, dim: int) -> list[Sym]:
    dim = _dim(dim, len(t.shape))
    if t.shape[dim] > MAX_PIECES:
        raise LimitError(f"unstacking dim {dim} of size {t.shape[dim]} makes more than 2^16 = "
                         f"{MAX_PIECES} tensors, the most pieces one op makes")
    out = []
    for i in range(t.shape[dim]):
        piece = narrow(t, dim, i, i + 1)
        blocks = tuple(Block(b.offsets[:dim] + b.offsets[dim + 1:], b.sizes[:dim] + b.sizes[dim + 1:],
                           b.source_key, b.base, tuple(row[:dim] + row[dim + 1:] for row in b.coeff),
                           b.steps, b.fill, b.view) for b in piece.blocks)
        out.append(Sym(t.shape[:dim] + t.shape[dim + 1:], t.dtype, blocks))
    return out


def split(t: Sym, dim: int, sizes: tuple[int, ...]) -> list[Sym]:
    dim = _dim(dim, len(t.shape))
    if sum(sizes) != t.shape[dim]:
        raise OpError(f"split sizes {list(sizes)} add up to {sum(sizes)}, but dim {dim} has "
                          f"{t.shape[dim]}")
    out, at = [], 0
    for size in sizes:
        out.append(narrow(t, dim, at, at + size))
        at += size
    return out


def chunk(t: Sym, dim: int, n: int) -> list[Sym]:
    dim = _dim(dim, len(t.shape))
    _count(n, "n")
    if t.shape[dim] % n:
        raise OpError(f"dim {dim} of size {t.shape[dim]} does not divide into {n} equal parts")
    return split(t, dim, (t.shape[dim] // n,) * n)


def interleave(parts: list[Sym], dim: int, groups: int) -> Sym:
    """Group g of every part, in part order, then group g + 1 (GQA qkv, blocked gate/up)."""
    dim = _dim(dim, len(parts[0].shape))
    _count(groups, "groups")
    _same_except(parts, dim, "interleave")
    for p in parts:
        if p.shape[dim] % groups:
            raise OpError(f"dim {dim} of size {p.shape[dim]} does not divide into "
                              f"{groups} groups")
    _blocks_within(sum(len(p.blocks) for p in parts) * groups, f"interleaving {groups} groups")
    pieces = []
    for g in range(groups):
        for p in parts:
            step = p.shape[dim] // groups
            pieces.append(narrow(p, dim, g * step, (g + 1) * step))
    return concat(pieces, dim)


def deinterleave(t: Sym, dim: int, groups: int, parts: int) -> list[Sym]:
    """The inverse of interleave for parts of equal size."""
    dim = _dim(dim, len(t.shape))
    _count(groups, "groups")
    if t.shape[dim] % (groups * parts):
        raise OpError(f"dim {dim} of size {t.shape[dim]} does not divide into {groups} groups "
                          f"of {parts} parts")
    step = t.shape[dim] // (groups * parts)
    _blocks_within(len(t.blocks) * groups, f"deinterleaving {groups} groups")
    out = []
    for i in range(parts):
        pieces = [narrow(t, dim, (g * parts + i) * step, (g * parts + i + 1) * step)
                  for g in range(groups)]
        out.append(concat(pieces, dim))
    return out


def permute(t: Sym, dims: tuple[int, ...]) -> Sym:
    n = len(t.shape)
    if len(dims) != n:
        raise OpError(f"permute needs {n} dims for a {n}-d tensor, got {len(dims)}")
    order = tuple(_dim(d, n) for d in dims)
    if sorted(order) != list(range(n)):
        raise OpError(f"{list(dims)} is not a permutation of the {n} dims")
    blocks = tuple(b._replace(offsets=tuple(b.offsets[d] for d in order),
                              sizes=tuple(b.sizes[d] for d in order),
                              coeff=tuple(tuple(row[d] for d in order) for row in b.coeff))
                   for b in t.blocks)
    return Sym(tuple(t.shape[d] for d in order), t.dtype, blocks)


def transpose(t: Sym, a: int, b: int) -> Sym:
    n = len(t.shape)
    a, b = _dim(a, n, "a"), _dim(b, n, "b")
    order = list(range(n))
    order[a], order[b] = order[b], order[a]
    return permute(t, tuple(order))


def slice_(t: Sym, dim: int, start: int | None, stop: int | None) -> Sym:
    dim = _dim(dim, len(t.shape))
    size = t.shape[dim]
    start = 0 if start is None else start
    stop = size if stop is None else stop
    if not 0 <= start < stop <= size:
        raise OpError(f"slice [{start}, {stop}) is not inside dim {dim} of size {size}")
    return narrow(t, dim, start, stop)


def pad(t: Sym, dim: int, to: int, value: float) -> Sym:
    dim = _dim(dim, len(t.shape))
    size = t.shape[dim]
    if to < size:
        raise OpError(f"pad to {to} would shrink dim {dim} of size {size}")
    shape = list(t.shape)
    shape[dim] = to
    _bounded(tuple(shape), f"pad to {to}")
    blocks = list(t.blocks)
    if to > size:
        offsets = [0] * len(shape)
        offsets[dim] = size
        sizes = list(shape)
        sizes[dim] = to - size
        # a fill is made in the tensor's dtype at this point, then takes the later value steps
        blocks.append(Block(tuple(offsets), tuple(sizes), None, (), (), (("cast", t.dtype),), float(value)))
    return Sym(tuple(shape), t.dtype, tuple(blocks))


def repeat(t: Sym, dim: int, times: int) -> Sym:
    dim = _dim(dim, len(t.shape))
    _count(times, "times")
    _bounded(t.shape[:dim] + (t.shape[dim] * times,) + t.shape[dim + 1:], f"repeat {times} times")
    _blocks_within(len(t.blocks) * times, f"repeat {times} times")
    return concat([t] * times, dim)


def value_step(t: Sym, step: tuple) -> Sym:
    dtype = step[1] if step[0] == "cast" else t.dtype
    blocks = tuple(b._replace(steps=b.steps + (step,)) for b in t.blocks)
    return Sym(t.shape, dtype, blocks)


def reshape(t: Sym, shape: tuple[int, ...]) -> Sym:
    """Any reshape of a contiguous tensor, as merges and splits of adjacent dims."""
    old = t.shape
    numel = volume(old)
    if shape.count(-1) > 1:
        raise OpError("a reshape may infer one size (-1), not several")
    if -1 in shape:
        known = volume(s for s in shape if s != -1)
        if known == 0 or numel % known:
            raise OpError(f"cannot reshape {list(old)} into {list(shape)}")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if volume(shape) != numel:
        raise OpError(f"cannot reshape {list(old)} ({numel} elements) into {list(shape)} "
                          f"({volume(shape)} elements)")
    # Group old and new dims into runs of equal products; within a run, merge then split.
    result = t
    i = j = 0
    out_dim = 0
    while i < len(old) or j < len(shape):
        run_old, run_new = [i], [j]
        p_old, p_new = (old[i] if i < len(old) else 1), (shape[j] if j < len(shape) else 1)
        while p_old != p_new:
            if p_old < p_new:
                i += 1
                run_old.append(i)
                p_old *= old[i]
            else:
                j += 1
                run_new.append(j)
                p_new *= shape[j]
        # absorb trailing size-1 dims into the current run where both sides agree
        olds = [k for k in run_old if k < len(old)]
        news = [k for k in run_new if k < len(shape)]
        for _ in range(len(olds) - 1):
            result = _merge(result, out_dim)
        if len(news) > 1:
            result = _split(result, out_dim, tuple(shape[k] for k in news))
        elif len(news) == 1 and not olds:
            result = _insert_unit(result, out_dim)
        elif not news and olds:
            result = _drop_unit(result, out_dim)
        out_dim += len(news)
        i, j = i + 1, j + 1
    return result


def rope_permute(t: Sym, heads: int) -> Sym:
    """Per head, rows seen as [rows/2, 2] transposed to [2, rows/2] (Meta -> rotate-half)."""
    _count(heads, "heads")
    rows = t.shape[0]
    if rows % (2 * heads):
        raise OpError(f"{rows} rows do not divide into {heads} heads of pairs")
    rest = t.shape[1:]
    viewed = reshape(t, (heads, rows // heads // 2, 2) + rest)
    return reshape(transpose(viewed, 1, 2), (rows,) + rest)


def rope_unpermute(t: Sym, heads: int) -> Sym:
    """The inverse of `rope_permute`: per head, rows seen as [2, rows/2] transposed to [rows/2, 2]
    (rotate-half -> Meta's pair-interleaved order)."""
    _count(heads, "heads")
    rows = t.shape[0]
    if rows % (2 * heads):
        raise OpError(f"{rows} rows do not divide into {heads} heads of pairs")
    rest = t.shape[1:]
    viewed = reshape(t, (heads, 2, rows // heads // 2) + rest)
    return reshape(transpose(viewed, 1, 2), (rows,) + rest)


def tiles(blocks: tuple[Block, ...], shape: tuple[int, ...]) -> bool:
    """The blocks lie within `shape` and none overlaps another (blocks have its rank). Blocks of
    one size at distinct multiples of it (what `stack` makes) are told in a few passes in C; one
    block at the origin with the tensor's sizes (a rule that renames) at once."""
    if len(blocks) == 1:
        b = blocks[0]
        if b.sizes == shape and not any(b.offsets):
            return True
    if len(blocks) > 1 and len(sizes := set(map(_SIZES, blocks))) == 1:
        (size,) = sizes
        offsets = list(map(_OFFSETS, blocks))
        if 0 not in size and len(size) == len(shape) and len(set(offsets)) == len(offsets):
            columns = list(zip(*offsets))  # per dim, every block's offset
            aligned = not any(any(map(mod, c, itertools.repeat(n))) for c, n in zip(columns, size))
            if len(columns) == len(size) and aligned:
                return all(min(c) >= 0 and max(c) + n <= extent for c, n, extent in zip(columns, size, shape))
    return _inside(blocks, shape) and _disjoint(blocks)


def _inside(blocks: tuple[Block, ...], shape: tuple[int, ...]) -> bool:
    """Every block lies within `shape` (blocks have its rank): one pass a dim, in C."""
    for k, n in enumerate(shape):
        starts = list(map(itemgetter(k), map(_OFFSETS, blocks)))
        if starts and (min(starts) < 0 or max(map(add, starts, map(itemgetter(k), map(_SIZES, blocks)))) > n):
            return False
    return True


def _disjoint(blocks: tuple[Block, ...]) -> bool:
    """No two blocks overlap (sweep on the first dim; blocks are few per runtime tensor)."""
    if not blocks or not blocks[0].offsets:
        return len(blocks) <= 1
    ordered = sorted(blocks, key=lambda b: b.offsets[0])
    active: list[tuple[int, Block]] = []  # (end on the first dim, block) of those the sweep is in
    for b in ordered:
        start = b.offsets[0]
        active = [(end, a) for end, a in active if end > start]
        if active:
            ends = tuple(map(add, b.offsets, b.sizes))
            for _, a in active:
                if all(map(lt, a.offsets, ends)) and all(map(lt, b.offsets, map(add, a.offsets, a.sizes))):
                    return False
        active.append((start + b.sizes[0], b))
    return True


_OFFSETS, _SIZES = attrgetter("offsets"), attrgetter("sizes")


# ---- helpers -------------------------------------------------------------------------------


def _same_except(parts: list[Sym], dim: int | None, op: str) -> None:
    first = parts[0]
    for p in parts[1:]:
        if p.shape == first.shape and p.dtype == first.dtype:  # the usual case, told at once
            continue
        if len(p.shape) != len(first.shape) or any(
                a != b for k, (a, b) in enumerate(zip(p.shape, first.shape)) if k != dim):
            raise OpError(f"{op} needs matching shapes{' outside dim ' + str(dim) if dim is not None else ''}: "
                              f"{list(first.shape)} and {list(p.shape)}")
        if p.dtype != first.dtype:
            raise OpError(f"{op} needs one dtype: {first.dtype} and {p.dtype}")


def _insert_unit(t: Sym, dim: int) -> Sym:
    blocks = tuple(b._replace(offsets=b.offsets[:dim] + (0,) + b.offsets[dim:],
                              sizes=b.sizes[:dim] + (1,) + b.sizes[dim:],
                              coeff=tuple(r[:dim] + (0,) + r[dim:] for r in b.coeff))
                   for b in t.blocks)
    return Sym(t.shape[:dim] + (1,) + t.shape[dim:], t.dtype, blocks)


def _drop_unit(t: Sym, dim: int) -> Sym:
    blocks = tuple(b._replace(offsets=b.offsets[:dim] + b.offsets[dim + 1:],
                              sizes=b.sizes[:dim] + b.sizes[dim + 1:],
                              coeff=tuple(r[:dim] + r[dim + 1:] for r in b.coeff))
                   for b in t.blocks)
    return Sym(t.shape[:dim] + t.shape[dim + 1:], t.dtype, blocks)


def _merge(t: Sym, dim: int) -> Sym:
    """Merge dims dim and dim + 1 (sizes A, B) into one of size A * B."""
    inner = t.shape[dim + 1]
    blocks: list[Block] = []
    for b in t.blocks:
        a_off, a_size = b.offsets[dim], b.sizes[dim]
        b_off, b_size = b.offsets[dim + 1], b.sizes[dim + 1]
        col_a, col_b = column(b, dim), column(b, dim + 1)
        whole_rows = b_off == 0 and b_size == inner
        affine = b.source_key is None or all(x == inner * y for x, y in zip(col_a, col_b))
        if whole_rows and not affine and b.view and len(b.view) > 1:
            flat = _flat_view(b)  # rows that follow each other in the source's bytes: one block still
            if column(flat, dim)[0] == inner * column(flat, dim + 1)[0]:
                b, affine = flat, True
        if whole_rows and affine:
            pieces = [(a_off * inner, a_size * inner, b.base)]
        else:  # one piece per row of the outer dim
            _blocks_within(len(blocks) + a_size, f"merging dims {dim} and {dim + 1} (a piece per row)")
            pieces = []
            for r in range(a_size):
                base = advance(b.base, col_a, r) if b.source_key is not None else b.base
                pieces.append(((a_off + r) * inner + b_off, b_size, base))
        for offset, size, base in pieces:
            blocks.append(b._replace(
                offsets=b.offsets[:dim] + (offset,) + b.offsets[dim + 2:],
                sizes=b.sizes[:dim] + (size,) + b.sizes[dim + 2:],
                base=base, coeff=tuple(r[:dim] + (r[dim + 1],) + r[dim + 2:] for r in b.coeff)))
    shape = t.shape[:dim] + (t.shape[dim] * inner,) + t.shape[dim + 2:]
    return Sym(shape, t.dtype, tuple(blocks))


def _flat_view(b: Block) -> Block:
    """The same block indexing its source's flat view: one source dim, row-major strides."""
    major = row_major_strides(b.view)
    return b._replace(base=(sum(map(mul, major, b.base)),),
                      coeff=(tuple(sum(map(mul, major, col)) for col in zip(*b.coeff)),), view=(volume(b.view),))


def _split(t: Sym, dim: int, sizes: tuple[int, ...]) -> Sym:
    """Split dim into several dims of the given sizes (their product is the dim's size)."""
    if len(sizes) > 2:
        return _split(_split(t, dim, (sizes[0], volume(sizes[1:]))), dim + 1, sizes[1:])
    outer, inner = sizes
    blocks: list[Block] = []
    for b in t.blocks:
        start, stop = b.offsets[dim], b.offsets[dim] + b.sizes[dim]
        # pieces: a partial first row, whole rows, a partial last row
        cuts = sorted({start, stop, min(stop, -(-start // inner) * inner), max(start, stop // inner * inner)})
        for lo, hi in zip(cuts, cuts[1:]):
            if lo >= hi:
                continue
            piece = cut(b, dim, lo, hi)
            col = column(piece, dim)
            if lo % inner == 0 and hi % inner == 0:
                offsets = (lo // inner, 0)
                psizes = ((hi - lo) // inner, inner)
                new_cols = (tuple(c * inner for c in col), col)
            else:  # inside one row
                offsets = (lo // inner, lo % inner)
                psizes = (1, hi - lo)
                new_cols = (tuple(0 for _ in col), col)
            coeff = tuple(r[:dim] + (new_cols[0][k], new_cols[1][k]) + r[dim + 1:]
                          for k, r in enumerate(piece.coeff))
            blocks.append(piece._replace(
                offsets=piece.offsets[:dim] + offsets + piece.offsets[dim + 1:],
                sizes=piece.sizes[:dim] + psizes + piece.sizes[dim + 1:], coeff=coeff))
    shape = t.shape[:dim] + sizes + t.shape[dim + 1:]
    return Sym(shape, t.dtype, tuple(blocks))
