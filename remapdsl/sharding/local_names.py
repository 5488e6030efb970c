"""A rank's local tensor names -> the global runtime names the rules make (`local=` of load, save, export,
ingest; docs/distributed.md): `{"decoder.layers.{}": 8}` makes `decoder.layers.3.x` `decoder.layers.11.x`;
a value (global template, offset) renames as well. Each template applies once per name, in order."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import Diagnostic, RemapError


def global_names(tensors: Mapping[str, Any], local: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """`tensors` under their global names; E419 for a malformed `local` or two names becoming one."""
    if not local:
        return tensors
    if not isinstance(local, Mapping):
        raise _error(f"local={local!r} is not a mapping of local name templates to offsets",
                     'for example local={"decoder.layers.{}": stage * layers_per_stage}')
    renames = [_template(pattern, value) for pattern, value in local.items()]
    out: dict[str, Any] = {}
    came_from: dict[str, str] = {}
    for name, tensor in tensors.items():
        key = name
        for pattern, make in renames:
            key = pattern.sub(make, key, count=1)
        if key in out:
            raise _error(f"local names `{came_from[key]}` and `{name}` both become `{key}`",
                         "give each local template the offset of this rank's own part (stage, chunk or experts)")
        out[key], came_from[key] = tensor, name
    return out


def _template(pattern, value) -> tuple[re.Pattern, Any]:
    """A local template as a pattern matching a name's start, and what replaces the match."""
    target, offset = value if isinstance(value, tuple) and len(value) == 2 else (pattern, value)
    for text in (pattern, target):
        if not isinstance(text, str) or text.count("{}") != 1 or "**" in text:
            raise _error(f"local template {text!r} must be a name with exactly one `{{}}` (the number)",
                         'for example "decoder.layers.{}" or "decoder.layers.*.mlp.experts.linear_fc1.weight{}"')
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise _error(f"local[{pattern!r}] = {value!r}: the offset must be an integer of 0 or more",
                     "the offset is what this rank's first local number is globally")
    if pattern.count("*") != target.count("*"):
        raise _error(f"local template {pattern!r} and its global {target!r} have different numbers of `*`",
                     "each `*` of the local name is kept in the same place of the global one")
    parts = re.split(r"(\*|\{\})", pattern)
    regex = re.compile("^" + "".join(r"([^.]+)" if part == "*" else r"([0-9]+)" if part == "{}" else re.escape(part)
                                     for part in parts) + r"(?=\.|$)")
    pieces = re.split(r"(\*|\{\})", target)
    number_at = [p for p in parts if p in ("*", "{}")].index("{}")

    def make(match: re.Match) -> str:
        groups = match.groups()
        stars = iter(g for i, g in enumerate(groups) if i != number_at)
        return "".join(str(int(groups[number_at]) + offset) if piece == "{}" else next(stars) if piece == "*"
                       else piece for piece in pieces)

    return regex, make


def _error(message: str, hint: str) -> RemapError:
    return RemapError(Diagnostic(code="E419", message=message, hint=hint))
