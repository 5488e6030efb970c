"""Compiled + what one rank holds of each tensor -> that rank's frozen LoadPlan (what to read, where) or
WritePlan (where its bytes go back).

Each held box of a runtime tensor is intersected with its blocks; each piece becomes an item: the byte runs
of its checkpoint tensor that hold exactly its source elements (one strided `indexmap.Runs`, never listed:
a plan grows with its items, not their rows), and the region of the rank's local tensor. So a layout-only
load reads exactly the bytes the rank owns. Plans are plain data: they print, compare and hash anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import lru_cache
from math import prod
from operator import add, attrgetter, mul
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from ..checkpoint import Inventory
from ..compile.model import FEW_BLOCKS, Compiled
from ..dtypes import BY_NAME
from ..errors import Diagnostic, RemapError
from ..gcpause import paused_gc
from ..indexmap import Block, FirstDimIndex, Runs, block_runs, byte_runs, intersect, row_major_strides, volume
from ..quant import Part, get_format
from .chunked import split_by_chunks
from .placements import LocalShard


class ReadItem(NamedTuple):
    """One piece of one block, for one rank.

    The local region [local_offsets, local_offsets + sizes) of `runtime_key` takes the elements of `ckpt_key` held
    by the byte `runs` of `file` (concatenated), laid out by `strides` (element strides into that concatenation,
    one per runtime dim), then `steps`; `source_strides` are each runtime dim's element strides in the file from
    `runs.first`. An item without a key fills its region with `fill` (a `pad`).
    """

    runtime_key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ckpt_key: str | None
    file: str | None
    dtype: str | None  # the checkpoint tensor's element type
    runs: Runs | None
    strides: tuple[int, ...]
    steps: tuple[tuple[str, str | float], ...]
    fill: float | None
    source_strides: tuple[int, ...] = ()


class PartRead(NamedTuple):
    """The covering box of one physical part of a logical source: the byte `runs` of `file` fill,
    in order, a row-major tensor of `sizes`, the box at `offsets` of the part's view (the format's
    `views`, whose row-major element strides are `strides`)."""

    ckpt_key: str
    file: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    runs: Runs
    strides: tuple[int, ...] = ()


class DecodeItem(NamedTuple):
    """One piece of one block read from a logical source: read each part's covering box, decode
    the logical `box` with `format`, then the local region [local_offsets, local_offsets + sizes)
    of `runtime_key` takes the decoded box's elements at `offset + strides . x`, then `steps`."""

    runtime_key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    logical: str
    format: str
    params: tuple
    box: tuple[tuple[int, ...], tuple[int, ...]]
    parts: tuple[PartRead, ...]
    strides: tuple[int, ...]
    offset: int
    dtype: str  # the logical (decoded) dtype
    steps: tuple[tuple[str, str | float], ...]


