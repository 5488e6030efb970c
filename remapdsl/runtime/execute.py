"""A rank's LoadPlan + its local tensors -> the tensors filled from the checkpoint files.

Each read item reads exactly its byte runs: straight into the destination's memory when they are
one contiguous run into a contiguous region with no value step, else into one staging buffer that
is copied through a strided view with its value steps. Reads run on two threads. Nothing is read
before every destination's shape and dtype are checked against the compiled ones.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint import CheckpointReader, Inventory
from ..checkpoint.reader import as_byte_view
from ..dtypes import BY_NAME
from ..compile.model import Compiled
from ..sharding.placements import Box, LocalShard
from ..sharding.plans import DecodeItem, LoadPlan, ReadItem, WritePlan, held_by_layout, make_load_plan
from ..errors import BindError, Diagnostic


class LoadReport(BaseModel):
    """What a load did: the runtime tensors it filled, from which checkpoint tensors, bytes read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loaded: tuple[str, ...]
    ckpt_keys: tuple[str, ...]
    bytes_read: int
    seconds: float
    bytes_owned: int = 0  # checkpoint bytes behind the elements this rank holds
    scale_bytes_read: int = 0  # of bytes_read, bytes of quantization scales (covering tiles)
    rank: int = 0


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_targets(compiled: Compiled, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every destination exists in the model with the compiled shape and dtype, and every model
    tensor is produced by a rule or named by `keep`; all problems reported at once."""
    import re

    problems = []
    keep = [re.compile(p) for p in compiled.keep]
    produced = {d.runtime_key for d in compiled.runtime_tensors}
    for d in compiled.runtime_tensors:
        tensor = tensors.get(d.runtime_key)
        if tensor is None:
            problems.append(Diagnostic(code="E230", span=d.rule, message=f"the rules produce "
                            f"`{d.runtime_key}`, but the model has no such tensor",
                            hint=_near(d.runtime_key, tensors)))
        elif tuple(tensor.shape) != d.shape or tensor.dtype != torch_dtype(d.dtype):
            problems.append(Diagnostic(code="E232", span=d.rule, message=f"`{d.runtime_key}` is "
                            f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} in the "
                            f"model, but the rules make it {list(d.shape)} {d.dtype}",
                            hint="add `| cast(...)` to the rule" if tuple(tensor.shape) == d.shape
                            else None))
    for key in tensors:
        if key not in produced and not any(k.fullmatch(key) for k in keep):
            problems.append(Diagnostic(code="E231", message=f"model tensor `{key}` is produced by no "
                            "rule", hint="map it from the checkpoint, or name it in a `keep`"))
    if problems:
        raise BindError(problems)


def held_tensors(compiled: Compiled, tensors: Mapping[str, torch.Tensor], layout=None, mesh=None,
                 rank: int = 0) -> tuple[dict[str, LocalShard], dict[str, torch.Tensor], set[str]]:
    """What this rank holds of each destination, the local tensor that holds it, and the keys
    every rank holds whole (replicated on every mesh dim).

    A DTensor says it itself (its mesh and placements); a plain tensor is either whole, or, with a
    `layout` plan and a `mesh`, the local shard the plan gives this rank. Checked before any read.
    """
    from ..sharding.placements import Replicate, layout_for, placements_from_dtensor

    # no DTensor exists unless its module was imported: do not pay that import (~0.5 s) otherwise
    dtensor_type = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    check_targets(compiled, {k: _global(v, compiled, k, layout) for k, v in tensors.items()})
    held: dict[str, LocalShard] = {}
    local: dict[str, torch.Tensor] = {}
    everywhere: set[str] = set()
    problems = []
    by_layout = held_by_layout(compiled, layout, mesh, rank) if layout is not None else {}
    placed_as: dict = {}
    for d in compiled.runtime_tensors:
        tensor = tensors[d.runtime_key]
        if dtensor_type is not None and isinstance(tensor, dtensor_type):
            # tensors of one shape and placement share their boxes (a model repeats a few hundredfold)
            spec = (tensor.device_mesh, tensor.placements, d.shape)
            if spec not in placed_as:
                placed = placements_from_dtensor(tensor, d.runtime_key)
                placed_as[spec] = placed.local_shard(), placed.mesh.sizes, placed.placements
            shard, sizes, placements = placed_as[spec]
            local[d.runtime_key] = _local_tensor(tensor)
        elif layout is not None:
            shard = by_layout[d.runtime_key]
            local[d.runtime_key] = tensor
            sizes, placements = mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh)
        else:
            shard = LocalShard(d.shape, (Box((0,) * len(d.shape), d.shape),), ((0,) * len(d.shape),))
            local[d.runtime_key] = tensor
            sizes, placements = (), ()
        if all(isinstance(p, Replicate) or n == 1 for p, n in zip(placements, sizes)):
            everywhere.add(d.runtime_key)
        if tuple(local[d.runtime_key].shape) != shard.shape:
            problems.append(Diagnostic(code="E233", span=d.rule, message=f"`{d.runtime_key}` is "
                            f"{list(local[d.runtime_key].shape)} on rank {rank}, but its layout gives "
                            f"this rank {list(shard.shape)} of {list(d.shape)}"))
        held[d.runtime_key] = shard
    if problems:
        raise BindError(problems)
    return held, local, everywhere


def _local_tensor(tensor) -> torch.Tensor:
    """A DTensor's local shard: the tensor it wraps, without `to_local()`'s autograd call (~30 µs)."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor.to_local()


def _global(tensor: torch.Tensor, compiled: Compiled, key: str, layout) -> torch.Tensor:
    """A stand-in with the global shape, for the shape and dtype checks of sharded plain tensors."""
    if layout is None:
        return tensor
    try:
        shape = compiled.runtime_tensor(key).shape
    except KeyError:
        return tensor
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def run_sharded_load(compiled: Compiled, inventory: Inventory, tensors: Mapping[str, torch.Tensor],
                     layout=None, mesh=None, rank: int = 0, replicated_once: bool = False
                     ) -> tuple[LoadReport, list[torch.Tensor]]:
    """Fill this rank's shards: plan the intersection of its boxes with the blocks, then read.

    With `replicated_once`, tensors every rank holds whole are read by rank 0 alone; they are
    returned (in key order, on every rank) for the caller to broadcast from rank 0.
    """
    start = time.perf_counter()
    held, local, everywhere = held_tensors(compiled, tensors, layout, mesh, rank)
    shared = sorted(everywhere) if replicated_once else []
    if rank != 0:
        held = {k: v for k, v in held.items() if k not in shared}
    plan = make_load_plan(compiled, inventory, held, rank)
    run_plan(plan, inventory, local)
    report = LoadReport(loaded=tuple(d.runtime_key for d in compiled.runtime_tensors),
                        ckpt_keys=tuple(sorted({i.ckpt_key for i in plan.items if i.ckpt_key}
                                               | {p.ckpt_key for i in plan.decodes for p in i.parts})),
                        bytes_read=plan.bytes_read, bytes_owned=plan.bytes_owned,
                        scale_bytes_read=plan.scale_bytes_read, rank=rank,
                        seconds=time.perf_counter() - start)
    return report, [local[k] for k in shared]


MANY_RUNS = 64  # above this many byte runs, an item is copied from the mapped file


def run_plan(plan: LoadPlan, inventory: Inventory, tensors: Mapping[str, torch.Tensor],
             threads: int = 2) -> None:
    """Execute one rank's plan into its local tensors. Items that continue each other both in the
    file and in destination memory (a layer's gate and up slabs, consecutive experts) are read with
    one call; reads run on `threads` threads (positioned reads release the GIL), each into its own
    region, so no two threads write one byte."""
    with CheckpointReader(inventory) as reader, torch.no_grad():
        work = _split(_batches(plan.items, tensors))
        work += [_Decode(item, _region(tensors[item.runtime_key], item)) for item in plan.decodes]
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
    """Items with their destination views, merged where file bytes and memory are contiguous."""
    out: list[list[tuple[ReadItem, torch.Tensor, bool]]] = []
    end_of = None  # (file, next byte offset, next data pointer) of the last direct batch
    for item in items:
        tensor = tensors[item.runtime_key]
        view = tensor[tuple(slice(o, o + s) for o, s in zip(item.local_offsets, item.sizes))]
        direct = (item.ckpt_key is not None and len(item.runs) == 1 and not item.steps
                  and view.dtype == torch_dtype(item.dtype) and view.is_contiguous()
                  and view.device.type == "cpu" and _dense(item.strides, item.sizes))
        if direct and end_of == (item.file, item.runs[0][0], view.data_ptr()):
            out[-1].append((item, view, True))
        else:
            out.append([(item, view, direct)])
        end_of = ((item.file, item.runs[0][0] + item.runs[0][1], view.data_ptr() + item.runs[0][1])
                  if direct else None)
    return out


CHUNK = 32 << 20  # direct reads are cut to this size, so both threads stay busy to the end


class _Direct(NamedTuple):
    """A byte range of a file read straight into consecutive destination memory."""

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


def _region(tensor: torch.Tensor, item) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(item.local_offsets, item.sizes))]


