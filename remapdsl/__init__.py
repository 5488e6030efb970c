"""remapdsl: one declarative rule file -> exact, sharded loads and saves of model checkpoints.

The public API, a few drivers over stages of frozen data (docs/architecture.md); the rest lives in the
subpackages `language`, `checkpoint`, `quant`, `compile`, `sharding` and `runtime`. Importing it does not
import torch; the functions that move tensors do, when called.
"""

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
from .drivers.prepare import rules_for
from .drivers.prepared import Prepared
from .sharding import layout_for, parse_mesh, read_layout
from .sharding.placements import LayoutError
from .sizes import parse_size

__version__ = "0.1.0"


def load_rules(path: str | os.PathLike, root: str | os.PathLike | None = None) -> RuleSet:
    """Read, parse and statically check a rule file and everything it includes, its format calls
    against the formats registered now.

    Args:
        path: a .remap file, or the name of a shipped one (`qwen3_moe`; `remapdsl rules` lists them).
        root: the folder includes may not leave (default: the file's folder).
    """
    rules = _load_rules(path, root)
    _check_formats(rules)
    return rules


def parse_rules(rules: str | os.PathLike) -> _ir.RuleFile:
    """One rule file parsed, its includes not followed nor anything checked: its statements with
    their comments, as `format_rules` prints them back (a path, or a shipped name)."""
    return _parse_file(_resolve_rules_path(rules))


def choose_rules(checkpoint: str | os.PathLike | Inventory,
                 config: Mapping[str, Any] | None = None) -> tuple[ShippedRules, str]:
    """The shipped rule file that fits a checkpoint (what `rules="auto"` loads), and why, in words.

    Args:
        checkpoint: a checkpoint folder (or its index or .safetensors file, a snapshot, an Inventory).
        config: the model config; by default the checkpoint's config.json. Matched by `model_type`,
            else `architectures`, then `quantization_config.quant_method` (E147 when none fits).
    """
    return _choose_rules(config_of(checkpoint) if config is None else config)