class LoadPlan(BaseModel):
    """Everything one rank reads, ordered by file and offset, with what it owns."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    items: tuple[ReadItem, ...]
    decodes: tuple[DecodeItem, ...] = ()  # pieces of logical (dequantized) sources
    bytes_owned: int  # checkpoint bytes behind the elements this rank holds (packed values included)
    bytes_read: int  # bytes all runs read: bytes_owned plus the scales' covering tiles
    scale_bytes_read: int = 0  # of bytes_read, the bytes of scales (every part after the values)
    files: tuple[str, ...]

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def make_load_plan(compiled: Compiled, inventory: Inventory, held: Mapping[str, LocalShard],
                   rank: int = 0) -> LoadPlan:
    """The plan of one rank. `held` maps a runtime key to what the rank holds of it; a runtime tensor
    missing from `held` is not loaded by this rank."""
    with paused_gc():
        return _load_plan(compiled, inventory, held, rank)


def _load_plan(compiled: Compiled, inventory: Inventory, held: Mapping[str, LocalShard], rank: int) -> LoadPlan:
    items: list[ReadItem] = []
    decodes: list[DecodeItem] = []
    logical = compiled.logical_by_key()
    infos = inventory.tensors
    chunked = inventory.chunks
    nbytes = owned = 0
    layouts: dict = {}
    for d in compiled.runtime_tensors:
        shard = held.get(d.runtime_key)
        if shard is None:
            continue
        key = d.runtime_key
        if shard.zeros:  # a FirstOnly placement's other ranks: zeros, no value read
            items.append(ReadItem(key, (0,) * len(shard.shape), shard.shape, None, None, None, None, (), (), 0.0))
        for box, local_offsets in zip(shard.boxes, shard.local_offsets):
            if d.grid:
                _check_grid(d, box, rank)
            at, extent = box
            for block in d.blocks_meeting(at, extent):
                piece = intersect(block, at, extent)
                if piece is None:
                    continue
                local = piece.offsets if local_offsets == at else \
                    tuple(lo + o - bo for lo, o, bo in zip(local_offsets, piece.offsets, at))
                source = piece.source_key
                if source is None:
                    items.append(ReadItem(key, local, piece.sizes, None, None, None, None, (), piece.steps,
                                          piece.fill))
                elif source in logical:
                    decodes.append(_decode_item(key, local, piece, logical[source], inventory, layouts))
                else:  # one item, or one per chunk the piece touches
                    info = infos[source]
                    parts = _chunk_parts(piece, local, chunked[source]) if source in chunked else \
                        (((piece, None), local),)
                    for (part, chunk), local_part in parts:
                        item = _item(key, local_part, part, info, chunk)
                        nbytes += item.runs.total
                        items.append(item)
                    owned += prod(piece.sizes) * BY_NAME[info.dtype].bits // 8
    items.sort(key=_file_order)
    decodes.sort(key=lambda i: (i.parts[0].file, i.parts[0].runs.first, i.runtime_key, i.local_offsets))
    values = sum(i.parts[0].runs.total for i in decodes)
    scales = sum(p.runs.total for i in decodes for p in i.parts[1:])
    owned += sum(_owned_values(i, logical[i.logical], inventory) for i in decodes)
    files = {i.file for i in items if i.file} | {p.file for i in decodes for p in i.parts}
    return LoadPlan.model_construct(  # built here from checked parts: no validation pass over every item
        rank=rank, items=tuple(items), decodes=tuple(decodes), bytes_owned=owned,
        bytes_read=nbytes + values + scales, scale_bytes_read=scales, files=tuple(sorted(files)))


def _file_order(item: ReadItem) -> tuple:
    """Plain items in file order (fills first), then by where they go."""
    return (item.file or "", item.runs.first if item.runs else -1, item.runtime_key, item.local_offsets)


def _decode_item(runtime_key: str, local: tuple[int, ...], piece: Block, source, inventory: Inventory,
                 layouts: dict, steps: tuple | None = None) -> DecodeItem:
    """The logical box a piece reads (its bounding box: the piece itself unless strided), the covering box
    of each part, and where the piece sits in the decoded box, then `steps` (the piece's own by default).
    `layouts` caches each part's run layout by format, parameters, parts' dtypes and shapes, and box: a
    plan's thousands of experts share a few."""
    shift, size, strides, offset = _box_geometry(piece.coeff, piece.sizes)
    box = (tuple(map(add, piece.base, shift)), size)
    if inventory.chunks:
        _refuse_chunked_parts(source, inventory)
    infos = list(map(inventory.tensors.__getitem__, source.parts))
    signature = (source.format, source.params, box, *map(_DTYPE_SHAPE, infos))
    layout = layouts.get(signature)
    if layout is None:
        layout = layouts[signature] = _part_runs(source, infos, box)
    reads = tuple(PartRead(info.ckpt_key, info.file, info.dtype, offsets, sizes,
                           Runs(info.byte_offset + itemsize * sum(map(mul, offsets, major)), *runs), major)
                  for info, (offsets, sizes, itemsize, major, runs) in zip(infos, layout))
    return DecodeItem(runtime_key, local, piece.sizes, source.logical_key, source.format, source.params,
                      box, reads, strides, offset, source.dtype, piece.steps if steps is None else steps)


_DTYPE_SHAPE = attrgetter("dtype", "shape")


def _part_runs(source, infos, box) -> list[tuple]:
    """Per part of a logical source: its covering box of `box` (offsets, sizes), item size, the
    row-major strides of its view and the run layout of the box (length, counts, strides)."""
    fmt = get_format(source.format)
    params = source.param_dict()
    parts = [Part(k, info.dtype, info.shape) for k, info in zip(source.parts, infos)]
    out = []
    for info, view, (offsets, sizes) in zip(infos, fmt.views(parts, params), fmt.cover(box, parts, params)):
        itemsize = BY_NAME[info.dtype].bits // 8
        major, _, runs, _ = byte_runs(tuple(view), _identity(len(view)), tuple(sizes), itemsize)
        out.append((tuple(offsets), tuple(sizes), itemsize, major, (runs.length, runs.counts, runs.strides)))
    return out


@lru_cache(maxsize=4096)
def _box_geometry(coeff: tuple[tuple[int, ...], ...], sizes: tuple[int, ...]):
    """Where a piece of this map and size sits in its bounding box of the source: the box's low
    corner less the piece's base, the box's sizes, the piece's strides and offset in the box
    (row-major). The same for every piece of a map, whatever its base: cached."""
    shift, size = [0] * len(coeff), [1] * len(coeff)
    for k, row in enumerate(coeff):
        for c, n in zip(row, sizes):
            if c and n > 1:
                shift[k] += c * (n - 1) if c < 0 else 0
                size[k] += abs(c) * (n - 1)
    row_major = row_major_strides(size)
    strides = tuple(sum(row[j] * t for row, t in zip(coeff, row_major)) for j in range(len(sizes)))
    return tuple(shift), tuple(size), strides, -sum(d * t for d, t in zip(shift, row_major))


@lru_cache(maxsize=16)
def _identity(rank: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(k == j) for j in range(rank)) for k in range(rank))