class _Decode(NamedTuple):
    """A piece of a logical source and the destination region it fills."""

    item: DecodeItem
    view: torch.Tensor


def _run_decode(unit: _Decode, reader: CheckpointReader) -> torch.Tensor | None:
    """Read each part's covering box, decode the logical box, place the piece: straight into the
    destination when the piece is the box in its own order, else through the decoded box."""
    from ..quant import get_format

    item, view = unit
    parts = [_part(part, reader) for part in item.parts]
    dtype = torch_dtype(item.dtype)
    covers = tuple((p.offsets, p.sizes) for p in item.parts)
    in_place = (view.device.type == "cpu" and view.dtype == dtype and not item.steps and item.offset == 0
                and tuple(item.box[1]) == tuple(item.sizes) and _dense(item.strides, item.sizes))
    out = view if in_place else torch.empty(item.box[1], dtype=dtype)
    get_format(item.format).decode(parts, item.box, covers, dict(item.params), out)
    if in_place:
        return None
    view.copy_(_steps(out.view(-1).as_strided(item.sizes, item.strides, item.offset), item.steps))
    return None


def _write_encoded(item: DecodeItem, view: torch.Tensor, writer, reader: CheckpointReader,
                   requantize: bool) -> None:
    """A piece of a dequantized tensor back in its format: with the stored scales of its box, or,
    re-quantizing, with new scales that are written too."""
    from ..errors import RemapError
    from ..quant import FormatError, Part, get_format

    box = torch.empty(item.box[1], dtype=torch.float32)
    box.view(-1).as_strided(item.sizes, item.strides, item.offset).copy_(_steps(view, item.steps))
    fmt = get_format(item.format)
    try:
        if requantize:
            shapes = [Part(p.ckpt_key, p.dtype, reader.inventory.tensors[p.ckpt_key].shape) for p in item.parts]
            codes, scales = fmt.requantize(box, item.box, shapes, dict(item.params))
            written = [codes, scales]
        else:
            scales = [_part(p, reader) for p in item.parts[1:]]
            covers = tuple((p.offsets, p.sizes) for p in item.parts)
            written = [fmt.encode(box, item.box, covers, scales, dict(item.params))]
    except FormatError as exc:
        raise RemapError(Diagnostic(code="E503", message=f"`{item.runtime_key}` cannot be written back to "
                                    f"`{item.logical}`: {exc}")) from None
    for part, tensor in zip(item.parts, written):
        data, at = memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B"), 0
        for byte_offset, n in part.runs:
            writer.write_at(part.file, byte_offset, data[at:at + n])
            at += n


