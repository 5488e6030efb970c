"""`remapdsl.save`: the inverse of a load, written in place by every rank, no gather.

Every rank compiles the same rules against the checkpoint the output is `like` (its headers read
once, by rank 0), derives the writers (remapdsl/compile/inverse.py), and computes alone which
boxes it writes: those it holds that no lower rank holds. Rank 0 creates the output files at full
size in a hidden staging folder; each rank writes its own bytes; rank 0 writes the index and
renames the folder into place (remapdsl/checkpoint/writer.py). Each phase fails on every rank
together; a failed save removes its staging folder and leaves the destination as it was.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from .compile import compile_rules
from .gcpause import paused_gc
from .rules import RuleSet, load_rules


class SaveReport(BaseModel):
    """What a save did on this rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    folder: str
    rank: int
    bytes_written: int  # by this rank
    files: tuple[str, ...]  # the files this rank wrote into
    seconds: float
    sync_seconds: float = 0.0  # of `seconds`, in fsync: making the files durable before the rename


def save(source, folder, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None, mesh=None,
         overwrite: bool = False, allow_lossy: bool = False, requantize: bool = False) -> SaveReport:
    """Write runtime tensors back to the checkpoint layout `like` through the rules that load it.

    Args:
        source: a state dict (runtime key -> tensor) or a torch.nn.Module; DTensors are written per
            their placements, plain tensors are whole or this rank's shard under `layout`.
        folder: the output checkpoint folder (created; it must not exist unless `overwrite`).
        rules: a .remap file path (or a RuleSet): the rules that load `like` into `source`'s layout.
        like: the checkpoint (folder or Inventory) whose keys, files, headers and index the output
            takes: an unchanged model saves to byte-identical files.
        config: the model config; by default `like`'s config.json.
        layout, mesh: as for `remapdsl.load`.
        overwrite: replace an existing folder (only once the new one is complete).
        allow_lossy: write back tensors that the rules read through a cast that loses values.
        requantize: write dequantized tensors with new scales computed from their values (fp8_block:
            amax / 448 per block), not the stored ones; each block must be whole on one rank.
    """
    if like is None:
        from .errors import Diagnostic, RemapError

        raise RemapError(Diagnostic(code="E520", message="a save writes the checkpoint layout the rules read: "
                                    "give that checkpoint with `like` (its keys, files and headers); rules "
                                    "alone do not give the sizes of every tensor",
                                    hint="or write the runtime layout itself with `remapdsl convert`"))
    with paused_gc():
        return _save(source, Path(folder).absolute(), rules, like, config, layout, mesh, overwrite, allow_lossy,
                     requantize)


def _save(source, folder: Path, rules, like, config, layout, mesh, overwrite, allow_lossy,
          requantize) -> SaveReport:
    from . import compile_digest, dist, read_config  # torch is imported only here
    from .checkpoint import CheckpointReader
    from .checkpoint.writer import FileWriter, check_destination, commit, create_files, discard, staging_path
    from .compile.inverse import copied_parts
    from .compile.inverse import writers as derive_writers
    from .execute import owned_tensors, run_write_plan
    from .plan import make_write_plan

    start = time.perf_counter()
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    inventory = dist.share_inventory(like)
    config = read_config(inventory) if config is None else config
    digest = compile_digest(ruleset, config, True, like)
    # not strict: a checkpoint tensor no rule reads is the save's own error (E501, below)
    compiled = dist.together(lambda: compile_rules(ruleset, inventory, config, strict=False),
                             agree_on=("compiled rules and checkpoint", lambda _: digest))
    tensors = source.state_dict(keep_vars=True) if hasattr(source, "state_dict") else source
    rank = dist.rank()

    def prepare():
        chosen = derive_writers(compiled, allow_lossy=allow_lossy, requantize=requantize)
        owned, local = owned_tensors(compiled, tensors, layout, mesh, rank)
        return make_write_plan(chosen, inventory, owned, rank, compiled.logical_by_key(), requantize), local

    plan, local = dist.together(prepare)
    copies = copied_parts(compiled) if rank == 0 and not requantize else []  # stored scales, as they are
    token = dist.from_first(lambda: (check_destination(folder, overwrite), secrets.token_hex(6))[1])
    staging = staging_path(folder, token)
    dist.together(lambda: create_files(staging, inventory) if rank == 0 else None)
    writer = FileWriter(staging)
    reader = CheckpointReader(inventory)

    def write() -> None:
        run_write_plan(plan, writer, local, reader=reader)
        for key in copies:
            info = inventory.tensors[key]
            data = bytearray(info.nbytes)
            reader.read_into(info.file, info.byte_offset, data)
            writer.write_at(info.file, info.byte_offset, memoryview(data))

    try:
        try:
            dist.together(write)
        finally:
            synced = time.perf_counter()
            writer.close(sync=True)
            sync_seconds = time.perf_counter() - synced
            reader.close()
        dist.together(lambda: commit(staging, folder, inventory, token, overwrite) if rank == 0 else None)
    except BaseException:
        if rank == 0:
            discard(staging)
        raise
    copied = sum(inventory.tensors[k].nbytes for k in copies)
    return SaveReport(folder=str(folder), rank=rank, bytes_written=plan.bytes_written + copied, files=plan.files,
                      seconds=time.perf_counter() - start, sync_seconds=sync_seconds)
