"""A piece of a block over a chunked checkpoint tensor (DCP-sharded) -> one piece per chunk it touches, cut
where the source crosses chunk edges: the cuts grow with the chunks a piece touches, never with its rows."""

from __future__ import annotations

from bisect import bisect_right
from itertools import pairwise

from ..checkpoint.chunks import Chunk, ChunkTable
from ..errors import Diagnostic, RemapError
from ..indexmap import Block, cut


def split_by_chunks(piece: Block, chunks: tuple[Chunk, ...]) -> list[tuple[Block, Chunk]]:
    """The parts of `piece` (over `chunks`, sorted by offsets) each inside one chunk and re-based into it,
    in the piece's order. An inventory's `ChunkTable` keeps its grid; a plain tuple gets one per call."""
    grid = (chunks if isinstance(chunks, ChunkTable) else ChunkTable(chunks)).grid
    out: list[tuple[Block, Chunk]] = []
    stack = [piece]
    while stack:
        p = stack.pop()
        lo, hi = _source_range(p)
        if grid is not None:
            crossing = next(((k, list(edges[bisect_right(edges, lo[k]):bisect_right(edges, hi[k])]))
                             for k, edges in enumerate(grid.lines) if bisect_right(edges, lo[k]) != bisect_right(edges, hi[k])),
                            None)
            if crossing is None:
                chunk = grid.cells.get(tuple(bisect_right(edges, x) - 1 for edges, x in zip(grid.lines, lo)))
                meeting = [chunk] if chunk is not None else []
        else:
            meeting = [c for c in chunks if all(o <= h and l < o + n for o, n, l, h in zip(c.offsets, c.sizes, lo, hi))]
            crossing = next(((k, bounds) for k in range(len(lo)) if (bounds := sorted(
                {b for c in meeting for b in (c.offsets[k], c.offsets[k] + c.sizes[k]) if lo[k] < b <= hi[k]}))), None)
        if crossing is None:
            if len(meeting) != 1:
                raise RemapError(Diagnostic(
                    code="E355", message=f"`{p.source_key}`: elements {list(lo)}..{list(hi)} lie in "
                    f"{len(meeting)} chunks, not one (the chunks do not tile the tensor)"))
            c = meeting[0]
            out.append((p._replace(base=tuple(b - o for b, o in zip(p.base, c.offsets))), c))
            continue
        stack.extend(reversed(_cut_at(p, *crossing)))
    return out


def _source_range(p: Block) -> tuple[list[int], list[int]]:
    """The lowest and highest source index, per source dim, the piece reads."""
    lo = [b + sum(c * (n - 1) for c, n in zip(row, p.sizes) if c < 0) for b, row in zip(p.base, p.coeff)]
    hi = [b + sum(c * (n - 1) for c, n in zip(row, p.sizes) if c > 0) for b, row in zip(p.base, p.coeff)]
    return lo, hi


def _cut_at(p: Block, k: int, bounds: list[int]) -> list[Block]:
    """`p` cut along the runtime dim moving source dim `k` most (largest step) where the source index
    crosses one of `bounds`: rows straddling a bound (other dims moving `k` too) apart from the rest."""
    movers = [j for j, (c, n) in enumerate(zip(p.coeff[k], p.sizes)) if c and n > 1]
    j = max(movers, key=lambda m: abs(p.coeff[k][m]))
    c, n, start = p.coeff[k][j], p.sizes[j], p.offsets[j]
    rest = sum(abs(p.coeff[k][m]) * (p.sizes[m] - 1) for m in movers if m != j)
    low = p.base[k] + sum(p.coeff[k][m] * (p.sizes[m] - 1) for m in movers if m != j and p.coeff[k][m] < 0)
    points: set[int] = set()
    if c > 0:  # row t holds source indices [low + c t, low + c t + rest]
        for b in bounds:
            points.add(-(-(b - rest - low) // c))  # the first row reaching b
            points.add(-(-(b - low) // c))  # the first row wholly at or past b
    else:  # row t holds [low + c t, low + c t + rest], moving down
        for b in bounds:
            points.add((low - b) // -c + 1)  # the first row reaching below b
            points.add((low + rest - b) // -c + 1)  # the first row wholly below b
    inner = sorted(t for t in points if 0 < t < n)
    if not inner:  # every row straddles a bound: one row at a time
        inner = list(range(1, n))
    edges = [0, *inner, n]
    return [q for a, b in pairwise(edges) if (q := cut(p, j, start + a, start + b)) is not None]