def _part(part, reader: CheckpointReader) -> torch.Tensor:
    """One part's covering box as a tensor of its sizes, in the part's dtype where torch has it."""
    kind = BY_NAME[part.dtype]
    dtype = torch_dtype(part.dtype) if kind.in_torch else torch.uint8
    if len(part.runs) > MANY_RUNS and part.origin % dtype.itemsize == 0 and part.strides:
        # many short runs (a column shard): one strided copy from the mapped file, the same bytes
        span = 1 + sum((n - 1) * t for n, t in zip(part.sizes, part.strides))
        with warnings.catch_warnings():  # the map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(reader.mapped(part.file), dtype=dtype, offset=part.origin, count=span)
        return flat.as_strided(part.sizes, part.strides).contiguous()
    staging = torch.empty(sum(n for _, n in part.runs), dtype=torch.uint8)
    at = 0
    for byte_offset, nbytes in part.runs:
        reader.read_into(part.file, byte_offset, staging[at:at + nbytes])
        at += nbytes
    return staging.view(dtype).view(part.sizes)


def _run_batch(batch, reader: CheckpointReader) -> torch.Tensor | None:
    """Run one unit of work; for a device destination, return the pinned buffer still being copied."""
    if isinstance(batch, _Decode):
        return _run_decode(batch, reader)
    if isinstance(batch, _Direct):  # straight into the destination's memory
        memory = (ctypes.c_ubyte * batch.nbytes).from_address(batch.address)
        reader.read_into(batch.file, batch.byte_offset, memoryview(memory).cast("B"))
        return None
    item, view, direct = batch[0]
    if item.ckpt_key is None:  # a pad region: made in its dtype, then the later value steps
        view.copy_(_steps(torch.full(item.sizes, item.fill, dtype=torch.float64), item.steps))
        return None
    device = view.device.type != "cpu"  # a CUDA destination: pinned staging, asynchronous copy
    dtype = torch_dtype(item.dtype)
    if len(item.runs) > MANY_RUNS and not device and item.origin % dtype.itemsize == 0:
        # many short runs (a column shard: one a row): copy them from the mapped file in one strided
        # pass instead of a read call each; the same bytes are touched, nothing more
        span = 1 + sum((n - 1) * t for n, t in zip(item.sizes, item.source_strides))
        with warnings.catch_warnings():  # the map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(reader.mapped(item.file), dtype=dtype, offset=item.origin, count=span)
        view.copy_(_steps(flat.as_strided(item.sizes, item.source_strides), item.steps))
        return None
    staging = torch.empty(sum(n for _, n in item.runs), dtype=torch.uint8, pin_memory=device)
    at = 0
    for byte_offset, nbytes in item.runs:
        reader.read_into(item.file, byte_offset, staging[at:at + nbytes])
        at += nbytes
    values = _steps(staging.view(dtype).as_strided(item.sizes, item.strides), item.steps)
    if not device:
        view.copy_(values)
        return None
    if not values.is_contiguous() or values.data_ptr() != staging.data_ptr():
        values = values.contiguous().pin_memory()
    view.copy_(values, non_blocking=True)
    return values