def open_checkpoint(checkpoint: str | os.PathLike | Inventory) -> Inventory:
    """The inventory of a checkpoint folder (headers, index and config.json; no tensor data), of a snapshot
    file (`write_snapshot`; a `SnapshotInventory`, which carries its config), or the one given."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    return open_snapshot(checkpoint) if is_snapshot(checkpoint) else open_inventory(checkpoint)


def write_snapshot(checkpoint: str | os.PathLike | Inventory, path: str | os.PathLike) -> str:
    """Write a checkpoint's (folder, index or `.safetensors` file, snapshot, Inventory) headers, index and
    config.json, without its data, to `path` (by convention `*.headers.json`) as a small deterministic JSON file
    that `open_checkpoint`, `compile_rules`, `explain` and `plan_rank` accept in place of the folder; returns
    the text written."""
    return _write_snapshot(checkpoint, path)


def compile_rules(rules: str | os.PathLike | RuleSet, checkpoint: str | os.PathLike | Inventory,
                  config: Mapping[str, Any] | None = None, *, strict: bool = True) -> Compiled:
    """Compile a rule file against a checkpoint's headers: the blocks that tile every runtime tensor.

    Args:
        rules: a .remap file path, a shipped name (`qwen3_moe`), `"auto"` (the shipped file that fits
            the checkpoint's config.json: `choose_rules`) or a RuleSet from `load_rules`.
        checkpoint: a checkpoint folder, a snapshot file (or either's Inventory).
        config: the model config; by default the checkpoint's config.json ({} when there is none).
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
    """
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

    layout = layout.resolved(checkpoint_config(inventory) if config is None else config)
    return make_load_plan(compiled, inventory, held_by_layout(compiled, layout, mesh, rank), rank)


def prepare(rules, checkpoint, *, config: Mapping[str, Any] | None = None, strict: bool = True, timeout=None):
    """Every rank: read a checkpoint's headers and compile the rules once, for many loads, saves, exports and
    ingests of one job; returns a `Prepared` the caller keeps (in memory: nothing is written).

    `prepared.load(...)`, `.save(...)`, `.export(...)` and `.ingest(...)` take the arguments of the functions of
    the same names, less the rules, the checkpoint (their `like`) and the config. Each call first checks on every
    rank that the rule files and the checkpoint's files are unchanged (else every rank prepares again), and
    reuses this rank's earlier plans. The arguments are `load`'s (a save of a checkpoint holding tensors no rule
    reads needs strict=False); no checkpoint is E418.
    """
    from .drivers.prepared import prepare as _prepare

    require_data(checkpoint, "a prepared load")
    if checkpoint is None:
        raise RemapError(Diagnostic(code="E418", message="prepare needs the checkpoint the calls load from, or "
                                    "save, export and ingest in the layout of (their `like`)",
                                    hint="a save without `like` derives its layout from the tensors: call "
                                    "`remapdsl.save` itself, or prepare with the folder it wrote"))
    return _prepare(rules_for(rules, checkpoint, config), checkpoint, config=config, strict=strict, timeout=timeout)


def load(state_dict, checkpoint, rules, *, config: Mapping[str, Any] | None = None, strict: bool = True,
         layout=None, mesh=None, read_replicated_once: bool = False, timeout=None, staging_bytes: int | None = None,
         local: Mapping[str, Any] | None = None):
    """Fill existing tensors in place from a checkpoint, through a rule file; returns a LoadReport.

    In a torch.distributed job every rank calls it: rank 0 reads the headers and shares them, the ranks check
    they compiled alike, and each reads only its own shards' bytes. An error on any rank is raised on every rank.

    Args:
        state_dict: runtime key -> tensor (or a torch.nn.Module). DTensors are loaded per their placements;
            plain tensors are whole, or this rank's shard under `layout`. `compile_rules(...).empty_state_dict()`
            makes one.
        checkpoint: a checkpoint folder (or its Inventory).
        rules: a .remap file path, a shipped name (`qwen3_moe`), `"auto"` (chosen from the checkpoint's
            config.json and logged on the `remapdsl` logger) or a RuleSet.
        config: the model config; by default the folder's config.json.
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
        layout: a `remapdsl.sharding.LayoutPlan` placing plain tensors on `mesh` (tp_plan style).
        mesh: the `remapdsl.sharding.Mesh` of the job, with `layout`.
        read_replicated_once: tensors every rank holds whole are read by rank 0 and broadcast.
        timeout: how long this rank waits at any one exchange for the others (seconds or a `datetime.timedelta`;
            default 300 s, apart from the process group's own); a rank that does not arrive is named (E415).
        staging_bytes: the most host memory pinned to copy into CUDA tensors (reusable 2 MiB buffers for each
            of two reader threads; default 16 MiB in all); CPU tensors are read into directly.
        local: this rank's local names -> the global runtime names, as data: templates with one `{}` (the
            number) and their offsets, `{"decoder.layers.{}": stage_offset}` (Megatron-Core's numbering of a
            pipeline stage's layers or an expert-parallel rank's experts; docs/distributed.md).
    """
    from .drivers.prepared import prepare as _prepare

    require_data(checkpoint, "a load")
    prepared = _prepare(rules_for(rules, checkpoint, config), checkpoint, config=config, strict=strict,
                        timeout=timeout, watched=False)
    return prepared.load(state_dict, layout=layout, mesh=mesh, read_replicated_once=read_replicated_once,
                         timeout=timeout, staging_bytes=staging_bytes, local=local)


def save(state_dict, folder, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None,
         mesh=None, overwrite: bool = False, allow_lossy: bool = False, requantize: bool = False,
         dropped: str = "error", max_shard_size: int | str = "5GB", timeout=None, local: Mapping[str, Any] | None = None):
    """Write runtime tensors back to the checkpoint layout `like` through the rules that load it, every rank
    its own bytes (no gather); returns a SaveReport.

    Args:
        state_dict: runtime key -> tensor (or a torch.nn.Module); DTensors are written per their placements,
            plain tensors are whole or this rank's shard under `layout`.
        folder: the output checkpoint folder (created; it must not exist unless `overwrite`).
        rules: a .remap file path, a shipped name, `"auto"` (from `like`) or a RuleSet: the rules that load
            `like` into this layout.
        like: the checkpoint (folder or Inventory) whose keys, files, headers and index the output takes: an
            unchanged model saves to byte-identical files. None: the layout is derived from the rules, the
            config and the tensors' global shapes (E520 where they do not determine it), in Hugging Face
            shards with an index past one file (docs/saving.md#without-like).
        config: the model config; by default `like`'s config.json (without `like`: none, and no config.json
            is written).
        layout, mesh: as for `load`.
        overwrite: replace an existing folder (only once the new one is complete).
        allow_lossy: write back tensors that the rules read through a cast that loses values.
        requantize: write dequantized tensors with new scales computed from their values (fp8_block: amax /
            448 per block), not the stored ones; each block must be whole on one rank.
        dropped: what becomes of the checkpoint tensors the rules `drop` (`rotary_emb.inv_freq`): `"error"`
            (the default) refuses the save (E501); `"copy"` copies them unchanged from `like` (an unchanged
            model still saves byte-identical files); `"omit"` leaves them out of the files, headers and index
            (a file left empty is not written).
        max_shard_size: without `like`: start a new output file past this size (bytes, or a text such as
            "5GB" or "2GiB", as for `save_pretrained`).
        timeout, local: as for `load`.
    """
    from .drivers.save import save as _save

    require_data(like, "a save (`like`)")
    return _save(None, state_dict, folder, rules=rules_for(rules, like, config), like=like, config=config,
                 layout=layout, mesh=mesh, overwrite=overwrite, allow_lossy=allow_lossy, requantize=requantize,
                 dropped=dropped, max_shard_size=max_shard_size, timeout=timeout, local=local)


def export(state_dict, rules, *, like=None, config: Mapping[str, Any] | None = None, gather=(),
           bucket_bytes: int = 256 << 20, layout=None, mesh=None, allow_lossy: bool = False, regions: bool = False,
           by_round: bool = False, timeout=None, local: Mapping[str, Any] | None = None):
    """The checkpoint layout of a sharded runtime state dict, in memory: an iterator of (checkpoint key,
    tensor) pairs, each a whole checkpoint tensor, for weight sync without files.

    Run on every rank, to the end (its steps are collectives). Each checkpoint key is yielded by exactly one
    rank holding its bytes, which assembles it from the others' pieces; those may differ only on the mesh dims
    named in `gather` (E541). A rank holds its shards plus about one bucket of tensors (docs/export.md).

    Args:
        state_dict: runtime key -> tensor or DTensor (or a torch.nn.Module), as for `save`.
        rules: the rules that load the checkpoint layout into this one (a path, a shipped name, a RuleSet).
        like: the checkpoint whose layout to stream; None: derived, as a save without `like` does.
        config: the model config (sizes the rules read; by default `like`'s config.json).
        gather: the mesh dims over which a checkpoint tensor's pieces are assembled: `("dp_shard",)` assembles
            FSDP shards and keeps EP shards local; `()` moves nothing (each tensor whole on one rank).
        bucket_bytes: the most bytes of tensors a rank assembles in one round (a larger tensor is a round of
            its own).
        layout, mesh: as for `load`, for plain local shards.
        allow_lossy: as for `save`.
        regions: yield `(key, offsets, tensor)` instead: each box of a checkpoint tensor this rank holds and
            no lower rank does (the bytes a save would have it write), no communication; a piece that is no
            box (rows strided by a rope order) is E549.
        by_round: yield one list of (key, tensor) pairs per round instead: the tensors this rank assembled in
            that round (an empty list where it assembled none), the same number of lists on every rank, so a
            consumer may run its own collective once a round (a transport to engine ranks that need parts of
            every tensor: bench/weight_sync_bench.py); not with `regions` (E542).
        timeout, local: as for `load`.
    """
    from .drivers.export import export as _export

    require_data(like, "an export (`like`)")
    return _export(None, state_dict, rules=rules_for(rules, like, config), like=like, config=config, gather=gather,
                   bucket_bytes=bucket_bytes, layout=layout, mesh=mesh, allow_lossy=allow_lossy, regions=regions,
                   by_round=by_round, timeout=timeout, local=local)


def ingest(state_dict, pairs, rules, *, like=None, config: Mapping[str, Any] | None = None, layout=None,
           mesh=None, timeout=None, staging_bytes: int | None = None, local: Mapping[str, Any] | None = None):
    """Fill a runtime state dict in place from (checkpoint key, tensor) pairs, through the rules: the mirror of
    `export`, a load from memory instead of files. Returns an IngestReport.

    Every rank is given the same pairs (a dict, or an iterable such as a stream from another process, read
    once) and takes only the bytes of its own part. A pair the rules do not read (E545), of another shape or
    dtype (E546), given twice (E548), or a tensor the rank needs that never came (E547) fails every rank
    together, at the end.

    Args:
        state_dict: runtime key -> tensor or DTensor (or a torch.nn.Module), filled in place.
        pairs: checkpoint key -> tensor, or an iterable of (key, tensor).
        rules: as for `load`.
        like: the checkpoint whose layout the pairs are in (its headers only); None: derived from the state
            dict's shapes, as a save without `like` does.
        config, layout, mesh, timeout, staging_bytes, local: as for `load`.
    """
    from .drivers.ingest import ingest as _ingest

    require_data(like, "an ingest (`like`)")
    return _ingest(None, state_dict, pairs, rules=rules_for(rules, like, config), like=like, config=config,
                   layout=layout, mesh=mesh, timeout=timeout, staging_bytes=staging_bytes, local=local)


def convert(src, dst, rules, *, reverse: bool = False, like=None, max_shard_bytes: int = 5 * 10**9,
            budget_bytes: int = 1 << 30, overwrite: bool = False, progress=None, dropped: str = "error",
            timeout=None):
    """Convert checkpoint `src` into `dst` through `rules`, offline, in batches, on any number of ranks:
    into the runtime layout the rules make (Hugging Face shards), or with `reverse` back; returns a
    ConvertReport.

    Args:
        rules: a .remap file path, a shipped name, `"auto"` (from `src`, or `like` when reversing) or a RuleSet.
        reverse: `src` is in the runtime layout; write `like`'s layout, or without `like` the one the rules,
            `src`'s config.json and its shapes determine (as `save` derives it).
        max_shard_bytes: forward, or reverse without `like`: start a new output file past this size.
        budget_bytes: runtime tensors held at once by a rank (a larger tensor is held alone).
        overwrite: replace an existing `dst` (only once the new one is complete).
        progress: called with (bytes done, bytes in all) on this rank after each batch.
        dropped: reverse only: `"error"`, `"copy"` or `"omit"` for the tensors of `like` the rules
            drop, as for `save`.
        timeout: as for `load`.
    """
    from .drivers.convert import convert as _convert

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
