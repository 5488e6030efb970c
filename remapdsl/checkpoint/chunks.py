"""Tensors split over files by DCP's `HuggingFaceStorageWriter(save_distributed=True)` (each piece's
`saved_offsets` in `__metadata__["DCP_SHARDING_INFO"]`) -> one tensor of chunks that tile it (E350-E354)."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Mapping
from functools import cached_property
from itertools import product
from math import prod
from typing import NamedTuple

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema

from remapdsl.checkpoint.header import Header, TensorInfo, tensor_nbytes
from remapdsl.dtypes import BY_NAME
from remapdsl.errors import Diagnostic
from remapdsl.records import record_schema

SHARDING_INFO = "DCP_SHARDING_INFO"  # the `__metadata__` entry torch's writer puts in each file
SAVED_OFFSETS = "saved_offsets"
MOST_CELLS = 1 << 20  # a grid of more cells than this and 4x the chunks is not made: chunks are scanned


class Chunk(NamedTuple):
    """One stored piece of a chunked tensor: the box [offsets, offsets + sizes), row-major in `file`."""

    file: str
    byte_offset: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.sizes))

    def nbytes(self, dtype: str) -> int:
        """The bytes this piece holds of a tensor of `dtype` (a `remapdsl.dtypes` name)."""
        return prod(self.sizes) * BY_NAME[dtype].bits // 8

    @classmethod
    def __get_pydantic_core_schema__(cls, source: type, handler: GetCoreSchemaHandler) -> CoreSchema:
        return record_schema(cls, source, handler)  # an Inventory checks its chunks against its files


class Grid(NamedTuple):
    """A chunked tensor's chunk edges per dim (sorted, both ends included) and each grid cell's chunk."""

    lines: tuple[tuple[int, ...], ...]
    cells: dict[tuple[int, ...], Chunk]


class ChunkTable(tuple):
    """A chunked tensor's chunks sorted by offsets (an `Inventory.chunks` entry), with their grid."""

    @cached_property
    def grid(self) -> Grid | None:
        """The grid of the chunks, or None where it would have far more cells than chunks, or no dims."""
        if not self or not self[0].offsets:
            return None
        lines = tuple(tuple(sorted({c.offsets[k] for c in self} | {c.offsets[k] + c.sizes[k] for c in self}))
                      for k in range(len(self[0].offsets)))
        if prod(len(edges) - 1 for edges in lines) > max(len(self), min(MOST_CELLS, 4 * len(self))):
            return None
        cells: dict[tuple[int, ...], Chunk] = {}
        for c in self:
            spans = [range(bisect_left(edges, o), bisect_left(edges, o + n))
                     for edges, o, n in zip(lines, c.offsets, c.sizes)]
            cells.update(dict.fromkeys(product(*spans), c))
        return Grid(lines, cells)

    def __reduce__(self):
        return ChunkTable, (tuple(self),)  # pickled without its grid


def has_sharding_info(headers: Mapping[str, Header]) -> bool:
    """Whether any of the files was written by DCP's distributed safetensors writer."""
    return any(SHARDING_INFO in h.info.metadata for h in headers.values())


class Assembled(NamedTuple):
    """Headers made into tensors (a chunked key's TensorInfo names its first chunk), chunks and problems."""

    tensors: dict[str, TensorInfo]
    chunks: dict[str, tuple[Chunk, ...]]
    diagnostics: list[Diagnostic]


def assemble_chunked(headers: Mapping[str, Header], path_of) -> Assembled:
    """The tensors of headers some of which carry DCP_SHARDING_INFO, and every problem found."""
    diags: list[Diagnostic] = []
    reported: set[str] = set()
    pieces: dict[str, list[tuple[TensorInfo, tuple[int, ...]]]] = {}
    plain: dict[str, list[TensorInfo]] = {}
    for name, header in headers.items():
        info = _sharding_info(name, header, path_of(name), diags)
        if info is False:
            reported.update(header.tensors)
            continue
        if info is None:
            for key, t in header.tensors.items():
                plain.setdefault(key, []).append(t)
            continue
        for key, t in header.tensors.items():
            entry = info.get(key)
            offsets = entry.get(SAVED_OFFSETS) if type(entry) is dict else None
            if type(offsets) is list and len(offsets) == len(t.shape) and all(type(o) is int and o >= 0
                                                                              for o in offsets):
                pieces.setdefault(key, []).append((t, tuple(offsets)))
            else:
                given = "no entry" if entry is None else json.dumps(entry)[:80]
                diags.append(_diag("E354", f"{t.file}: `{SHARDING_INFO}` for tensor `{key}` {list(t.shape)} must be "
                                   f"{{\"{SAVED_OFFSETS}\": [{len(t.shape)} non-negative ints]}}, found {given}",
                                   path_of(name), "the file was not written whole by torch.distributed.checkpoint's "
                                   "HuggingFaceStorageWriter; write the checkpoint again"))
                reported.add(key)
    tensors: dict[str, TensorInfo] = {}
    chunks: dict[str, tuple[Chunk, ...]] = {}
    for key, found in plain.items():
        if key not in pieces and len(found) == 1:
            tensors[key] = found[0]
    for key, found in pieces.items():
        if key in plain or key in reported:
            continue
        if len(found) == 1 and not any(found[0][1]):
            tensors[key] = found[0][0]  # held whole by one file: an ordinary tensor
            continue
        made = _chunked(key, found, path_of, diags)
        if made is None:
            reported.add(key)
        else:
            tensors[key] = made[0]
            if made[1]:
                chunks[key] = made[1]
    for key in sorted({*plain, *pieces} - tensors.keys() - reported):
        names = [n for n, h in headers.items() if key in h.tensors]
        diags.append(_diag("E324", f"tensor `{key}` is in {len(names)} files: {', '.join(names)}, "
                           "not all of them DCP-sharded", path_of(names[-1])))
    return Assembled(tensors, chunks, diags)