def _steps(values: torch.Tensor, steps) -> torch.Tensor:
    """Value steps: casts, and scale/add computed in float32 then cast back to the dtype."""
    for kind, value in steps:
        if kind == "cast":
            values = values.to(torch_dtype(value))
        elif kind == "scale":
            values = (values.float() * value).to(values.dtype)
        else:
            values = (values.float() + value).to(values.dtype)
    return values


def _dense(strides: list[int], sizes: tuple[int, ...]) -> bool:
    """Whether element strides describe one contiguous row-major run of the given sizes."""
    expected = 1
    for t, n in zip(reversed(strides), reversed(sizes)):
        if n != 1 and t != expected:
            return False
        expected *= n
    return True


def _near(name: str, tensors: Mapping[str, torch.Tensor]) -> str | None:
    from ..errors import suggest

    close = suggest(name, list(tensors))
    return f"did you mean `{close}`?" if close else None


# ------------------------------------------------------------------------------------------- saving


def owned_tensors(compiled: Compiled, tensors: Mapping[str, torch.Tensor], layout=None, mesh=None,
                  rank: int = 0) -> tuple[dict[str, LocalShard], dict[str, torch.Tensor]]:
    """What this rank writes of each runtime tensor on save (the boxes it holds that no lower rank
    holds: every region has one writer, decided by arithmetic alone), and its local tensors. For
    every placement two ranks' boxes are identical or disjoint (per dim, their index sets are), so
    a replicated region is written once, by its lowest holder. The boxes of the lower ranks are
    computed once per mesh, placement and shape, not per tensor."""
    from ..sharding.placements import layout_for, placements_from_dtensor

    held, local, _ = held_tensors(compiled, tensors, layout, mesh, rank)
    dtensor_type = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    owned: dict[str, LocalShard] = {}
    lower_boxes: dict = {}
    for d in compiled.runtime_tensors:
        tensor = tensors[d.runtime_key]
        if dtensor_type is not None and isinstance(tensor, dtensor_type):
            spec = (tensor.device_mesh, tensor.placements, d.shape)
            if spec not in lower_boxes:
                placed = placements_from_dtensor(tensor, d.runtime_key)
                grid = tensor.device_mesh.mesh  # the global rank at each mesh coordinate
                lower_boxes[spec] = _boxes_below(d.shape, placed.mesh.sizes, placed.placements,
                                                 lambda index, grid=grid: int(grid[index]), rank)
        elif layout is not None:
            placements = tuple(layout_for(d.runtime_key, d.shape, layout, mesh))
            spec = (placements, d.shape)
            if spec not in lower_boxes:
                lower_boxes[spec] = _boxes_below(d.shape, mesh.sizes, placements, _row_major(mesh.sizes), rank)
        else:  # a whole tensor on every rank: rank 0 writes it
            if rank == 0:
                owned[d.runtime_key] = held[d.runtime_key]
            continue
        shard = held[d.runtime_key]
        keep = [(b, at) for b, at in zip(shard.boxes, shard.local_offsets) if b not in lower_boxes[spec]]
        if keep:
            owned[d.runtime_key] = LocalShard(shard.shape, tuple(b for b, _ in keep), tuple(a for _, a in keep))
    return owned, local


