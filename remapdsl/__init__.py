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
from .explain import explain
from .format import format_rules
from .parse import parse_file, parse_text
from .rules import RuleSet, load_rules, rules_from_text

__version__ = "0.1.0"


def open_checkpoint(checkpoint: str | os.PathLike | Inventory) -> Inventory:
    """The inventory of a checkpoint folder (headers only), or the one given."""
    return checkpoint if isinstance(checkpoint, Inventory) else open_inventory(checkpoint)


def read_config(inventory: Inventory) -> dict[str, Any]:
    """The model config next to a checkpoint (config.json), or {} when there is none."""
    path = Path(inventory.root) / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RemapError(Diagnostic(code="E212", message=f"cannot read the model config: {exc}",
                                    path=str(path))) from None


def load(target, checkpoint, rules, *, config: Mapping[str, Any] | None = None,
         strict: bool = True):
    """Fill existing tensors in place from a checkpoint, through a rule file; returns a LoadReport.

    Args:
        target: a state dict (runtime key -> tensor) or a torch.nn.Module.
        checkpoint: a checkpoint folder (or its Inventory).
        rules: a .remap file path (or a RuleSet).
        config: the model config; by default the folder's config.json.
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
    """
    from .execute import run_load  # torch is imported only here

    # Rules, checkpoint headers and config: all checked before any tensor byte is read.
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    inventory = open_checkpoint(checkpoint)
    config = read_config(inventory) if config is None else config
    compiled = compile_rules(ruleset, inventory, config, strict=strict)
    # The model's tensors, then the reads.
    tensors = target.state_dict(keep_vars=True) if hasattr(target, "state_dict") else target
    return run_load(compiled, inventory, tensors)

__all__ = [
    "BindError",
    "Compiled",
    "Inventory",
    "compile_rules",
    "explain",
    "load",
    "open_checkpoint",
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
