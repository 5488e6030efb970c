"""A rank's LoadPlan + its local tensors -> the tensors filled from the checkpoint files.

Each read item reads exactly its byte runs: straight into the runtime tensor's memory when they are
one contiguous run into a contiguous region with no value step, else into one staging buffer that
is copied through a strided view with its value steps. A piece of a logical tensor reads each part's
covering box and decodes it. Reads run on two threads. The executor only runs the plan it is given.
"""

from __future__ import annotations

import ctypes
import itertools
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from ..checkpoint import CheckpointReader, Inventory
from ..sharding.plans import DecodeItem, LoadPlan, ReadItem
from . import pieces
from ..indexmap import is_row_major
from .pieces import apply_steps, read_part, region, torch_dtype


def run_load_plan(plan: LoadPlan, inventory: Inventory, tensors: Mapping[str, torch.Tensor],
             threads: int = 2) -> None:
    """Execute one rank's plan into its local tensors. Items that continue each other both in the
    file and in runtime tensor memory (a layer's gate and up slabs, consecutive experts) are read with
    one call; reads run on `threads` threads (positioned reads release the GIL), each into its own
    region, so no two threads write one byte."""
    with CheckpointReader(inventory) as reader, torch.no_grad():
        work = _split(_batches(plan.items, tensors))
        work += [_Decode(item, region(tensors[item.runtime_key], item)) for item in plan.decodes]
        in_flight: list = [None] * len(work)
        if threads <= 1 or len(work) < 2:
            _drain(work, itertools.count(), reader, in_flight)
        else:  # each thread takes the next unit in file order; no future per unit
            taken = itertools.count()
            with ThreadPoolExecutor(threads) as pool:
                for f in [pool.submit(_drain, work, taken, reader, in_flight) for _ in range(threads)]:
                    f.result()
        if any(buffer is not None for buffer in in_flight):
            torch.cuda.synchronize()  # the asynchronous copies from pinned staging are done


def _drain(work: list, taken: Iterator[int], reader: CheckpointReader, in_flight: list) -> None:
    """Run units of work until none is left; `taken` hands out each index once (atomic in CPython)."""
    while (i := next(taken)) < len(work):
        in_flight[i] = _run_batch(work[i], reader)


def _batches(items, tensors) -> list[list[tuple[ReadItem, torch.Tensor, bool]]]:
    """Items with their runtime tensor views, merged where file bytes and memory are contiguous."""
    out: list[list[tuple[ReadItem, torch.Tensor, bool]]] = []
    end_of = None  # (file, next byte offset, next data pointer) of the last direct batch
    for item in items:
        tensor = tensors[item.runtime_key]
        view = tensor[tuple(slice(o, o + s) for o, s in zip(item.local_offsets, item.sizes))]
        direct = (item.ckpt_key is not None and len(item.runs) == 1 and not item.steps
                  and view.dtype == torch_dtype(item.dtype) and view.is_contiguous()
                  and view.device.type == "cpu" and is_row_major(item.strides, item.sizes))
        if direct and end_of == (item.file, item.runs[0][0], view.data_ptr()):
            out[-1].append((item, view, True))
        else:
            out.append([(item, view, direct)])
        end_of = ((item.file, item.runs[0][0] + item.runs[0][1], view.data_ptr() + item.runs[0][1])
                  if direct else None)
    return out


CHUNK = 32 << 20  # direct reads are cut to this size, so both threads stay busy to the end


class _Direct(NamedTuple):
    """A byte range of a file read straight into consecutive runtime tensor memory."""

    file: str
    byte_offset: int
    address: int
    nbytes: int


def _split(batches) -> list:
    """Direct batches as chunked byte ranges; other items as they are."""
    work: list = []
    for batch in batches:
        first, view, direct = batch[0]
        if not direct:
            work.append(batch)
            continue
        nbytes = sum(item.runs[0][1] for item, _, _ in batch)
        for at in range(0, nbytes, CHUNK):
            work.append(_Direct(first.file, first.runs[0][0] + at, view.data_ptr() + at,
                                min(CHUNK, nbytes - at)))
    return work


class _Decode(NamedTuple):
    """A piece of a logical source and the runtime tensor region it fills."""

    item: DecodeItem
    view: torch.Tensor


def _run_decode(unit: _Decode, reader: CheckpointReader) -> torch.Tensor | None:
    """Read each part's covering box, decode the logical box, place the piece: straight into the
    runtime tensor when the piece is the box in its own order, else through the decoded box."""
    from ..quant import get_format

    item, view = unit
    parts = [read_part(part, reader) for part in item.parts]
    dtype = torch_dtype(item.dtype)
    covers = tuple((p.offsets, p.sizes) for p in item.parts)
    in_place = (view.device.type == "cpu" and view.dtype == dtype and not item.steps and item.offset == 0
                and tuple(item.box[1]) == tuple(item.sizes) and is_row_major(item.strides, item.sizes))
    out = view if in_place else torch.empty(item.box[1], dtype=dtype)
    get_format(item.format).decode(parts, item.box, covers, dict(item.params), out)
    if in_place:
        return None
    view.copy_(apply_steps(out.view(-1).as_strided(item.sizes, item.strides, item.offset), item.steps))
    return None


def _run_batch(batch, reader: CheckpointReader) -> torch.Tensor | None:
    """Run one unit of work; for a device runtime tensor, return the pinned buffer still being copied."""
    if isinstance(batch, _Decode):
        return _run_decode(batch, reader)
    if isinstance(batch, _Direct):  # straight into the runtime tensor's memory
        memory = (ctypes.c_ubyte * batch.nbytes).from_address(batch.address)
        reader.read_into(batch.file, batch.byte_offset, memoryview(memory).cast("B"))
        return None
    item, view, direct = batch[0]
    if item.ckpt_key is None:  # a pad region: made in its dtype, then the later value steps
        view.copy_(apply_steps(torch.full(item.sizes, item.fill, dtype=torch.float64), item.steps))
        return None
    device = view.device.type != "cpu"  # a CUDA runtime tensor: pinned staging, asynchronous copy
    dtype = torch_dtype(item.dtype)
    if len(item.runs) > pieces.MANY_RUNS and not device and item.origin % dtype.itemsize == 0:
        # many short runs (a column shard: one a row): copy them from the mapped file in one strided
        # pass instead of a read call each; the same bytes are touched, nothing more
        span = 1 + sum((n - 1) * t for n, t in zip(item.sizes, item.source_strides))
        with warnings.catch_warnings():  # the map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(reader.mapped(item.file), dtype=dtype, offset=item.origin, count=span)
        view.copy_(apply_steps(flat.as_strided(item.sizes, item.source_strides), item.steps))
        return None
    staging = torch.empty(sum(n for _, n in item.runs), dtype=torch.uint8, pin_memory=device)
    at = 0
    for byte_offset, nbytes in item.runs:
        reader.read_into(item.file, byte_offset, staging[at:at + nbytes])
        at += nbytes
    values = apply_steps(staging.view(dtype).as_strided(item.sizes, item.strides), item.steps)
    if not device:
        view.copy_(values)
        return None
    if not values.is_contiguous() or values.data_ptr() != staging.data_ptr():
        values = values.contiguous().pin_memory()
    view.copy_(values, non_blocking=True)
    return values
