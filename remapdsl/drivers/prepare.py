"""What every entry point does before it touches tensor data: rank 0's headers shared, the model config, and
the rules compiled identically on every rank, the ranks agreeing; a failure on any rank fails every rank."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..checkpoint import Inventory, open_inventory, read_config
from ..checkpoint.snapshot import config_of
from ..compile import Compiled, compile_rules
from ..errors import BindError, Diagnostic, RemapError, shorten
from ..language.includes import RuleSet, load_rules, rule_texts
from ..language.library import AUTO, choose_rules
from ..sharding import LayoutPlan, Mesh

MAX_LISTED = 5  # differences listed per aspect when ranks disagree; the rest counted


def compile_digest(ruleset: RuleSet, config: Mapping[str, Any], strict: bool, checkpoint=None) -> str:
    """sha256 of what a compile depends on: the rule files' text, the config, strictness, and the checkpoint
    this process was given (a path: its files' names and sizes, so a rank given another one is caught)."""
    digest = hashlib.sha256()
    for value in _digests(_inputs(rule_texts(ruleset), config, strict, checkpoint)).values():
        digest.update(value.encode())
    return digest.hexdigest()


def _inputs(texts: list[tuple[str, str]], config, strict: bool, checkpoint) -> dict[str, Any]:
    """What one rank compiled from, by aspect: what the ranks compare, and describe when they differ."""
    from ..checkpoint.inventory import listing

    if isinstance(checkpoint, Inventory):
        seen = checkpoint.model_dump_json(exclude={"files": {"__all__": {"mtime_ns"}}})  # times differ by copy
    elif checkpoint is None or not os.path.exists(checkpoint):  # listed as the folder above it otherwise
        seen = None if checkpoint is None else [f"{os.path.basename(os.path.abspath(checkpoint))} (missing)", []]
    else:
        seen = listing(checkpoint)
    return {"rule files": texts, "config": config, "strict mode": strict, "checkpoint": seen}


def _digests(aspects: dict[str, Any]) -> dict[str, str]:
    """Each aspect hashed; rule files by their text only (their paths are shown, not compared)."""
    return {aspect: _sha([text for _, text in value] if aspect == "rule files" else value)
            for aspect, value in aspects.items()}


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def header_digests(inventory: Inventory) -> dict[str, str]:
    """Each of the inventory's files -> sha256 of its first `data_offset` bytes (length prefix and header) as
    this process reads them, or why it cannot be read (the ranks disagree unless all fail alike)."""
    from ..checkpoint.header import hash_header

    out = {}
    for name, info in inventory.files.items():
        try:
            out[name] = hash_header(inventory.path(name), info.data_offset)
        except OSError as exc:
            out[name] = f"cannot be read ({exc.strerror})"
    return out


def rules_for(rules, checkpoint, config: Mapping[str, Any] | None = None):
    """`auto` -> the path of the shipped file that fits the checkpoint (logged on the `remapdsl`
    logger); anything else as given (a path, a shipped name or a RuleSet: load_rules resolves names)."""
    if isinstance(rules, RuleSet) or os.fspath(rules) != AUTO or Path(AUTO).is_file() or checkpoint is None:
        return rules  # `auto` without a checkpoint: load_rules explains (E148)
    chosen, reason = choose_rules(config_of(checkpoint) if config is None else config)
    logging.getLogger("remapdsl").info("rules auto: chose %s (%s)", chosen.name, reason)
    return chosen.path


class Ready(NamedTuple):
    """What every rank has before it touches tensor data."""

    inventory: Inventory  # rank 0's headers, with this rank's own files' modification times
    compiled: Compiled
    rules: RuleSet  # the rules compiled (their files: `rule_texts`)
    config: Mapping[str, Any]  # the model config the rules compiled with

    def placing(self, layout):
        """`layout` with the config's values for the config keys its packed placements name (None: None)."""
        return None if layout is None else check_kind(layout, "layout").resolved(self.config)


def prepare_everywhere(rules, checkpoint, config=None, strict: bool = True,
                       check: Callable[[], None] | None = None, on_disk: bool = True) -> Ready:
    """Every rank: rank 0's headers of `checkpoint` shared, then the rules compiled; the ranks compare digests
    of the compile's inputs and of each file's header bytes (E410). `check` (the caller's checks of its
    arguments) runs first, on every rank. `on_disk=False`: an Inventory of files not written yet."""
    from ..runtime import dist  # torch is imported only here

    check = check or (lambda: None)

    def first() -> Inventory:
        check()
        return checkpoint if isinstance(checkpoint, Inventory) else open_inventory(checkpoint)

    # always one broadcast (an Inventory given too): every rank makes the same collectives
    inventory = dist.from_first(first, "reading the checkpoint's headers")

    def prepare() -> tuple[Ready, dict[str, Any]]:  # and what the ranks compare
        check()
        ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
        given = read_config(inventory) if config is None else config
        # a rank that did not read the headers reads its own copy, checked against that copy's times
        own = inventory if dist.rank() == 0 or isinstance(checkpoint, Inventory) else inventory.restamped(checkpoint)
        # hashed after the times were taken: a later change is E342 at the data reads, an earlier
        # one is in these bytes; only in a job (one process has nothing to compare them with)
        headers = header_digests(own) if dist.world_size() > 1 and on_disk else {}
        compiled = compile_rules(ruleset, inventory, given, strict=strict)
        aspects = _inputs(rule_texts(ruleset), given, strict, checkpoint)
        return Ready(own, compiled, ruleset, given), {**aspects, "file headers": headers}

    agreement = dist.Agreement("compiled rules and checkpoint", lambda r: _digests(r[1]),
                               lambda r, aspect: r[1][aspect], explain_difference)
    return dist.together(prepare, agree_on=agreement, phase="compiling")[0]


def explain_difference(aspect: str, details: dict[int, Any]) -> list[str]:
    """How each rank's `aspect` differs from the first rank's (`details`: the first rank of each version ->
    its detail)."""
    def found(ours, theirs) -> list[str]:
        if aspect == "rule files":
            return _rules_difference(ours, theirs)
        if aspect == "config":
            return _mapping_difference(ours, theirs, "config key", _show)
        if aspect == "checkpoint":
            return _checkpoint_difference(ours, theirs)
        if aspect == "file headers":
            return [f"file {_show(name)}: header bytes {_digest_text(ours.get(name))} vs "
                    f"{_digest_text(theirs.get(name))}" for name in sorted(set(ours) | set(theirs))
                    if ours.get(name) != theirs.get(name)]
        return [f"{_show(ours)} vs {_show(theirs)}"]

    (base, ours), *others = details.items()
    out: list[str] = []
    for r, theirs in others:
        pair = f"rank {base} vs rank {r}: "
        out += _capped([pair + s for s in found(ours, theirs)], pair, "difference")
    return out


def _capped(lines: list[str], prefix: str, noun: str) -> list[str]:
    """The first MAX_LISTED lines, the rest counted (`{prefix}and 3 more {noun}s`)."""
    more = len(lines) - MAX_LISTED
    return lines[:MAX_LISTED] + ([f"{prefix}and {more} more {noun}{'s' if more > 1 else ''}"] if more > 0 else [])


def _show(value) -> str:
    return f"`{shorten(json.dumps(value, default=str) if not isinstance(value, str) else value, 60)}`"


def _digest_text(digest: str | None) -> str:
    """`sha256 1a2b3c4d5e6f`, or why the file could not be read."""
    if digest is None:
        return "missing"
    return digest if digest.startswith("cannot") else f"sha256 {digest[:12]}"


def _rules_difference(ours: list, theirs: list) -> list[str]:
    """The first line that differs in each rule file, by position (the top-level file first)."""
    out = []
    for (path, text), (other_path, other_text) in zip(ours, theirs):
        if text == other_text:
            continue
        if path != other_path:
            out.append(f"rule file {_show(path)} vs {_show(other_path)}")
        a, b = text.splitlines(), other_text.splitlines()
        line = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        left = _show(a[line].strip()) if line < len(a) else "no such line"
        right = _show(b[line].strip()) if line < len(b) else "no such line"
        out.append(f"{_show(path)} line {line + 1}: {left} vs {right}")
    for path, _ in ours[len(theirs):]:
        out.append(f"rule file {_show(path)} only on the first")
    for path, _ in theirs[len(ours):]:
        out.append(f"rule file {_show(path)} only on the second")
    return out


def _mapping_difference(ours: Mapping, theirs: Mapping, what: str, show: Callable[[Any], str]) -> list[str]:
    """`what `key`: ours vs theirs` for each key whose value differs, or that one side lacks."""
    def value(side: Mapping, key) -> str:
        return show(side[key]) if key in side else "missing"

    return [f"{what} {_show(str(key))}: {value(ours, key)} vs {value(theirs, key)}"
            for key in sorted(set(ours) | set(theirs), key=str)
            if key not in ours or key not in theirs or _sha(ours[key]) != _sha(theirs[key])]


def _checkpoint_difference(ours, theirs) -> list[str]:
    """Folder names, then each safetensors file missing on one side or of another size."""
    if not (isinstance(ours, list) and isinstance(theirs, list)):
        return [f"checkpoint {_show(ours)} vs {_show(theirs)}"]
    out = [f"checkpoint folder {_show(ours[0])} vs {_show(theirs[0])}"] if ours[0] != theirs[0] else []
    return out + _mapping_difference(dict(map(tuple, ours[1])), dict(map(tuple, theirs[1])), "file",
                                     lambda n: f"{n} B")


def tensors_of(state_dict, local=None) -> Mapping[str, Any]:
    """A state dict's tensors (a module's parameters and buffers as they are, not detached), under their
    global names (`local`: this rank's renumbering, sharding/local_names.py)."""
    from ..sharding.local_names import global_names

    tensors = state_dict.state_dict(keep_vars=True) if hasattr(state_dict, "state_dict") else state_dict
    return global_names(check_kind(tensors, "state_dict"), local)


def named_together(state_dict, local) -> Mapping[str, Any]:
    """`tensors_of` on every rank together (a rank's E419 raised on every rank)."""
    from ..runtime import dist

    return dist.together(lambda: tensors_of(state_dict, local), phase="naming the tensors")


def check_mesh(mesh, alone: str | None = None) -> None:
    """E414 unless a mesh given with a layout has as many ranks as the group. Run inside a phase, on every rank.
    One process may hold rank 0's part of a larger mesh, unless the call needs every rank's (`alone`: why, the
    hint)."""
    from ..runtime import dist

    if mesh is None or check_kind(mesh, "mesh").size == dist.world_size() or not (dist.active() or alone):
        return
    hint = alone if not dist.active() else "the product of the mesh's sizes must be the job's world size " \
        "(`torch.distributed.get_world_size()`): give the job's own mesh"
    raise RemapError(Diagnostic(code="E414", message=f"the mesh {_mesh_text(mesh)} has {mesh.size} ranks; this job "
                                f"has {dist.world_size()}", hint=hint))


_CHECKPOINT = ((str, os.PathLike, Inventory), "a checkpoint folder's path")
_FOLDER = ((str, os.PathLike), "a folder's path")
_KINDS = {"layout": (LayoutPlan, "a LayoutPlan (`remapdsl.read_layout(path)`, `LayoutPlan.from_mapping(...)`)"),
          "mesh": (Mesh, "a Mesh (`remapdsl.parse_mesh(\"tp=2\")`, `Mesh.of({\"tp\": 2})`)"),
          "state_dict": (Mapping, "a mapping of names to tensors (`model.state_dict()`, or the module itself)"),
          "progress": (Callable, "a function of (bytes done, bytes in all)"),
          "checkpoint": _CHECKPOINT, "src": _CHECKPOINT, "folder": _FOLDER, "dst": _FOLDER,
          "like": ((*_CHECKPOINT[0], type(None)), "a checkpoint folder's path, or None"),
          "rules": ((str, os.PathLike, RuleSet), "a rule file's path, a shipped name (`\"qwen3_moe\"`) or a RuleSet"),
          "config": ((Mapping, type(None)), "a mapping of config keys to values, or None"),
          "gather": (Iterable, "a tuple of mesh dim names"),
          "pairs": (Iterable, "a mapping or an iterable of (checkpoint key, tensor) pairs"),
          **dict.fromkeys(("strict", "read_replicated_once", "overwrite", "allow_lossy", "requantize", "regions",
                           "by_round", "reverse"), (bool, "True or False"))}


def check_kind(value, argument: str):
    """`value`, or E416 naming `argument` where it is of another kind (a string for a mesh, a list for a state
    dict, "no" for a flag)."""
    kind, wanted = _KINDS[argument]
    if isinstance(value, kind):
        return value
    name = type(value).__name__
    given = "None" if value is None else f"an {name}" if name[0] in "aeiou" else f"a {name}"
    raise RemapError(Diagnostic(code="E416", message=f"{argument}= is {given}, not {wanted}"))


def check_kinds(**arguments) -> None:
    """E416 for the first of the named arguments that is of another kind than check_kind's for its name."""
    for argument, value in arguments.items():
        check_kind(value, argument)


def _mesh_text(mesh) -> str:
    return "`" + ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes)) + "`"


