"""remapdsl: one declarative rule file -> exact, sharded loads and saves of model checkpoints.

The public API: a few drivers over the subpackages' stages of frozen data (docs/architecture.md). Importing
it does not import torch; the functions that move tensors do, when called."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .checkpoint import Inventory, open_inventory
from .checkpoint.snapshot import (SnapshotInventory, checkpoint_config, config_of, is_snapshot, open_snapshot,
                                  require_data)
from .checkpoint.snapshot import write_snapshot as _write_snapshot
from .compile import Compiled
from .compile import compile_rules as _compile_rules
from .compile.explain import explain
from .errors import BindError, CheckpointError, Diagnostic, RemapError, RuleCheckError, RuleSyntaxError, Span
from .compile.quantized import check_formats as _check_formats
from .language import RuleSet, format_rules
from .language import load_rules as _load_rules
from .language import ir as _ir
from .language.library import resolve_rules_path as _resolve_rules_path
from .language.parser import parse_file as _parse_file
from .language.library import ShippedRules, shipped_rules
from .language.library import choose_rules as _choose_rules
from .drivers.prepare import check_kind as _check_kind
from .drivers.prepare import check_kinds as _check_kinds
from .drivers.prepare import rules_for
from .drivers.prepared import Prepared
from .sharding import layout_for, parse_mesh, read_layout
from .sharding.placements import LayoutError
from .sizes import parse_size

__version__ = "0.1.0"


def load_rules(path: str | os.PathLike, root: str | os.PathLike | None = None) -> RuleSet:
    """Read, parse and statically check a rule file (a path, or a shipped name) and everything it includes,
    its format calls against the formats registered now; `root`: the folder includes may not leave."""
    rules = _load_rules(path, root)
    _check_formats(rules)
    return rules


def parse_rules(rules: str | os.PathLike) -> _ir.RuleFile:
    """One rule file parsed, its includes not followed nor anything checked: its statements with
    their comments, as `format_rules` prints them back (a path, or a shipped name)."""
    return _parse_file(_resolve_rules_path(rules))


def choose_rules(checkpoint: str | os.PathLike | Inventory,
                 config: Mapping[str, Any] | None = None) -> tuple[ShippedRules, str]:
    """The shipped rule file that fits a checkpoint (what `rules="auto"` loads), and why, in words: by the
    config's (default: the checkpoint's config.json) `model_type`, else `architectures`, then
    `quantization_config.quant_method` (E147 when none fits)."""
    return _choose_rules(config_of(checkpoint) if config is None else config)


def open_checkpoint(checkpoint: str | os.PathLike | Inventory) -> Inventory:
    """The inventory of a checkpoint folder (headers, index and config.json; no tensor data), of a snapshot
    file (`write_snapshot`; a `SnapshotInventory`, which carries its config), or the one given."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    return open_snapshot(checkpoint) if is_snapshot(checkpoint) else open_inventory(checkpoint)


def write_snapshot(checkpoint: str | os.PathLike | Inventory, path: str | os.PathLike) -> str:
    """Write a checkpoint's headers, index and config.json, no data, to `path` (`*.headers.json`), a small
    deterministic JSON file that stands in for the folder where only headers are read; returns its text."""
    return _write_snapshot(checkpoint, path)


def compile_rules(rules: str | os.PathLike | RuleSet, checkpoint: str | os.PathLike | Inventory,
                  config: Mapping[str, Any] | None = None, *, strict: bool = True) -> Compiled:
    """Compile a rule file against a checkpoint's headers (a folder, a snapshot or an Inventory): the blocks
    that tile every runtime tensor. `strict`: refuse checkpoint tensors no rule takes and no `drop` names."""
    inventory = open_checkpoint(checkpoint)
    rules = rules_for(rules, inventory, config)
    ruleset = rules if isinstance(rules, RuleSet) else _load_rules(rules)  # compiling checks the format calls
    return _compile_rules(ruleset, inventory, checkpoint_config(inventory) if config is None else config,
                          strict=strict)


def plan_rank(compiled: Compiled, inventory: Inventory, layout, mesh, rank: int,
              config: Mapping[str, Any] | None = None):
    """The LoadPlan of one rank under a layout plan (`remapdsl.sharding.LayoutPlan` on a
    `remapdsl.sharding.Mesh`), without a process group or tensors. `config` (default: the checkpoint's)
    gives the config keys the layout's packed placements name."""
    from .sharding.holdings import held_by_layout
    from .sharding.plans import make_load_plan

    config = checkpoint_config(inventory) if config is None else config
    layout = _check_kind(layout, "layout").resolved(config)
    held = held_by_layout(compiled, layout, _check_kind(mesh, "mesh"), rank)
    return make_load_plan(compiled, inventory, held, rank)