def _boxes_below(shape, sizes, placements, rank_of, rank: int) -> set:
    """The boxes held by the ranks of a mesh below `rank` (`rank_of`: mesh coordinate -> rank)."""
    from ..sharding.placements import local_shard

    return {box for index in itertools.product(*(range(n) for n in sizes)) if rank_of(index) < rank
            for box in local_shard(shape, sizes, placements, index).boxes}


def _row_major(sizes):
    """A mesh coordinate -> its rank, ranks in row-major order (as `Mesh.coordinate` counts them)."""
    def rank_of(index) -> int:
        out = 0
        for i, n in zip(index, sizes):
            out = out * n + i
        return out
    return rank_of


def run_write_plan(plan: WritePlan, writer, tensors: Mapping[str, torch.Tensor], threads: int = 2,
                   reader: CheckpointReader | None = None) -> None:
    """Write one rank's pieces: each gathered into source order in a staging buffer, undone by the
    inverse value steps into the checkpoint's dtype, then written run by run. A piece of a
    dequantized tensor is encoded with the scales `reader` reads from the checkpoint it came from."""
    with torch.no_grad():
        work = [(item, _region(tensors[item.runtime_key], item)) for item in plan.items]
        work += [(item, _region(tensors[item.runtime_key], item)) for item in plan.encodes]

        def write(i: int) -> None:
            item, view = work[i]
            if isinstance(item, DecodeItem):
                _write_encoded(item, view, writer, reader, plan.requantize)
                return
            dtype = torch_dtype(item.dtype)
            if (len(item.runs) == 1 and not item.steps and view.dtype == dtype and view.device.type == "cpu"
                    and view.is_contiguous() and _dense(item.strides, item.sizes)):  # straight from memory
                writer.write_at(item.file, item.runs[0][0], as_byte_view(view))
                return
            nbytes = sum(n for _, n in item.runs)
            staging = torch.empty(nbytes, dtype=torch.uint8)
            values = _steps(view.detach().cpu() if view.device.type != "cpu" else view, item.steps)
            staging.view(torch_dtype(item.dtype)).as_strided(item.sizes, item.strides).copy_(values)
            data, at = memoryview(staging.numpy()), 0
            for byte_offset, n in item.runs:
                writer.write_at(item.file, byte_offset, data[at:at + n])
                at += n

        taken = itertools.count()

        def drain() -> None:
            while (i := next(taken)) < len(work):
                write(i)

        if threads <= 1 or len(work) < 2:
            drain()
        else:
            with ThreadPoolExecutor(threads) as pool:
                for f in [pool.submit(drain) for _ in range(threads)]:
                    f.result()
