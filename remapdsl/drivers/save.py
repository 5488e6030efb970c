"""`remapdsl.save`: the inverse of a load, no gather: every rank writes the boxes it holds that no lower rank
holds, into files rank 0 creates in a staging folder and renames into place once all is written."""

from __future__ import annotations

import json
import logging
import secrets
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..checkpoint import CheckpointReader
from ..checkpoint.writer import (FileWriter, NewCheckpoint, check_destination, commit, create_files, discard,
                                 new_checkpoint, omitted_index, remove_stale_staging, staging_path, without)
from ..compile.derive import derive_checkpoint
from ..compile.inverse import DROPPED, copied_parts, dropped_keys
from ..compile.inverse import writers as derive_writers
from ..errors import Diagnostic, RemapError
from ..gcpause import frozen_heap, paused_gc
from ..language.includes import RuleSet, load_rules
from ..sharding.holdings import hold, owned
from ..sharding.layouts import global_shapes
from ..sharding.plans import make_write_plan
from ..sizes import parse_size
from ..runtime import bounds, dist
from .prepare import HeldTogether, check_kinds, check_mesh, named_together, prepare_everywhere
from ..runtime.write import run_write_plan

_log = logging.getLogger("remapdsl")


class SaveReport(BaseModel):
    """What a save did on this rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    folder: str
    rank: int
    bytes_written: int  # by this rank
    files: tuple[str, ...]  # the files this rank wrote into
    seconds: float
    sync_seconds: float = 0.0  # of `seconds`, in fsync: making the files durable before the rename
    bytes_copied: int = 0  # of `bytes_written`, copied unchanged from `like` (dropped tensors, stored scales)


def save(prepared, state_dict, folder, *, rules=None, like=None, config=None, layout=None, mesh=None,
         overwrite: bool = False, allow_lossy: bool = False, requantize: bool = False, dropped: str = "error",
         max_shard_size: int | str = "5GB", timeout=None, local=None) -> SaveReport:
    """`remapdsl.save` (`prepared` None: `like`'s layout, or the derived one, prepared for this call)."""
    check_kinds(folder=folder, overwrite=overwrite, allow_lossy=allow_lossy, requantize=requantize)
    with bounds.bounded(timeout), frozen_heap():
        folder, derived = Path(folder).absolute(), None
        tensors = named_together(state_dict, local)
        if prepared is None:
            prepared, derived = prepared_checkpoint(rules, like, config, tensors, layout, folder, max_shard_size,
                                                    mesh=mesh)
        start = time.perf_counter()
        ready = prepared.current()
        inventory, compiled, layout = ready.inventory, ready.compiled, ready.placing(layout)
        rank, world = dist.rank(), dist.world_size()

        def place():
            check_dropped(dropped)
            check_mesh(mesh, alone="a save writes every rank's bytes, and one process holds only rank 0's: run every "
                       "rank of the mesh")
            chosen = prepared.kept("writers", (allow_lossy, requantize, dropped), lambda: writers_paused(
                compiled, allow_lossy=allow_lossy, requantize=requantize, dropped=dropped))
            out = derived or prepared.kept("output", (dropped, requantize),
                                           lambda: output_checkpoint(compiled, inventory, dropped, requantize))
            return chosen, out, hold(compiled, tensors, layout, mesh, rank, whole=not dist.active())

        # which rank writes a tensor held by several follows from what all hold: known after this exchange
        together = HeldTogether(compiled, lambda placed: placed[2], mesh)
        chosen, out, holding = dist.together(place, joint=together.joint(), phase="placing the tensors")

        def plan():
            mine = owned(holding, rank, holders=together.holders)
            return prepared.kept("save", (allow_lossy, requantize, dropped, mine, rank), lambda: make_write_plan(
                chosen, out.inventory, mine, rank, compiled.logical_by_key(), requantize))

        plan = dist.together(plan, phase="planning the writes")
        copies = copy_share(compiled, inventory, out.inventory, dropped, requantize, rank, world)
        copied = sum(piece[-1] for piece in copies)
        reader = CheckpointReader(inventory)
        # a derived layout's own index, or (files laid out anew, rank 0) `like`'s cut to match
        index = out.index or (omitted_index(inventory, out.inventory) if rank == 0 and out.headers else None)
        files = None if derived is None else \
            {"config.json": (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()} if config else {}
        try:
            sync_seconds = write_output(
                folder, out.inventory, headers=out.headers or None, index=index, copy_from=inventory.root, files=files,
                overwrite=overwrite, planned=plan.bytes_written + copied, write=lambda writer: (
                    run_write_plan(plan, writer, holding.local, reader=reader), copy_bytes(copies, reader, writer)))
        finally:
            reader.close()
        return SaveReport(folder=str(folder), rank=rank, bytes_written=plan.bytes_written + copied,
                          files=tuple(sorted({*plan.files, *(piece[2] for piece in copies)})),
                          seconds=time.perf_counter() - start, sync_seconds=sync_seconds, bytes_copied=copied)


def writers_paused(compiled, **options):
    """`remapdsl.compile.inverse.writers`, the collector paused: it builds many small objects."""
    with paused_gc():
        return derive_writers(compiled, **options)


def check_dropped(dropped) -> None:
    """E523: `dropped` is one of the three choices."""
    if dropped not in DROPPED:
        raise RemapError(Diagnostic(code="E523", message=f"dropped={dropped!r}: what a save does with the "
                                    "checkpoint tensors the rules drop is one of " + ", ".join(map(repr, DROPPED)),
                                    hint="\"copy\" copies them unchanged from `like`, \"omit\" leaves them out, "
                                    "\"error\" (the default) refuses the save"))


def output_checkpoint(compiled, like, dropped: str, requantize: bool) -> NewCheckpoint:
    """The layout the save writes: `like`'s (no headers: copied from its files), or with dropped tensors
    omitted, `like`'s without them (new headers); E524 for a DCP `like` or stored scales read at its offsets."""
    omitted = dropped_keys(compiled, like) if dropped == "omit" else []
    if not omitted:
        return NewCheckpoint(like, {}, None)
    why = ("`like` is a DCP checkpoint (its tensors stored in chunks)" if like.chunks else
           "the rules dequantize tensors whose stored scales are written back from `like`"
           if compiled.logical and not requantize else None)
    if why is not None:
        raise RemapError(Diagnostic(code="E524", message=f"dropped=\"omit\" would leave out {len(omitted)} "
                                    f"tensor(s), starting with `{omitted[0]}`, and lay their files out anew, "
                                    f"but {why}",
                                    hint="pass dropped=\"copy\" to keep them unchanged (the layout stays `like`'s)"))
    return without(like, omitted)


COPY_BYTES = 64 << 20  # the most one copy step holds


def copy_share(compiled, like, out, dropped: str, requantize: bool, rank: int,
               world: int) -> list[tuple[str, int, str, int, int]]:
    """This rank's `world`-th of the bytes a save copies unchanged from `like` into `out`: stored scales of
    dequantized tensors (unless requantized) and, with dropped="copy", the dropped tensors; each piece is
    (file in `like`, offset, file in the output, offset, bytes)."""
    keys = set() if requantize else set(copied_parts(compiled))
    if dropped == "copy":
        keys.update(dropped_keys(compiled, like))
    places = []
    for key in sorted(keys):
        target = out.tensors[key]
        for c in like.stored(key):  # a DCP-sharded tensor (out is `like` then): each chunk where it is
            dst = (c.file, c.byte_offset) if key in like.chunks else (target.file, target.byte_offset)
            places.append((c.file, c.byte_offset, *dst, c.nbytes(target.dtype)))
    total = sum(p[-1] for p in places)
    lo, hi = total * rank // world, total * (rank + 1) // world
    mine, at = [], 0
    for src, src_offset, dst, dst_offset, size in places:
        start, end = max(lo, at), min(hi, at + size)
        if start < end:
            mine.append((src, src_offset + start - at, dst, dst_offset + start - at, end - start))
        at += size
    return mine


def copy_bytes(pieces, reader, writer) -> None:
    """Copy the pieces of `copy_share` byte for byte, at most COPY_BYTES held at once."""
    buffer = memoryview(bytearray(min(COPY_BYTES, max((piece[-1] for piece in pieces), default=0))))
    for src, src_offset, dst, dst_offset, size in pieces:
        for step in range(0, size, COPY_BYTES):
            data = buffer[:min(COPY_BYTES, size - step)]
            reader.read_into(src, src_offset + step, data)
            writer.write_at(dst, dst_offset + step, data)


def prepared_checkpoint(rules, like, config, tensors, layout, root: Path, max_shard_size: int | str = "5GB",
                        check=None, mesh=None):
    """Every rank: a Prepared for one call's save (export, ingest) of `like`'s layout, or without it of the
    one derived from every rank's tensors' shapes (also returned: a NewCheckpoint, else None). `check`:
    the caller's checks of its arguments, run first on every rank."""
    from .prepared import Prepared

    given, check = like, check or (lambda: None)
    if like is None and config is None:
        config = {}
    # a derived layout follows from every rank's shapes: a stage holds only its tensors, a shard part of one
    shapes = dist.gather_all({} if like is not None else {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()
        if hasattr(v, "shape") and hasattr(v, "dtype")}, "sharing the runtime tensors' shapes")
    derived = dist.from_first(lambda: (check(), None if given is not None else derived_checkpoint(
        rules, config, shapes, layout, mesh, root, max_shard_size))[1], "deriving the checkpoint layout")
    like = like if derived is None else derived.inventory
    # not strict: a checkpoint tensor no rule reads is the save's own error (E501)
    ready = prepare_everywhere(rules, like, config, strict=False, on_disk=derived is None,
                               check=lambda: (check(), same_like(given, derived)))
    return Prepared(rules, like, config, False, ready, watched=False), derived


def same_like(like, derived) -> None:
    """E520 on a rank given `like` where rank 0 was not, or the other way round."""
    if (like is None) == (derived is None):
        which = "this rank was given no `like` and rank 0 was" if like is None else \
            "this rank was given `like` and rank 0 was not"
        raise RemapError(Diagnostic(code="E520", message=f"a save writes one layout on every rank, but {which}",
                                    hint="give every rank the same `like`, or none to derive the layout"))


def derived_checkpoint(rules, config, shapes: list[dict], layout, mesh, folder: Path,
                       max_shard_size: int | str) -> NewCheckpoint:
    """The files a save without `like` writes: the tensors the rules derive from the runtime tensors' global
    shapes (`shapes`: every rank's, in rank order), sharded as Hugging Face shards."""
    check_mesh(mesh, alone=None if layout is None else "without `like`, the checkpoint's shapes come from every "
               "rank's shards: run every rank of the mesh, or give `like`")
    runtime = global_shapes(shapes, None if layout is None else layout.resolved(config), mesh)
    max_shard_bytes = parse_size(max_shard_size, f"max_shard_size={max_shard_size!r}")
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    return new_checkpoint(str(folder), derive_checkpoint(ruleset, runtime, config), max_shard_bytes)


def write_output(folder: Path, inventory, *, headers=None, index=None, copy_from=None, files=None, overwrite: bool,
                 write, planned: int = 0) -> float:
    """Every rank runs `write(writer)` into the staging files rank 0 creates and then commits; an error
    anywhere is raised on every rank and the staging folder removed. `planned`: this rank's bytes (named if
    the disk fills up). Returns this rank's fsync seconds."""
    rank = dist.rank()

    def destination() -> str:
        check_destination(folder, overwrite)
        for stale in remove_stale_staging(folder):
            _log.info("removed %s: the staging folder of an earlier save to %s, whose process died", stale, folder)
        return secrets.token_hex(6)

    token = dist.from_first(destination, "checking the destination")
    staging = staging_path(folder, token)
    writer = FileWriter(staging, planned)
    try:
        dist.together(lambda: create_files(staging, inventory, headers) if rank == 0 else None,
                      phase="creating the files")
        try:
            dist.together(lambda: write(writer), phase="writing")
        finally:
            synced = time.perf_counter()
            writer.close(sync=True)
            sync_seconds = time.perf_counter() - synced
        dist.together(lambda: commit(staging, folder, inventory, token, overwrite, index=index, copy_from=copy_from,
                                     files=files) if rank == 0 else None, phase="committing")
    except BaseException:
        if rank == 0:
            discard(staging)
        raise
    return sync_seconds