def prepare(rules, checkpoint, *, config: Mapping[str, Any] | None = None, strict: bool = True, timeout=None):
    """Every rank: read a checkpoint's headers and compile the rules once for many loads, saves, exports and
    ingests of one job; returns a `Prepared` whose methods take those functions' arguments, less the rules,
    the checkpoint (their `like`) and the config (docs/reuse.md). No checkpoint is E418."""
    from .drivers.prepared import prepare as _prepare

    if checkpoint is None:
        raise RemapError(Diagnostic(code="E418", message="prepare needs the checkpoint the calls load from, or "
                                    "save, export and ingest in the layout of (their `like`)",
                                    hint="a save without `like` derives its layout from the tensors: call "
                                    "`remapdsl.save` itself, or prepare with the folder it wrote"))
    _check_kinds(rules=rules, checkpoint=checkpoint, config=config, strict=strict)
    require_data(checkpoint, "a prepared load")
    return _prepare(rules_for(rules, checkpoint, config), checkpoint, config=config, strict=strict, timeout=timeout)


def load(state_dict, checkpoint, rules, *, config: Mapping[str, Any] | None = None, strict: bool = True,
         layout=None, mesh=None, read_replicated_once: bool = False, timeout=None, staging_bytes: int | None = None,
         local: Mapping[str, Any] | None = None):
    """Fill existing tensors in place from a checkpoint, through a rule file; returns a LoadReport. Every rank
    of a job calls it and reads only its own shards' bytes (shared arguments: docs/api.md).

    Args:
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
        read_replicated_once: tensors every rank holds whole are read by rank 0 and broadcast.
        staging_bytes: the most host memory pinned to copy into CUDA tensors (default 16 MiB).
        local: this rank's local names -> global runtime names, `{"decoder.layers.{}": stage_offset}`.
    """
    from .drivers.prepared import prepare as _prepare

    _check_kinds(checkpoint=checkpoint, rules=rules, config=config, strict=strict)
    require_data(checkpoint, "a load")
    prepared = _prepare(rules_for(rules, checkpoint, config), checkpoint, config=config, strict=strict,
                        timeout=timeout, watched=False)
    return prepared.load(state_dict, layout=layout, mesh=mesh, read_replicated_once=read_replicated_once,
                         timeout=timeout, staging_bytes=staging_bytes, local=local)


def save(state_dict, folder, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None,
         mesh=None, overwrite: bool = False, allow_lossy: bool = False, requantize: bool = False,
         dropped: str = "error", max_shard_size: int | str = "5GB", timeout=None, local: Mapping[str, Any] | None = None):
    """Write runtime tensors back to the checkpoint layout `like` through the rules that load it, every rank
    its own bytes (no gather); returns a SaveReport (docs/saving.md; shared arguments: docs/api.md).

    Args:
        folder: the output folder (created; an existing one only with `overwrite`, replaced once complete).
        like: the checkpoint whose keys, files, headers and index the output takes; None: the layout is
            derived from the rules, the config and the tensors' shapes (docs/saving.md#without-like).
        allow_lossy: write back tensors that the rules read through a cast that loses values.
        requantize: write dequantized tensors with new scales computed from their values.
        dropped: the tensors the rules `drop`: `"error"` refuses the save (E501), `"copy"` copies them from
            `like`, `"omit"` leaves them out.
        max_shard_size: without `like`: start a new file past this size (bytes, or a text such as "5GB").
    """
    from .drivers.save import save as _save

    _check_kinds(rules=rules, like=like, config=config)  # the folder and flags: the driver's, as for Prepared.save
    require_data(like, "a save (`like`)")
    return _save(None, state_dict, folder, rules=rules_for(rules, like, config), like=like, config=config,
                 layout=layout, mesh=mesh, overwrite=overwrite, allow_lossy=allow_lossy, requantize=requantize,
                 dropped=dropped, max_shard_size=max_shard_size, timeout=timeout, local=local)


