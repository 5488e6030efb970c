"""A rank's LoadPlan + its local tensors -> the tensors filled from the checkpoint files: each item's
byte runs straight into tensor memory where they are its region as it is, else placed through a view."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from math import prod
from operator import mul
from queue import SimpleQueue
from typing import NamedTuple

import torch

from ..checkpoint import CheckpointReader, Inventory
from ..checkpoint import reader as files
from ..indexmap import Runs, is_row_major, row_major_strides
from ..sharding.plans import DecodeItem, LoadPlan, ReadItem
from .pieces import apply_steps, mapped_values, outside, read_part, region, torch_dtype
from .staging import STAGING, Rings, StagingRing, run_pieces, tensor_pieces


def run_load_plan(plan: LoadPlan, inventory: Inventory, tensors: Mapping[str, torch.Tensor],
                  threads: int = 2, reader: CheckpointReader | None = None, rings: Rings | None = None) -> None:
    """Execute one rank's plan into its local tensors on `threads` threads (`rings`: kept over plans)."""
    own = rings is None
    rings = Rings(STAGING) if own else rings
    with reader or CheckpointReader(inventory) as reader, torch.no_grad():
        units = itertools.chain(_work(plan.items, tensors, rings.staging.everything),
                                (_Decode(item, region(tensors[item.runtime_key], item)) for item in plan.decodes))
        try:
            _run_units(units, reader, threads, rings)
        finally:
            rings.release()  # this thread's ring, where it staged (threads <= 1)
            if own:
                rings.close()


def _run_units(units: Iterator, reader: CheckpointReader, threads: int, rings: Rings) -> None:
    """Run the units: large and staged ones on `threads` threads, small ones here; then the first error."""
    queue: SimpleQueue = SimpleQueue()
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            while (unit := queue.get()) is not None:
                if not errors:  # after an error the rest is only taken off the queue
                    try:
                        _run_batch(unit, reader, rings)
                    except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
                        errors.append(exc)
        finally:
            rings.release()

    with ThreadPoolExecutor(max(1, threads)) as pool:
        running: list = []
        try:
            for unit in units:
                if errors:
                    break
                if threads <= 1 or _small(unit, rings):
                    _run_batch(unit, reader, rings)
                    continue
                if not running:
                    running = [pool.submit(drain) for _ in range(threads)]
                queue.put(unit)
        finally:
            for _ in running:
                queue.put(None)
            for f in running:
                f.result()
    if errors:
        raise errors[0]


def _small(unit, rings: Rings) -> bool:
    """Whether a unit runs on the calling thread: unstaged, under SMALL_UNIT bytes (decodes: 4 a value)."""
    if isinstance(unit, _Scatter):
        return sum(n for _, n in unit.places) < SMALL_UNIT
    if isinstance(unit, _Direct):
        return unit.runs.total < SMALL_UNIT
    return 4 * prod(unit.item.sizes) < SMALL_UNIT and not rings.staged(unit[1])  # its tensor, or view


class _Memory(NamedTuple):
    """A runtime tensor as the work list needs it, read once (`address`: None unless contiguous, unstaged, CPU)."""

    address: int | None
    dtype: str
    shape: tuple[int, ...]
    steps: tuple[int, ...]
    itemsize: int
    nbytes: int


def _memory(tensor: torch.Tensor, staged: bool) -> _Memory:
    direct = tensor.is_cpu and tensor.is_contiguous() and not staged
    shape, itemsize = tuple(tensor.shape), tensor.element_size()
    steps = tuple(itemsize * n for n in row_major_strides(shape))
    name = str(tensor.dtype).removeprefix("torch.")
    return _Memory(tensor.data_ptr() if direct else None, name, shape, steps, itemsize,
                   steps[0] * shape[0] if shape else itemsize)


