"""Compiled + what one rank holds of each tensor -> that rank's frozen LoadPlan: what to read, where.

Each held box of a runtime tensor is intersected with the runtime tensor's blocks; each piece becomes a
read item: the byte runs of its checkpoint tensor that hold exactly its source elements (in source
order: a transposed block reads whole source rows, a column shard one run per row), and the region
of the rank's local tensor it fills. So a layout-only load reads exactly the bytes the rank owns.
The plan is plain data: it prints, compares and hashes without a process group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from ..checkpoint import Inventory
from ..compile.model import Compiled
from ..dtypes import BY_NAME
from ..indexmap import Block, flat_map, intersect, row_major_strides, source_runs, volume
from .placements import LocalShard


class ReadItem(NamedTuple):
    """One piece of one block, for one rank.

    The local region [local_offsets, local_offsets + sizes) of `runtime_key` takes the elements of
    `ckpt_key` held by `runs` ((byte_offset, nbytes) pairs of `file`, concatenated), laid out by
    `strides` (element strides into that concatenation, one per runtime dim), then `steps`.
    An item without a key fills its region with `fill` (a `pad`).
    """

    runtime_key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ckpt_key: str | None
    file: str | None
    dtype: str | None  # the checkpoint tensor's element type
    runs: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]
    steps: tuple[tuple[str, str | float], ...]
    fill: float | None
    origin: int = 0  # byte offset in `file` of the piece's first element
    source_strides: tuple[int, ...] = ()  # element strides of each runtime dim in the file


class PartRead(NamedTuple):
    """The covering box of one physical part of a logical source: `runs` of `file` fill, in order,
    a row-major tensor of `sizes`, the box at `offsets` of the part's view (the format's `views`)."""

    ckpt_key: str
    file: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]
    origin: int = 0  # byte offset in `file` of the box's first element
    strides: tuple[int, ...] = ()  # element strides of the view (row-major), one per dim


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
    items: list[ReadItem] = []
    decodes: list[DecodeItem] = []
    logical = compiled.logical_by_key()
    for d in compiled.runtime_tensors:
        shard = held.get(d.runtime_key)
        if shard is None:
            continue
        for box, local_offsets in zip(shard.boxes, shard.local_offsets):
            if d.grid:
                _check_grid(d, box, rank)
            for block in d.blocks:
                piece = intersect(block, box.offsets, box.sizes)
                if piece is None:
                    continue
                local = tuple(lo + o - bo for lo, o, bo in zip(local_offsets, piece.offsets, box.offsets))
                if piece.source_key in logical:
                    decodes.append(_decode_item(d.runtime_key, local, piece, logical[piece.source_key], inventory))
                else:
                    items.append(_item(d.runtime_key, local, piece, inventory))
    items.sort(key=lambda i: (i.file or "", i.runs[0][0] if i.runs else -1, i.runtime_key, i.local_offsets))
    decodes.sort(key=lambda i: (i.parts[0].file, i.parts[0].runs[0][0] if i.parts[0].runs else -1,
                                i.runtime_key, i.local_offsets))
    nbytes = sum(n for i in items for _, n in i.runs)
    owned = sum(volume(i.sizes) * BY_NAME[i.dtype].bits // 8 for i in items if i.ckpt_key)
    values = sum(n for i in decodes for _, n in i.parts[0].runs)
    scales = sum(n for i in decodes for p in i.parts[1:] for _, n in p.runs)
    owned += sum(_owned_values(i, logical[i.logical], inventory) for i in decodes)
    files = {i.file for i in items if i.file} | {p.file for i in decodes for p in i.parts}
    return LoadPlan(rank=rank, items=tuple(items), decodes=tuple(decodes), bytes_owned=owned,
                    bytes_read=nbytes + values + scales, scale_bytes_read=scales, files=tuple(sorted(files)))


def _decode_item(runtime_key: str, local: tuple[int, ...], piece: Block, source, inventory: Inventory
                 ) -> DecodeItem:
    """The logical box a piece reads (its bounding box: the piece itself for every layout op but a
    strided one), the covering box of each part, and where the piece sits in the decoded box."""
    from ..quant import Part, get_format

    rank = len(source.shape)
    low = list(piece.base)
    size = [1] * rank
    for k in range(rank):
        for j, n in enumerate(piece.sizes):
            c = piece.coeff[k][j]
            low[k] += min(0, c * (n - 1))
            size[k] += abs(c) * (n - 1)
    row_major = row_major_strides(size)
    strides = tuple(sum(piece.coeff[k][j] * row_major[k] for k in range(rank)) for j in range(len(piece.sizes)))
    offset = sum((b - lo) * t for b, lo, t in zip(piece.base, low, row_major))
    fmt = get_format(source.format)
    params = source.param_dict()
    infos = [inventory.tensors[k] for k in source.parts]
    parts = [Part(k, info.dtype, tuple(info.shape)) for k, info in zip(source.parts, infos)]
    box = (tuple(low), tuple(size))
    reads = []
    for info, view, (offsets, sizes) in zip(infos, fmt.views(parts, params), fmt.cover(box, parts, params)):
        itemsize = BY_NAME[info.dtype].bits // 8
        view_major = row_major_strides(view)
        start = sum(o * t for o, t in zip(offsets, view_major))
        runs, _ = source_runs(start, list(view_major), tuple(sizes))
        reads.append(PartRead(info.ckpt_key, info.file, info.dtype, tuple(offsets), tuple(sizes),
                              tuple((info.byte_offset + first * itemsize, length * itemsize)
                                    for first, length in runs),
                              info.byte_offset + start * itemsize, tuple(view_major)))
    return DecodeItem(runtime_key, local, piece.sizes, source.logical_key, source.format, source.params, box,
                      tuple(reads), strides, offset, source.dtype, piece.steps)


def _check_grid(d, box, rank: int) -> None:
    """A shard of stored quantized values must hold whole blocks: its edges on the grid."""
    from ..errors import Diagnostic, RemapError

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


def _item(runtime_key: str, local: tuple[int, ...], piece: Block, inventory: Inventory) -> ReadItem:
    if piece.source_key is None:
        return ReadItem(runtime_key, local, piece.sizes, None, None, None, (), (), piece.steps, piece.fill)
    info = inventory.tensors[piece.source_key]
    itemsize = BY_NAME[info.dtype].bits // 8
    start, flat = flat_map(piece, tuple(info.shape))
    runs, strides = source_runs(start, flat, piece.sizes)
    return ReadItem(runtime_key, local, piece.sizes, piece.source_key, info.file, info.dtype,
                    tuple((info.byte_offset + first * itemsize, length * itemsize) for first, length in runs),
                    strides, piece.steps, None, info.byte_offset + start * itemsize, tuple(flat))


class WriteItem(NamedTuple):
    """One piece of a runtime tensor written back: the local region [local_offsets, local_offsets +
    sizes) of `runtime_key`, through `steps` (the load's value steps undone) into `dtype`, laid out
    by `strides` (element strides into the concatenation of `runs`) over the byte `runs` of `file`
    where checkpoint tensor `ckpt_key` keeps those elements."""

    runtime_key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ckpt_key: str
    file: str
    dtype: str
    runs: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]
    steps: tuple[tuple[str, str | float], ...]


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
    from ..errors import Diagnostic, RemapError

    items: list[WriteItem] = []
    encodes: list[DecodeItem] = []
    logical = logical or {}
    for w in writers:
        shard = owned.get(w.runtime_key)
        if shard is None:
            continue
        for box, local_offsets in zip(shard.boxes, shard.local_offsets):
            piece = intersect(w.block, box.offsets, box.sizes)
            if piece is None:
                continue
            local = tuple(lo + o - bo for lo, o, bo in zip(local_offsets, piece.offsets, box.offsets))
            piece = piece._replace(steps=w.steps)
            if piece.source_key not in logical:
                read = _item(w.runtime_key, local, piece, inventory)
                items.append(WriteItem(*read[:7], read.strides, read.steps))
                continue
            item = _decode_item(w.runtime_key, local, piece, logical[piece.source_key], inventory)
            if item.offset or volume(item.box[1]) != volume(item.sizes):
                raise RemapError(Diagnostic(code="E503", message=f"`{w.runtime_key}` holds a strided part of "
                                            f"`{piece.source_key}`: it cannot be written back in its format"))
            encodes.append(item)
    items.sort(key=lambda i: (i.file, i.runs[0][0] if i.runs else -1))
    written = sum(n for i in items for _, n in i.runs) + sum(n for i in encodes for _, n in i.parts[0].runs)
    if requantize:
        written += sum(n for i in encodes for p in i.parts[1:] for _, n in p.runs)
    return WritePlan(rank=rank, items=tuple(items), encodes=tuple(encodes), requantize=requantize,
                     bytes_written=written,
                     files=tuple(sorted({i.file for i in items} | {i.parts[0].file for i in encodes})))