def export(state_dict, rules, *, like=None, config: Mapping[str, Any] | None = None, gather=(),
           bucket_bytes: int = 256 << 20, layout=None, mesh=None, allow_lossy: bool = False, regions: bool = False,
           by_round: bool = False, timeout=None, local: Mapping[str, Any] | None = None):
    """The checkpoint layout of a sharded runtime state dict, in memory, for weight sync without files: an
    iterator of (checkpoint key, whole tensor) pairs, each key on one rank. Run on every rank, to the end
    (docs/export.md; shared arguments: docs/api.md).

    Args:
        gather: the mesh dims over which a tensor's pieces are assembled (`("dp_shard",)`).
        bucket_bytes: the most bytes of tensors a rank assembles in one round.
        allow_lossy: as for `save`.
        regions: yield `(key, offsets, tensor)`, the boxes this rank holds and no lower rank does.
        by_round: yield one list of pairs per round, the same number on every rank (not with `regions`).
    """
    from .drivers.export import export as _export

    _check_kinds(rules=rules, like=like, config=config)  # gather and the flags: the driver's
    require_data(like, "an export (`like`)")
    return _export(None, state_dict, rules=rules_for(rules, like, config), like=like, config=config, gather=gather,
                   bucket_bytes=bucket_bytes, layout=layout, mesh=mesh, allow_lossy=allow_lossy, regions=regions,
                   by_round=by_round, timeout=timeout, local=local)


def ingest(state_dict, pairs, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None,
           mesh=None, timeout=None, staging_bytes: int | None = None, local: Mapping[str, Any] | None = None):
    """Fill a runtime state dict in place from (checkpoint key, tensor) pairs, through the rules: the mirror
    of `export`, a load from memory. Every rank is given the same pairs (a dict or an iterable, read once) and
    takes its own part; returns an IngestReport (docs/export.md#ingest; shared arguments: docs/api.md).
    `like`: the checkpoint whose layout the pairs are in; None: derived, as a save without `like` does."""
    from .drivers.ingest import ingest as _ingest

    _check_kinds(rules=rules, like=like, config=config)
    require_data(like, "an ingest (`like`)")
    return _ingest(None, state_dict, pairs, rules=rules_for(rules, like, config), like=like, config=config,
                   layout=layout, mesh=mesh, timeout=timeout, staging_bytes=staging_bytes, local=local)


def convert(src, dst, rules, *, reverse: bool = False, like=None, max_shard_bytes: int = 5 * 10**9,
            budget_bytes: int = 1 << 30, overwrite: bool = False, progress=None, dropped: str = "error",
            timeout=None):
    """Convert checkpoint `src` into `dst` through `rules`, offline, in batches, on any number of ranks: into
    the runtime layout the rules make, or with `reverse` back; returns a ConvertReport (docs/saving.md).

    Args:
        reverse: `src` is in the runtime layout; write `like`'s layout, or the one `save` derives without it.
        max_shard_bytes: forward, or reverse without `like`: start a new output file past this size.
        budget_bytes: runtime tensors held at once by a rank (a larger tensor is held alone).
            Both are numbers of bytes, or sizes as `save`'s `max_shard_size` takes them ("5GB").
        overwrite: replace an existing `dst` (only once the new one is complete).
        progress: called with (bytes done, bytes in all) on this rank after each batch.
        dropped: reverse only: what becomes of the tensors of `like` the rules drop, as for `save`.
    """
    from .drivers.convert import convert as _convert

    _check_kinds(src=src, dst=dst, rules=rules, like=like, reverse=reverse, overwrite=overwrite)
    require_data(src, "a conversion")
    require_data(like, "a conversion (`like`)")
    return _convert(src, dst, rules_for(rules, like if reverse else src), reverse=reverse, like=like,
                    max_shard_bytes=max_shard_bytes, budget_bytes=budget_bytes, overwrite=overwrite, progress=progress,
                    dropped=dropped, timeout=timeout)


__all__ = [
    "BindError",
    "CheckpointError",
    "Diagnostic",
    "LayoutError",
    "Prepared",
    "RemapError",
    "RuleCheckError",
    "RuleSyntaxError",
    "ShippedRules",
    "SnapshotInventory",
    "Span",
    "choose_rules",
    "compile_rules",
    "convert",
    "explain",
    "export",
    "format_rules",
    "ingest",
    "layout_for",
    "load",
    "load_rules",
    "open_checkpoint",
    "parse_mesh",
    "parse_rules",
    "parse_size",
    "plan_rank",
    "prepare",
    "read_layout",
    "save",
    "shipped_rules",
    "write_snapshot",
]