def _address(memory: _Memory, item: ReadItem) -> int | None:
    """Where an item's region starts in tensor memory, if its runs fill one range in order; E417 outside."""
    if memory.address is None or item.ckpt_key is None or item.steps or memory.dtype != item.dtype:
        return None
    sizes, offsets, total = item.sizes, item.local_offsets, item.runs.total
    if sizes == memory.shape:  # the whole tensor
        if not is_row_major(item.strides, sizes):
            return None
        if total != memory.nbytes or any(offsets):
            raise _outside(memory, item, total, 0)
        return memory.address
    outer = True  # a part of the tensor: contiguous if size 1 on the leading dims, then one partial
    for n, extent in zip(sizes, memory.shape):  # dim, then whole dims
        if not outer and n != extent:
            return None
        if n != 1:
            outer = False
    if not is_row_major(item.strides, sizes):
        return None
    start = sum(map(mul, offsets, memory.steps))
    if start < 0 or start + total > memory.nbytes or total != prod(sizes) * memory.itemsize \
            or len(offsets) != len(memory.shape):
        raise _outside(memory, item, total, start)
    return memory.address + start


def _outside(memory: _Memory, item: ReadItem, total: int, start: int):
    return outside(item, f"a tensor of shape {list(memory.shape)} ({memory.nbytes} bytes) as {total} bytes at "
                   f"byte {start}")


CHUNK = 32 << 20  # direct reads are cut to about this size, so both threads stay busy to the end
SMALL_UNIT = 256 << 10  # units this small on average are Python-bound: a second thread only contends for the GIL


class _Direct(NamedTuple):
    """Byte runs of a file read straight into consecutive runtime tensor memory."""

    file: str
    runs: Runs
    address: int


class _Scatter(NamedTuple):
    """One range of a file read with one call into several places of runtime tensor memory."""

    file: str
    first: int
    places: tuple[tuple[int, int], ...]  # (address, bytes), in file order


class _Item(NamedTuple):
    """An item read through staging or the mapped file (or a pad fill), with its runtime tensor."""

    item: ReadItem
    tensor: torch.Tensor


