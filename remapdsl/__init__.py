"""remapdsl: one declarative rule file -> exact, sharded loads and saves of model checkpoints.

The public API: short drivers over stages that are plain functions from frozen data to frozen
data (docs/architecture.md). Importing it does not import torch; `load` does, when called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import (
    BindError,
    CheckpointError,
    Diagnostic,
    RemapError,
    RuleCheckError,
    RuleSyntaxError,
    Span,
)
from .checkpoint import Inventory, open_inventory
from .compile import Compiled, compile_rules
from .compile.explain import explain
from .language.formatter import format_rules
from .gcpause import paused_gc
from .language.parser import parse_file, parse_text
from .runtime.prepare import compile_digest, compile_everywhere, read_config
from .language.includes import RuleSet, load_rules, rules_from_text

__version__ = "0.1.0"


def open_checkpoint(checkpoint: str | os.PathLike | Inventory) -> Inventory:
    """The inventory of a checkpoint folder (headers only), or the one given."""
    return checkpoint if isinstance(checkpoint, Inventory) else open_inventory(checkpoint)


def parse_mesh(text: str):
    """`dp=2,tp=4` -> a Mesh (outermost dim first); a malformed text is a RemapError."""
    from .sharding.placements import Mesh

    dims = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise RemapError(Diagnostic(code="E409", message=f"bad mesh `{text}`: write dims as "
                                        "`name=size` separated by commas, e.g. `dp=2,tp=4`"))
        dims[name.strip()] = int(size)
    return Mesh.of(dims)


def read_layout(path: str | os.PathLike):
    """A layout plan from JSON: {"mesh_dim": "tp", "plan": {glob: style or [placements]}}."""
    from pydantic import ValidationError

    from .sharding.placements import LayoutPlan, Replicate, Shard, StridedShard

    kinds = {"shard": Shard, "replicate": Replicate, "strided_shard": StridedShard}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        plan = {glob: value if isinstance(value, str) else
                [kinds[p.pop("kind")](**p) for p in value] for glob, value in data["plan"].items()}
        return LayoutPlan.from_mapping(plan, mesh_dim=data.get("mesh_dim", "tp"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
        if isinstance(exc, RemapError):
            raise
        raise RemapError(Diagnostic(code="E409", path=str(path), message=f"cannot read the layout: {exc}",
                                    hint='expected {"mesh_dim": "tp", "plan": {"*.q_proj": "colwise"}}')) from None


def plan_rank(compiled: Compiled, inventory: Inventory, layout, mesh, rank: int):
    """The LoadPlan of one rank under a layout plan, without a process group or tensors."""
    from .sharding.plans import held_by_layout, make_load_plan

    return make_load_plan(compiled, inventory, held_by_layout(compiled, layout, mesh, rank), rank)


def load(target, checkpoint, rules, *, config: Mapping[str, Any] | None = None,
         strict: bool = True, layout=None, mesh=None, read_replicated_once: bool = False):
    """Fill existing tensors in place from a checkpoint, through a rule file; returns a LoadReport.

    In a torch.distributed job every rank calls it: rank 0 reads the headers once and shares them,
    the ranks check that they compiled the same rules against the same checkpoint, and each reads
    only the bytes of its own shards. An error on any rank is raised on every rank.

    Args:
        target: a state dict (runtime key -> tensor) or a torch.nn.Module. DTensors are loaded per
            their placements; plain tensors are whole, or this rank's shard under `layout`.
        checkpoint: a checkpoint folder (or its Inventory).
        rules: a .remap file path (or a RuleSet).
        config: the model config; by default the folder's config.json.
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
        layout: a `remapdsl.sharding.placements.LayoutPlan` placing plain tensors on `mesh` (tp_plan style).
        mesh: the `remapdsl.sharding.placements.Mesh` of the job, with `layout`.
        read_replicated_once: tensors that every rank holds whole are read by rank 0 and broadcast,
            instead of read by every rank.
    """
    with paused_gc():
        return _load(target, checkpoint, rules, config, strict, layout, mesh, read_replicated_once)


def _load(target, checkpoint, rules, config, strict, layout, mesh, read_replicated_once):
    from .runtime import dist
    from .runtime.execute import run_sharded_load

    inventory, compiled = compile_everywhere(rules, checkpoint, config, strict)
    # Each rank's shards: plan, then read.
    tensors = target.state_dict(keep_vars=True) if hasattr(target, "state_dict") else target
    report, shared = dist.together(lambda: run_sharded_load(
        compiled, inventory, tensors, layout, mesh, dist.rank(), read_replicated_once and dist.active()))
    dist.broadcast_from_first(shared)  # after every rank's reads succeeded, so none waits in vain
    return report


def save(source, folder, rules, *, like=None, **kwargs):
    """Write runtime tensors back to a checkpoint's layout, every rank its own bytes (no gather);
    see `remapdsl.runtime.save.save` for the arguments."""
    from .runtime.save import save as _save

    return _save(source, folder, rules, like=like, **kwargs)


__all__ = [
    "BindError",
    "Compiled",
    "Inventory",
    "compile_digest",
    "compile_everywhere",
    "compile_rules",
    "explain",
    "load",
    "save",
    "open_checkpoint",
    "parse_mesh",
    "plan_rank",
    "read_layout",
    "read_config",
    "CheckpointError",
    "Diagnostic",
    "RemapError",
    "RuleCheckError",
    "RuleSet",
    "RuleSyntaxError",
    "Span",
    "format_rules",
    "load_rules",
    "parse_file",
    "parse_text",
    "rules_from_text",
]