def _check_grid(d, box, rank: int) -> None:
    """A shard of stored quantized values must hold whole blocks: its edges on the grid."""
    for dim, (g, start, size, extent) in enumerate(zip(d.grid, box.offsets, box.sizes, d.shape)):
        for edge in (start, start + size):
            if g > 1 and size and edge % g and edge != extent:
                raise RemapError(Diagnostic(
                    code="E412", span=d.rule,
                    message=f"rank {rank}'s shard of `{d.runtime_key}` ({start}:{start + size} of dim {dim}) "
                            f"cuts inside a block of {g}: the values are kept quantized, and a shard edge at "
                            f"{edge} would split one block's values from its scale",
                    hint=f"shard dim {dim} in multiples of {g} (an even split of {extent // g} blocks), "
                         "or dequantize the tensor"))


def _owned_values(item: DecodeItem, source, inventory: Inventory) -> int:
    """Bytes of packed values behind the piece's elements (a 4-bit format: half a byte each)."""
    values = inventory.tensors[source.parts[0]]
    return -(-volume(item.sizes) * values.nbytes // max(1, volume(source.shape)))


def _item(runtime_key: str, local: tuple[int, ...], piece: Block, info, chunk=None) -> ReadItem:
    """The read of a piece of checkpoint tensor `info` (a TensorInfo), or of one of its chunks (the
    piece then re-based into the chunk)."""
    shape, at, file = (info.shape, info.byte_offset, info.file) if chunk is None else \
        (chunk.sizes, chunk.byte_offset, chunk.file)
    runs, strides, flat = block_runs(piece, shape, at, BY_NAME[info.dtype].bits // 8)
    return ReadItem(runtime_key, local, piece.sizes, piece.source_key, file, info.dtype, runs, strides,
                    piece.steps, None, flat)


def _chunk_parts(piece: Block, local: tuple[int, ...], chunks) -> list[tuple[tuple[Block, object], tuple]]:
    """The parts of a piece of a chunked tensor, each with its chunk, and where each goes locally."""
    return [((part, chunk), tuple(lo + o - po for lo, o, po in zip(local, part.offsets, piece.offsets)))
            for part, chunk in split_by_chunks(piece, chunks)]


def _refuse_chunked_parts(source, inventory: Inventory) -> None:
    """A format's parts are read (and written) as boxes of one stored tensor: not from chunks."""
    chunked = [k for k in source.parts if k in inventory.chunks]
    if chunked:
        raise RemapError(Diagnostic(
            code="E356", path=inventory.root,
            message=f"`{source.logical_key}` ({source.format}) is made from `{chunked[0]}`, which is stored in "
                    f"{len(inventory.chunks[chunked[0]])} DCP chunks: quantized parts are read from whole tensors only",
            hint="consolidate the checkpoint first (`remapdsl convert CKPT OUT --rules identity`), then load that"))


class WriteItem(NamedTuple):
    """One piece of a runtime tensor written back: the local region [local_offsets, local_offsets + sizes) of
    `runtime_key`, through `steps` (the load's value steps undone) into `dtype`, laid out by `strides` (element
    strides into the concatenation of `runs`) over the byte `runs` of `file` where checkpoint tensor `ckpt_key`
    keeps those elements (`source_strides`: each runtime dim's element strides in the file from `runs.first`)."""

    runtime_key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ckpt_key: str
    file: str
    dtype: str
    runs: Runs
    strides: tuple[int, ...]
    steps: tuple[tuple[str, str | float], ...]
    source_strides: tuple[int, ...] = ()


class WritePlan(BaseModel):
    """Everything one rank writes on save: each item's runs are where its elements go in the output
    files (the checkpoint's layout), `steps` undo the load's value steps. Every byte of the output
    has exactly one writer, the lowest rank that holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    items: tuple[WriteItem, ...]
    encodes: tuple[DecodeItem, ...] = ()  # pieces of dequantized tensors (as a load decodes them), encoded back
    requantize: bool = False  # the encodes compute new scales (and write them) instead of the stored ones
    bytes_written: int
    files: tuple[str, ...]


def make_write_plan(writers, inventory: Inventory, owned: Mapping[str, LocalShard], rank: int = 0,
                    logical: Mapping | None = None, requantize: bool = False) -> WritePlan:
    """The plan of one rank: `writers` (remapdsl.compile.inverse) cut to the boxes this rank owns.
    A piece of a dequantized tensor (`logical`: key -> LogicalTensor) becomes an encode item: its
    values part's runs are where it is written, its scales' runs where the stored scales are read."""
    with paused_gc():
        return _write_plan(writers, inventory, owned, rank, logical, requantize)


def _write_plan(writers, inventory: Inventory, owned: Mapping[str, LocalShard], rank: int,
                logical: Mapping | None, requantize: bool) -> WritePlan:
    items: list[WriteItem] = []
    encodes: list[DecodeItem] = []
    logical = logical or {}
    layouts: dict = {}
    by_tensor: dict[str, list] = {}
    for w in writers:
        if w.runtime_key in owned:
            by_tensor.setdefault(w.runtime_key, []).append(w)
    for runtime_key, mine in by_tensor.items():
        shard = owned[runtime_key]
        index = FirstDimIndex(mine, [w.block for w in mine]) \
            if len(mine) > FEW_BLOCKS and mine[0].block.offsets else None
        for box, local_offsets in zip(shard.boxes, shard.local_offsets):
            for w in index.meeting(box.offsets, box.sizes) if index else mine:
                _write_piece(w, box, local_offsets, inventory, logical, items, encodes, layouts)
    items.sort(key=lambda i: (i.file, i.runs.first))
    # the parts an encode writes: its values, and its new scales when it requantizes
    encoded = [p for i in encodes for p in (i.parts if requantize else i.parts[:1])]
    written = sum(i.runs.total for i in items) + sum(p.runs.total for p in encoded)
    return WritePlan.model_construct(  # built here from checked parts: no validation pass over every item
        rank=rank, items=tuple(items), encodes=tuple(encodes), requantize=requantize, bytes_written=written,
        files=tuple(sorted({i.file for i in items} | {p.file for p in encoded})))


def _write_piece(w, box, local_offsets, inventory: Inventory, logical: Mapping, items: list, encodes: list,
                 layouts: dict) -> None:
    """The piece of writer `w` inside an owned box, as a write item or an encode item."""
    piece = intersect(w.block, box.offsets, box.sizes)
    if piece is None:
        return
    local = tuple(lo + o - bo for lo, o, bo in zip(local_offsets, piece.offsets, box.offsets))
    if piece.source_key not in logical:
        info = inventory.tensors[piece.source_key]
        chunks = inventory.chunks.get(piece.source_key)
        parts = (((piece, None), local),) if chunks is None else _chunk_parts(piece, local, chunks)
        for (part, chunk), at in parts:  # one item, or one per chunk the piece touches
            item = _item(w.runtime_key, at, part, info, chunk)
            items.append(WriteItem(w.runtime_key, at, part.sizes, piece.source_key, item.file, info.dtype,
                                   item.runs, item.strides, w.steps, item.source_strides))
        return
    item = _decode_item(w.runtime_key, local, piece, logical[piece.source_key], inventory, layouts, w.steps)
    if item.offset or volume(item.box[1]) != volume(item.sizes):
        raise RemapError(Diagnostic(
            code="E503", span=w.rule, message=f"`{w.runtime_key}` holds a strided part of `{piece.source_key}`: "
            "it cannot be written back in its format",
            hint=f"its format encodes boxes of `{piece.source_key}` only: cut it along its own dims, or "
            "declare it `quantized` to move its stored bytes as they are"))
    encodes.append(item)