def _work(items, tensors, staged: bool) -> Iterator:
    """The units of work of the plain items in file order: direct reads (merged, cut in chunks), the rest."""
    memories: dict[str, _Memory] = {}
    merged: list | None = None  # [file, first byte, bytes, places] of the open single-range read
    for item in items:
        memory = memories.get(item.runtime_key)
        if memory is None:
            memory = memories[item.runtime_key] = _memory(tensors[item.runtime_key], staged)
        address = _address(memory, item)
        if address is None:
            yield _Item(item, tensors[item.runtime_key])
            continue
        runs = item.runs
        if runs.counts and runs.count != 1:
            for chunk in runs.chunks(max(1, CHUNK // max(1, runs.length))):
                yield _Direct(item.file, chunk, address)
                address += chunk.total
            continue
        if merged is not None and merged[0] == item.file and merged[1] + merged[2] == runs.first:
            places = merged[3]
            if places and places[-1][0] + places[-1][1] == address:  # continues in memory too
                places[-1] = (places[-1][0], places[-1][1] + runs.length)
            else:
                places.append((address, runs.length))
            merged[2] += runs.length
            if merged[2] >= CHUNK or len(places) >= files.IOV_MAX:  # whole chunks go out now
                yield from _cut(merged, whole=False)
            continue
        if merged is not None:
            yield from _cut(merged)
        merged = [item.file, runs.first, runs.length, [(address, runs.length)]]
    if merged is not None:
        yield from _cut(merged)


def _cut(merged: list, whole: bool = True) -> Iterator:
    """One file range as reads of at most CHUNK bytes and IOV_MAX places (`whole=False`: full ones only)."""
    file, first, _, places = merged
    chunk: list[tuple[int, int]] = []
    size = 0
    for address, nbytes in places:
        while nbytes:
            take = min(nbytes, CHUNK - size)
            chunk.append((address, take))
            size, address, nbytes = size + take, address + take, nbytes - take
            if size == CHUNK or len(chunk) == files.IOV_MAX:
                yield _Scatter(file, first, tuple(chunk))
                first, chunk, size = first + size, [], 0
    if not whole:
        merged[1:] = [first, size, chunk]
    elif chunk:
        yield _Scatter(file, first, tuple(chunk))


class _Decode(NamedTuple):
    """A piece of a logical source and the runtime tensor region it fills."""

    item: DecodeItem
    view: torch.Tensor


def _run_decode(unit: _Decode, reader: CheckpointReader, rings: Rings) -> None:
    """Decode the parts' covering boxes, straight into the tensor where the piece is the box in its order."""
    from ..quant import get_format

    item, view = unit
    parts = [read_part(part, reader) for part in item.parts]
    dtype = torch_dtype(item.dtype)
    covers = tuple((p.offsets, p.sizes) for p in item.parts)
    staged = rings.staged(view)
    in_place = (not staged and view.dtype == dtype and not item.steps and item.offset == 0
                and tuple(item.box[1]) == tuple(item.sizes) and is_row_major(item.strides, item.sizes))
    out = view if in_place else torch.empty(item.box[1], dtype=dtype)
    get_format(item.format).decode(parts, item.box, covers, dict(item.params), out)
    if in_place:
        return
    if staged:
        ring = rings.ring()
        moved = torch.empty(out.numel() * out.element_size(), dtype=torch.uint8, device=view.device)
        ring.upload(moved, tensor_pieces(out, ring.staging.buffer_bytes))
        out = moved.view(dtype)
    view.copy_(apply_steps(out.view(-1).as_strided(item.sizes, item.strides, item.offset), item.steps))


def _run_batch(batch, reader: CheckpointReader, rings: Rings) -> None:
    if isinstance(batch, _Decode):
        return _run_decode(batch, reader, rings)
    if isinstance(batch, _Scatter):  # straight into the runtime tensor's memory, one call
        reader.scatter_into(batch.file, batch.first, [files.bytes_at(a, n) for a, n in batch.places])
        return None
    if isinstance(batch, _Direct):  # straight into the runtime tensor's memory
        reader.read_runs_into(batch.file, batch.runs, files.bytes_at(batch.address, batch.runs.total))
        return None
    item, tensor = batch
    view = region(tensor, item)
    if item.ckpt_key is None:  # a pad region: made in its dtype, then the later value steps
        view.copy_(apply_steps(torch.full(item.sizes, item.fill, dtype=torch.float64), item.steps))
        return None
    if rings.staged(tensor):
        return _run_staged(item, view, reader, rings.ring())
    values = mapped_values(reader, item) if item.runs.count > files.MANY_RUNS else None
    if values is None:  # a few runs (or an unaligned first byte): read into staging, in source order
        staging = torch.empty(item.runs.total, dtype=torch.uint8)
        reader.read_runs_into(item.file, item.runs, staging)
        values = staging.view(torch_dtype(item.dtype)).as_strided(item.sizes, item.strides)
    view.copy_(apply_steps(values, item.steps))
    return None


def _run_staged(item: ReadItem, view: torch.Tensor, reader: CheckpointReader, ring: StagingRing) -> None:
    """An item's bytes through the ring: straight into its region where contiguous and unstepped."""
    dtype = torch_dtype(item.dtype)
    whole = (not item.steps and view.dtype == dtype and view.is_contiguous()
             and is_row_major(item.strides, item.sizes))
    raw = view.reshape(-1).view(torch.uint8) if whole else \
        torch.empty(item.runs.total, dtype=torch.uint8, device=view.device)
    ring.upload(raw, run_pieces(item.file, item.runs, reader, ring.staging.buffer_bytes))
    if not whole:
        view.copy_(apply_steps(raw.view(dtype).as_strided(item.sizes, item.strides), item.steps))
