"""`remapdsl convert`: a checkpoint from one layout to another, offline, each rank its share of the runtime
tensors (balanced by bytes) a batch at a time within `budget_bytes`, through save's staging folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..checkpoint import CheckpointReader, read_config
from ..checkpoint.reader import as_byte_view
from ..checkpoint.writer import new_checkpoint, omitted_index
from ..errors import Diagnostic, RemapError
from ..gcpause import frozen_heap
from ..indexmap import nbytes
from ..sharding.holdings import whole_shard
from ..sharding.plans import make_load_plan, make_write_plan
from ..runtime import bounds, dist
from .prepare import check_kind, prepare_everywhere
from ..runtime.read import run_load_plan
from .save import (check_dropped, copy_bytes, copy_share, output_checkpoint, prepared_checkpoint,
                   write_output, writers_paused)
from ..runtime.write import run_write_plan
from ..sizes import parse_size

BATCH_BYTES = 64 << 20  # the most a forward batch holds, whatever the budget


class ConvertReport(BaseModel):
    """What a conversion did on this rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    folder: str
    tensors: int  # runtime tensors converted by this rank
    bytes_written: int  # by this rank
    files: int  # output files (all ranks)
    ranks: int
    seconds: float


def convert(src, dst, rules, *, reverse: bool = False, like=None, max_shard_bytes: int = 5 * 10**9,
            budget_bytes: int = 1 << 30, overwrite: bool = False, progress: Callable[[int, int], None] | None = None,
            dropped: str = "error", timeout=None) -> ConvertReport:
    """Convert checkpoint `src` into `dst` through `rules`; the arguments are `remapdsl.convert`'s."""
    with bounds.bounded(timeout), frozen_heap():
        dst = Path(dst).absolute()
        start = time.perf_counter()
        max_shard_bytes = parse_size(max_shard_bytes, f"max_shard_bytes={max_shard_bytes!r}")
        budget_bytes = parse_size(budget_bytes, f"budget_bytes={budget_bytes!r}")
        if progress is not None:
            check_kind(progress, "progress")
        # the layout the rules read: `src`'s (forward), `like`'s, or the one derived from the runtime
        # checkpoint's shapes and config.json (reverse without `like`, as a save without it derives it)
        runtime_source = dist.share_inventory(src, "reading the runtime checkpoint's headers") if reverse else None
        derived = None
        if reverse and like is None:
            prepared, derived = prepared_checkpoint(rules, None, read_config(runtime_source), runtime_source.tensors,
                                                    None, dst, max_shard_bytes, check=lambda: check_dropped(dropped))
            checkpoint, compiled = prepared.inventory, prepared.compiled
        else:
            checkpoint, compiled, _, _ = prepare_everywhere(rules, like if reverse else src,
                                                         check=lambda: check_dropped(dropped))
        runtime = {d.runtime_key: d for d in compiled.runtime_tensors}
        rank, world = dist.rank(), dist.world_size()

        if reverse:
            dist.together(lambda: _check_runtime_source(compiled, runtime_source, src),
                          phase="checking the runtime checkpoint")
            chosen, out = dist.together(lambda: (writers_paused(compiled, dropped=dropped),
                                                 derived or output_checkpoint(compiled, checkpoint, dropped, False)),
                                        phase="deriving the writers")
            out_inventory, headers = out.inventory, out.headers or None
            copy_from = str(src) if derived else checkpoint.root  # a derived layout: the runtime folder's config.json
            index = out.index or (omitted_index(checkpoint, out_inventory) if rank == 0 and headers else None)
            copies = copy_share(compiled, checkpoint, out_inventory, dropped, False, rank, world)
        else:
            new = new_checkpoint(str(dst), {k: (d.dtype, d.shape) for k, d in runtime.items()}, max_shard_bytes)
            out_inventory, headers, index, copy_from = new.inventory, new.headers, new.index, checkpoint.root
        sizes = {k: nbytes(d.dtype, d.shape) for k, d in runtime.items()}
        mine = _share(sizes, rank, world)
        total, done, written = sum(sizes[k] for k in mine), 0, 0
        logical = compiled.logical_by_key()

        def work(writer) -> None:
            nonlocal done, written
            # forward: batches of half the budget (at most BATCH_BYTES, for an early start to the writes),
            # each written on a thread while the next one is read
            budget = budget_bytes if reverse else max(1, min(budget_bytes // 2, BATCH_BYTES))
            pending = None
            # reverse: `scales` reads the stored scales of dequantized tensors
            with (CheckpointReader(runtime_source or checkpoint) as reader, CheckpointReader(checkpoint) as scales,
                  ThreadPoolExecutor(1) as pool):
                if reverse:  # dropped tensors and stored scales, unchanged: each rank its share of the bytes
                    copy_bytes(copies, scales, writer)
                    written += sum(piece[-1] for piece in copies)
                for batch in batches(mine, sizes.__getitem__, budget):
                    tensors = compiled.empty_state_dict(batch)
                    whole = {k: whole_shard(tuple(t.shape)) for k, t in tensors.items()}
                    if reverse:  # runtime tensors read whole from src, written through the save direction
                        for k, t in tensors.items():
                            read_whole(reader, k, t)
                        plan = make_write_plan(chosen, out_inventory, whole, rank, logical)
                        run_write_plan(plan, writer, tensors, reader=scales)
                        written += plan.bytes_written
                    else:  # runtime tensors made by the rules, written whole at their offsets
                        run_load_plan(make_load_plan(compiled, checkpoint, whole, rank), checkpoint, tensors)
                        if pending is not None:
                            pending.result()  # the previous batch is written (and freed) first
                        pending = pool.submit(_write_whole, writer, out_inventory, tensors)
                        written += sum(sizes[k] for k in batch)
                    done += sum(t.nbytes for t in tensors.values())
                    tensors = t = None  # freed once written: at most two half-budget batches at a time
                    if progress is not None:
                        progress(done, total)
                if pending is not None:
                    pending.result()

        write_output(dst, out_inventory, headers=headers, index=index, copy_from=copy_from, overwrite=overwrite,
                     write=work, planned=0 if reverse else total)
        return ConvertReport(folder=str(dst), tensors=len(mine), bytes_written=written, files=len(out_inventory.files),
                             ranks=world, seconds=time.perf_counter() - start)


def _write_whole(writer, inventory, tensors) -> None:
    """Each tensor of a batch written whole at its offset in the output files."""
    for k, t in tensors.items():
        info = inventory.tensors[k]
        writer.write_at(info.file, info.byte_offset, as_byte_view(t))


def read_whole(reader: CheckpointReader, key: str, tensor) -> None:
    """Checkpoint tensor `key` read whole into `tensor` (of its shape and dtype): its bytes at once,
    or, for a DCP-sharded one, each chunk into its box."""
    chunks = reader.inventory.chunks.get(key)
    if chunks is None:
        reader.read_tensor_into(key, tensor)
        return
    for c in chunks:
        part = tensor.new_empty(c.sizes)
        reader.read_into(c.file, c.byte_offset, as_byte_view(part))
        tensor[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = part


def _check_runtime_source(compiled, source, src) -> None:
    """The runtime-layout checkpoint has every runtime tensor, with the shape and dtype the rules make."""
    problems = []
    for d in compiled.runtime_tensors:
        info = source.tensors.get(d.runtime_key)
        if info is None:
            problems.append(Diagnostic(code="E521", path=str(src), message=f"`{d.runtime_key}` is not in the "
                                       "runtime-layout checkpoint", hint="convert a checkpoint the rules' forward "
                                       "direction wrote (or a trainer saved in that layout)"))
        elif tuple(info.shape) != d.shape or info.dtype != d.dtype:
            problems.append(Diagnostic(code="E521", path=str(src), message=f"`{d.runtime_key}` is "
                                       f"{list(info.shape)} {info.dtype}, the rules make {list(d.shape)} {d.dtype}"))
    if problems:
        raise RemapError(tuple(problems))


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's keys, sorted: the largest first to the least loaded rank (every rank computes the same)."""
    load = [0] * world
    owner: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = owner[key] = load.index(min(load))
        load[r] += sizes[key]
    return sorted(k for k in sizes if owner[k] == rank)


def batches(keys: list, size, budget: int) -> list[list]:
    """`keys` in order, cut into runs of at most `budget` by `size` (a larger one alone)."""
    out: list[list] = []
    for key in keys:
        if not out or held + size(key) > budget:
            out.append([])
            held = 0
        out[-1].append(key)
        held += size(key)
    return out