def _sharding_info(name: str, header: Header, path: str, diags: list[Diagnostic]) -> dict | None | bool:
    """A file's DCP_SHARDING_INFO (key -> entry), None where it has none, False where malformed (E354)."""
    text = header.info.metadata.get(SHARDING_INFO)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except ValueError as exc:
        info, why = None, f"is not JSON ({exc})"
    else:
        why = "is not a JSON object of tensor key to {\"saved_offsets\": [...]}"
    if not isinstance(info, dict):
        diags.append(_diag("E354", f"{name}: `__metadata__[\"{SHARDING_INFO}\"]` {why}", path))
        return False
    stray = sorted(set(info) - set(header.tensors))
    if stray:
        diags.append(_diag("E354", f"{name}: `{SHARDING_INFO}` names tensor `{stray[0]}`"
                           f"{f' and {len(stray) - 1} more' if len(stray) > 1 else ''}, which the file does not hold",
                           path))
    return info


def _chunked(key: str, found: list, path_of, diags: list[Diagnostic]) -> tuple[TensorInfo, tuple[Chunk, ...]] | None:
    """One tensor from its pieces: same dtype and rank, boxes that tile the box where they end."""
    first = found[0][0]
    dtype, rank = first.dtype, len(first.shape)
    if any(t.dtype != dtype for t, _ in found):
        shown = ", ".join(f"{t.file}: {t.dtype}" for t, _ in found[:6])
        diags.append(_diag("E353", f"tensor `{key}`: its chunks disagree on the dtype ({shown})",
                           path_of(first.file), "every rank must save the tensor in one dtype"))
        return None
    if any(len(t.shape) != rank for t, _ in found):
        shown = ", ".join(f"{t.file}: {list(t.shape)}" for t, _ in found[:6])
        diags.append(_diag("E352", f"tensor `{key}`: its chunks have different numbers of dims ({shown})",
                           path_of(first.file)))
        return None
    shape = tuple(max(offsets[k] + t.shape[k] for t, offsets in found) for k in range(rank))  # where they end
    chunks = sorted((Chunk(t.file, t.byte_offset, offsets, tuple(t.shape)) for t, offsets in found
                     if prod(t.shape)), key=lambda c: (c.offsets, c.file))
    covered = sum(prod(c.sizes) for c in chunks)
    overlap = _first_overlap(chunks)
    if overlap is not None:
        a, b = overlap
        diags.append(_diag("E351", f"tensor `{key}`: chunks overlap: {_box(a)} in {a.file} and {_box(b)} in {b.file}",
                           path_of(b.file), "each element of a tensor must be saved by exactly one rank"))
        return None
    total = prod(shape)
    if covered != total:
        files = sorted({t.file for t, _ in found})
        diags.append(_diag("E350", f"tensor `{key}` {list(shape)}: its chunks in {', '.join(files[:6])}"
                           f"{' …' if len(files) > 6 else ''} cover {covered} of its {total} elements: a gap"
                           f"{_gap(chunks, shape)}", path_of(first.file),
                           "a rank's shard file is missing, or it was written by another save"))
        return None
    nbytes = tensor_nbytes(BY_NAME[first.dtype], shape)
    if not chunks:  # no elements: a tensor of the first file, nothing to read
        return TensorInfo(key, first.file, dtype, shape, first.byte_offset, nbytes), ()
    head = chunks[0]
    return TensorInfo(key, head.file, dtype, shape, head.byte_offset, nbytes), tuple(chunks)


def _first_overlap(chunks: list[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two chunks sharing an element, or None: a sweep along the dim where most chunks start."""
    if not chunks or not chunks[0].sizes:
        return (chunks[0], chunks[1]) if len(chunks) > 1 else None
    dim = max(range(len(chunks[0].sizes)), key=lambda k: len({c.offsets[k] for c in chunks}))
    open_: list[Chunk] = []
    for c in sorted(chunks, key=lambda c: c.offsets[dim]):
        open_ = [o for o in open_ if o.offsets[dim] + o.sizes[dim] > c.offsets[dim]]
        for o in open_:
            if all(a < f and b < e for a, e, b, f in zip(o.offsets, o.end, c.offsets, c.end)):
                return o, c
        open_.append(c)
    return None


def _gap(chunks: list[Chunk], shape: tuple[int, ...]) -> str:
    """Where the first element no chunk holds is: its dim-0 index where no chunk meets that slab, else it."""
    found = _first_uncovered([(c.offsets, c.end) for c in chunks], shape, 0)
    if found is None:
        return ""
    if not any(c.offsets[0] <= found[0] < c.end[0] for c in chunks):
        return f" (no chunk holds dim-0 index {found[0]})"
    return f" (no chunk holds element {list(found)})"


def _first_uncovered(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...],
                     dim: int) -> tuple[int, ...] | None:
    """The first index, from `dim` on, that none of `boxes` (start, end) holds (only edges need trying)."""
    if dim == len(shape):
        return None if boxes else ()
    for x in sorted({0, *(b[0][dim] for b in boxes), *(b[1][dim] for b in boxes)}):
        if x >= shape[dim]:
            break
        rest = _first_uncovered([b for b in boxes if b[0][dim] <= x < b[1][dim]], shape, dim + 1)
        if rest is not None:
            return (x, *rest)
    return None


def _box(c: Chunk) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(c.offsets, c.sizes)) + "]"


def _diag(code: str, message: str, path: str | None, hint: str | None = None) -> Diagnostic:
    return Diagnostic(code=code, message=message, path=path, hint=hint)