class HeldTogether:
    """What the ranks check together about what they hold, on one phase's exchange (`joint()`): every
    runtime tensor held by some rank (E230), placed alike by every rank that holds it, one `mesh` (E410).
    `holders` then says which rank holds what where some rank holds only part (pipeline stages), else None."""

    def __init__(self, compiled, holding_of: Callable[[Any], Any], mesh=None,
                 read_once: Callable[[Any], list[str]] | None = None):
        self.keys = [d.runtime_key for d in compiled.runtime_tensors]
        self.index = {key: i for i, key in enumerate(self.keys)}  # a tensor's bit in a rank's part
        self.holding_of, self.mesh, self.read_once = holding_of, mesh, read_once
        self.holders = None

    def joint(self):
        from ..runtime import dist

        return dist.Joint(self.part, self.check)

    def part(self, result) -> tuple[str, dict[str, int], int]:
        """The mesh given (a malformed one fails here, in the phase), per placement the tensors this rank
        holds so (bits of their positions), and those `read_once` names (`read_replicated_once`)."""
        index = self.index
        shown: dict[int, str] = {}  # tensors of one spec share their Placed: described once
        placed: dict[str, int] = {}
        for key, p in self.holding_of(result).placed.items():
            text = shown.get(id(p))
            if text is None:
                text = shown[id(p)] = f"mesh {list(p.sizes)} {', '.join(map(_placement, p.placements)) or 'whole'}"
            placed[text] = placed.get(text, 0) | 1 << index[key]
        once = sum(1 << index[key] for key in self.read_once(result)) if self.read_once else 0
        return ("none" if self.mesh is None else _mesh_text(self.mesh)), placed, once

    def check(self, parts: list[tuple[str, dict[str, int], int]]) -> None:
        from ..runtime.bounds import ranks_text
        from ..sharding.holdings import Holders

        lines = _placement_lines(self.keys, parts) + _mesh_lines(parts)
        differ = [r for r, part in enumerate(parts) if part[2] != parts[0][2]]
        if differ:  # rank 0 would read tensors for ranks that do not hold them, or miss some
            lines.append(f"read_replicated_once: the tensors every rank holds whole differ on "
                         f"{ranks_text(differ)} from rank 0's (each rank must hold the same ones)")
        if lines:
            raise RemapError(Diagnostic(
                code="E410", message="ranks disagree on the tensor layouts:\n" + "\n".join(lines),
                hint="every rank that holds a tensor must place it alike (the same layout plan and mesh, or "
                     "DTensors of one mesh and the same placements)"))
        held = [functools.reduce(operator.or_, placed.values(), 0) for _, placed, _ in parts]
        every = (1 << len(self.keys)) - 1
        missing = every & ~functools.reduce(operator.or_, held, 0)
        if missing:
            keys = [self.keys[i] for i in _bits(missing)]
            shown = ", ".join(f"`{k}`" for k in keys[:MAX_LISTED]) + (
                f" (and {len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else "")
            raise BindError(Diagnostic(
                code="E230", message=f"the rules produce {len(keys)} runtime tensor{'s' if len(keys) > 1 else ''} "
                f"that no rank holds: {shown}",
                hint="each runtime tensor must be in the state dict of at least one rank (a pipeline stage "
                     "holds its layers, the stages together the whole model)"))
        if any(h != every for h in held):
            self.holders = Holders(held, self.index)


def _bits(value: int) -> Iterator[int]:
    """The positions of the bits set in `value`, lowest first."""
    while value:
        low = value & -value
        yield low.bit_length() - 1
        value ^= low


def _placement_lines(keys: list[str], parts) -> list[str]:
    """`rank a vs rank b: tensor `k`: `placement` vs `placement``, for the tensors two ranks place
    differently (MAX_LISTED of them; the rest counted)."""
    union: dict[str, int] = {}
    for _, placed, _ in parts:
        for text, bits in placed.items():
            union[text] = union.get(text, 0) | bits
    lines, more = [], 0
    for a, b in itertools.combinations(sorted(union), 2):
        for i in _bits(union[a] & union[b]):
            if len(lines) == MAX_LISTED:
                more += 1
                continue
            ra = next(r for r, part in enumerate(parts) if part[1].get(a, 0) >> i & 1)
            rb = next(r for r, part in enumerate(parts) if part[1].get(b, 0) >> i & 1)
            (ra, a_text), (rb, b_text) = sorted([(ra, a), (rb, b)])
            lines.append(f"  rank {ra} vs rank {rb}: tensor `{keys[i]}`: `{a_text}` vs `{b_text}`")
    if more:
        lines.append(f"  and {more} more tensor{'s' if more > 1 else ''}")
    return ["layout: tensors placed differently by different ranks", *lines] if lines else []


def _mesh_lines(parts) -> list[str]:
    """Each rank whose `mesh` argument differs from rank 0's, as `rank 0 vs rank r: mesh A vs B`."""
    first = parts[0][0]
    lines = [f"  rank 0 vs rank {r}: mesh {first} vs {part[0]}" for r, part in enumerate(parts) if part[0] != first]
    return ["mesh: ranks given different meshes", *_capped(lines, "  ", "rank")] if lines else []


def _placement(placement) -> str:
    """`Shard(0)`, `Replicate()`, `StridedShard(0, 2)`: a placement with its values, for a message."""
    values = [str(v) for k, v in placement if k != "kind"] if hasattr(placement, "model_fields") else [repr(placement)]
    return f"{type(placement).__name__}({', '.join(values)})"
