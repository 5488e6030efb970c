"""What every entry point does before it touches tensor data: the rules, rank 0's headers shared,
the model config, and the rules compiled identically on every rank, the ranks agreeing on it.

`load`, `save` and `convert` all start here. torch is imported only in a distributed job's path
(`remapdsl.runtime.dist`), when `compile_everywhere` runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..checkpoint import Inventory, read_config
from ..compile import Compiled, compile_rules
from ..language.includes import RuleSet, load_rules


def compile_digest(ruleset: RuleSet, config: Mapping[str, Any], strict: bool, checkpoint=None) -> str:
    """sha256 of what a compile depends on: the rule files' text, the config, strictness, and the
    checkpoint this process was given (an Inventory: all of it; a path: its name and the names and
    sizes of its safetensors files, listed without opening them, so a rank given another checkpoint
    than rank 0 is caught even though it reads rank 0's headers). Equal inputs, equal digests."""
    import hashlib

    from ..checkpoint.inventory import listing

    text = json.dumps([[f.source for f in ruleset.files], config, strict], sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode())
    if isinstance(checkpoint, Inventory):
        digest.update(checkpoint.model_dump_json().encode())
    elif checkpoint is not None:
        digest.update(json.dumps(listing(checkpoint)).encode())
    return digest.hexdigest()


def compile_everywhere(rules, checkpoint, config=None, strict: bool = True) -> tuple[Inventory, Compiled]:
    """Every rank: the rules, rank 0's headers of `checkpoint` shared, the config, compiled
    identically, before any data is read. Compiling is a pure function of its inputs, so the ranks
    compare a digest of those (cheaper than hashing what they compiled): other rules, another config
    or another checkpoint on any rank fails every rank (E410)."""
    from . import dist  # torch is imported only here

    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    inventory = dist.share_inventory(checkpoint)
    config = read_config(inventory) if config is None else config
    digest = compile_digest(ruleset, config, strict, checkpoint)
    compiled = dist.together(lambda: compile_rules(ruleset, inventory, config, strict=strict),
                             agree_on=("compiled rules and checkpoint", lambda _: digest))
    return inventory, compiled
