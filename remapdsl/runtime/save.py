"""`remapdsl.save`: the inverse of a load, written in place by every rank, no gather.

Every rank compiles the same rules against the checkpoint the output is `like` (its headers read
once, by rank 0), derives the writers (remapdsl/compile/inverse.py), and computes alone which
boxes it writes: those it holds that no lower rank holds. Rank 0 creates the output files at full
size in a hidden staging folder; each rank writes its own bytes; rank 0 writes the index and
renames the folder into place (remapdsl/checkpoint/writer.py). Each phase fails on every rank
together; a failed save removes its staging folder and leaves the destination as it was.

The driver imports what it runs at module level (torch among it): the api imports this module
only when the call is made, so `import remapdsl` stays free of torch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..checkpoint import CheckpointReader
from ..checkpoint.writer import (
    FileWriter,
    check_destination,
    commit,
    create_files,
    discard,
    remove_stale_staging,
    staging_path,
)
from ..compile.inverse import copied_parts
from ..compile.inverse import writers as derive_writers
from ..errors import Diagnostic, RemapError
from ..gcpause import paused_gc
from ..sharding.holdings import hold, owned
from ..sharding.plans import make_write_plan
from . import dist
from .prepare import check_mesh, compile_everywhere, layout_agreement
from .write import run_write_plan


class SaveReport(BaseModel):
    """What a save did on this rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    folder: str
    rank: int
    bytes_written: int  # by this rank
    files: tuple[str, ...]  # the files this rank wrote into
    seconds: float
    sync_seconds: float = 0.0  # of `seconds`, in fsync: making the files durable before the rename


def save(state_dict, folder, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None, mesh=None,
         overwrite: bool = False, allow_lossy: bool = False, requantize: bool = False) -> SaveReport:
    """Write runtime tensors back to the checkpoint layout `like`; the arguments are `remapdsl.save`'s."""
    with paused_gc():
        return _save(state_dict, Path(folder).absolute(), rules, like, config, layout, mesh, overwrite, allow_lossy,
                     requantize)


def _save(state_dict, folder: Path, rules, like, config, layout, mesh, overwrite, allow_lossy,
          requantize) -> SaveReport:
    start = time.perf_counter()
    # not strict: a checkpoint tensor no rule reads is the save's own error (E501, below)
    inventory, compiled = compile_everywhere(rules, like, config, strict=False, check=lambda: _check_like(like))
    tensors = state_dict.state_dict(keep_vars=True) if hasattr(state_dict, "state_dict") else state_dict
    rank = dist.rank()

    def prepare():
        check_mesh(mesh)
        chosen = derive_writers(compiled, allow_lossy=allow_lossy, requantize=requantize)
        holding = hold(compiled, tensors, layout, mesh, rank)
        return (make_write_plan(chosen, inventory, owned(holding, rank), rank, compiled.logical_by_key(), requantize),
                holding)

    plan, holding = dist.together(prepare, agree_on=layout_agreement("tensor layouts", lambda r: r[1], mesh),
                                  phase="planning the writes")
    local = holding.local
    copies = copied_parts(compiled) if rank == 0 and not requantize else []  # stored scales, as they are
    reader = CheckpointReader(inventory)
    copied = sum(inventory.tensors[k].nbytes for k in copies)  # chunks included: they tile the tensor
    try:
        sync_seconds = write_output(folder, inventory, overwrite=overwrite, planned=plan.bytes_written + copied,
                                    write=lambda writer: (run_write_plan(plan, writer, local, reader=reader),
                                                          copy_tensors(copies, reader, writer)))
    finally:
        reader.close()
    return SaveReport(folder=str(folder), rank=rank, bytes_written=plan.bytes_written + copied, files=plan.files,
                      seconds=time.perf_counter() - start, sync_seconds=sync_seconds)


def _check_like(like) -> None:
    if like is None:
        raise RemapError(Diagnostic(code="E520", message="a save writes the checkpoint layout the rules read: "
                                    "give that checkpoint with `like` (its keys, files and headers); rules "
                                    "alone do not give the sizes of every tensor",
                                    hint="or write the runtime layout itself with `remapdsl convert`"))


def write_output(folder: Path, layout, *, headers=None, index=None, copy_from=None, overwrite: bool,
                 write, planned: int = 0) -> float:
    """The phases every rank runs to write a checkpoint in place: rank 0 checks the destination,
    removes the staging folders of earlier saves there whose process died, and creates the staging files of `layout` (an Inventory: `like`'s, or a new one with `headers` and
    `index`), every rank runs `write(writer)`, rank 0 commits. An error on any rank, in any phase,
    is raised on every rank and the staging folder is removed. `planned`: the bytes this rank writes
    (named when the disk fills up). Returns this rank's fsync seconds."""

    rank = dist.rank()
    token = dist.from_first(lambda: (check_destination(folder, overwrite), remove_stale_staging(folder),
                                     secrets.token_hex(6))[2], "checking the destination")
    staging = staging_path(folder, token)
    writer = FileWriter(staging, planned)
    try:
        dist.together(lambda: create_files(staging, layout, headers) if rank == 0 else None,
                      phase="creating the files")
        try:
            dist.together(lambda: write(writer), phase="writing")
        finally:
            synced = time.perf_counter()
            writer.close(sync=True)
            sync_seconds = time.perf_counter() - synced
        dist.together(lambda: commit(staging, folder, layout, token, overwrite, index=index, copy_from=copy_from)
                      if rank == 0 else None, phase="committing")
    except BaseException:
        if rank == 0:
            discard(staging)
        raise
    return sync_seconds


def copy_tensors(keys, reader, writer) -> None:
    """Checkpoint tensors copied byte for byte into the output (the stored scales of dequantized
    tensors written back with them)."""
    inventory = reader.inventory
    for key in keys:
        info = inventory.tensors[key]
        chunks = inventory.chunks.get(key)
        places = [(info.file, info.byte_offset, info.nbytes)] if chunks is None else \
            [(c.file, c.byte_offset, info.nbytes * prod(c.sizes) // max(1, prod(info.shape))) for c in chunks]
        for file, offset, size in places:  # a DCP-sharded tensor: each chunk where it is
            data = bytearray(size)
            reader.read_into(file, offset, data)
            writer.write_at(file, offset, memoryview(data))
