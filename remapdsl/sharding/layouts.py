"""An explicit, Hugging Face tp_plan-style layout plan for plain (non-DTensor) tensors: globs over runtime
keys -> placements per mesh dim; read from JSON (`read_layout`), a mesh from `dp=2,tp=4` (`parse_mesh`)."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from itertools import product
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from ..errors import Diagnostic, RemapError, did_you_mean
from ..language.library import shipped_layout_path
from .placements import (REPLICATE, FirstOnly, Mesh, PackedShard, Placement, Replicate, Shard, StridedShard, _fail,
                         _chunk, _Frozen, _normal_dim)

PLACEMENTS = (Shard, Replicate, StridedShard, PackedShard, FirstOnly)


Style = Literal["colwise", "rowwise", "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise",
                "grouped_gemm", "replicate"]
STYLES: tuple[str, ...] = Style.__args__  # type: ignore[attr-defined]


class PlanRule(_Frozen):
    """One entry of a layout plan: a glob over runtime keys and a style, a placement or placements."""

    pattern: str
    style: Style | None = None
    placement: Placement | None = None
    placements: tuple[Placement, ...] | None = None
    mesh_dim: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_style(cls, data: Any) -> Any:
        style = data.get("style") if isinstance(data, dict) else None
        if isinstance(style, str) and style not in STYLES:
            raise _fail("E407", f"unknown layout style `{style}`", did_you_mean(style, STYLES), data.get("pattern"))
        return data

    @model_validator(mode="after")
    def _check(self) -> PlanRule:
        if [self.style, self.placement, self.placements].count(None) != 2:
            raise _fail("E407", "a plan rule needs exactly one of a style, a placement or placements",
                        path=self.pattern)
        if self.placements is not None and self.mesh_dim is not None:
            raise _fail("E407", "explicit placements cover every mesh dim; drop `mesh_dim`", path=self.pattern)
        return self


class LayoutPlan(_Frozen):
    """Runtime-key globs -> layout, as a transformers tp_plan: the first match wins, no match replicates."""

    rules: tuple[PlanRule, ...]
    mesh_dim: str = "tp"

    @classmethod
    def from_mapping(cls, plan: Mapping[str, str | Sequence[Placement]], *, mesh_dim: str = "tp",
                     prefix: str = "") -> LayoutPlan:
        """`{"layers.*.self_attn.q_proj": "colwise", ...}` in order; `prefix` is put before every pattern
        (`"model."` for a transformers `base_model_tp_plan`). A value may be one placement (on `mesh_dim`,
        as a style) or a list of placements, one per mesh dim."""
        rules = []
        for pattern, value in plan.items():
            if isinstance(value, str):
                rules.append(PlanRule(pattern=prefix + pattern, style=value))
            elif isinstance(value, PLACEMENTS):
                rules.append(PlanRule(pattern=prefix + pattern, placement=value))
            else:
                value = tuple(value)
                for placement in value:
                    if not isinstance(placement, PLACEMENTS):
                        whose = "torch's " if type(placement).__module__.startswith("torch") else ""
                        raise _fail("E402", f"{whose}`{placement!r}` is not a placement remapdsl knows",
                                    "use remapdsl.sharding's Shard(dim), Replicate(), StridedShard(dim, "
                                    "split_factor), PackedShard(dim, units) or FirstOnly(), one per mesh dim "
                                    "(or a style name)", prefix + pattern)
                rules.append(PlanRule(pattern=prefix + pattern, placements=value))
        return cls(rules=tuple(rules), mesh_dim=mesh_dim)

    def resolved(self, config: Mapping[str, Any] | None) -> LayoutPlan:
        """The plan with each `PackedShard` unit count that names a config key (`"a ?? b"`: the first
        present) replaced by the config's value; the plan itself where none does. E406 for a key the config
        lacks or whose value is no whole number."""
        def resolve(p, pattern: str):
            if type(p) is not PackedShard or not any(isinstance(u, str) for u in p.units):
                return p
            return p.model_copy(update={"units": tuple(_unit(u, config or {}, pattern) for u in p.units)})

        rules = tuple(r.model_copy(update={
            "placement": r.placement and resolve(r.placement, r.pattern),
            "placements": r.placements and tuple(resolve(p, r.pattern) for p in r.placements)}) for r in self.rules)
        return self if rules == self.rules else self.model_copy(update={"rules": rules})

    def match(self, runtime_key: str) -> PlanRule | None:
        """The first rule whose glob matches the key or its parent module (the key less its last segment)."""
        names = (runtime_key, runtime_key.rpartition(".")[0]) if "." in runtime_key else (runtime_key,)
        return next((r for r in self.rules if any(fnmatch.fnmatchcase(n, r.pattern) for n in names)), None)


def _unit(unit: int | str, config: Mapping[str, Any], pattern: str) -> int:
    """A unit count of a packed part: the number, or the config's value of the first key named present."""
    if isinstance(unit, int):
        return unit
    names = [name.strip() for name in unit.split("??")]
    value = next((config[name] for name in names if config.get(name) is not None), None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        found = "none of them is in the config" if value is None else f"it is {value!r}"
        raise _fail("E406", f"packed_shard's unit count `{unit}` names config keys, but {found}",
                    "name a key of the model's config.json that holds a whole number (heads, or rows), or "
                    "give the number", pattern)
    return value


def _style_placement(style: str, shape: Sequence[int], runtime_key: str) -> Shard | Replicate | StridedShard:
    """The placement a transformers style gives a parameter of `shape` on its mesh dim."""
    ndim = len(shape)
    if style == "replicate" or (style in ("rowwise", "packed_rowwise") and ndim <= 1):
        return REPLICATE
    if style == "packed_colwise" and ndim == 1:
        return Shard(dim=0)  # transformers shards a packed 1-D bias plainly
    if ndim < (2 if style == "embedding_colwise" else 1):
        raise _fail("E405", f"style `{style}` cannot shard a {ndim}-d tensor", path=runtime_key)
    if style == "colwise":
        return Shard(dim=max(ndim - 2, 0))
    if style == "rowwise":
        return Shard(dim=ndim - 1)
    if style == "packed_colwise":
        return StridedShard(dim=ndim - 2, split_factor=2)
    if style == "packed_rowwise":
        return StridedShard(dim=ndim - 1, split_factor=2)
    return Shard(dim=1 if style == "embedding_colwise" else 0)  # embedding_rowwise, grouped_gemm


def layout_for(runtime_key: str, shape: Sequence[int], plan: LayoutPlan, mesh: Mesh) -> tuple[Placement, ...]:
    """The placements (one per mesh dim of `mesh`) `plan` gives the runtime tensor `runtime_key` of global
    `shape`: the first matching rule's (styles pick dims by rank, as transformers does), else replicated."""
    rule = plan.match(runtime_key)
    if rule is None:
        return (REPLICATE,) * len(mesh.sizes)
    if rule.placements is not None:
        if len(rule.placements) != len(mesh.sizes):
            raise _fail("E403", f"rule `{rule.pattern}` gives {len(rule.placements)} placements for a "
                        f"{len(mesh.sizes)}-d mesh", "give one placement per mesh dim", runtime_key)
        return tuple(_positive(p, len(shape), runtime_key) for p in rule.placements)
    on = mesh.index(rule.mesh_dim or plan.mesh_dim)
    placement = _positive(rule.placement, len(shape), runtime_key) if rule.placement is not None else \
        _style_placement(rule.style, shape, runtime_key)  # type: ignore[arg-type]
    return tuple(placement if i == on else REPLICATE for i in range(len(mesh.sizes)))


def _positive(placement: Placement, ndim: int, runtime_key: str) -> Placement:
    """`placement` with its tensor dim made positive (Replicate and FirstOnly name none)."""
    if type(placement) in (Replicate, FirstOnly):
        return placement
    dim = _normal_dim(placement.dim, ndim, placement, runtime_key)
    return placement if dim == placement.dim else placement.model_copy(update={"dim": dim})


def parse_mesh(text: str) -> Mesh:
    """`dp=2,tp=4` -> a Mesh (outermost dim first); a malformed text is a RemapError (E409)."""
    dims = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise RemapError(Diagnostic(code="E409", message=f"bad mesh `{text}`: write dims as "
                                        "`name=size` separated by commas, e.g. `dp=2,tp=4`"))
        dims[name.strip()] = int(size)
    return Mesh.of(dims)


def read_layout(path: str | os.PathLike) -> LayoutPlan:
    """A layout plan from JSON (docs/layout.md), or the shipped plan a bare name names (`vllm_tp`)."""
    kinds = {kind.model_fields["kind"].default: kind for kind in PLACEMENTS}
    if not Path(path).is_file():
        path = shipped_layout_path(os.fspath(path)) or path
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        plan = {glob: value if isinstance(value, str) else kinds[value.pop("kind")](**value)
                if isinstance(value, dict) else [kinds[p.pop("kind")](**p) for p in value]
                for glob, value in data["plan"].items()}
        return LayoutPlan.from_mapping(plan, mesh_dim=data.get("mesh_dim", "tp"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
        raise RemapError(Diagnostic(code="E409", path=str(path), message=f"cannot read the layout: {exc}",
                                    hint='expected {"mesh_dim": "tp", "plan": {"*.q_proj": "colwise"}}')) from None


def global_shapes(shapes: list[Mapping[str, tuple]], plan: LayoutPlan | None = None,
                  mesh: Mesh | None = None) -> dict[str, tuple]:
    """Each runtime tensor's (global shape, dtype) from every rank's (shape, dtype) of it, in rank order:
    a whole tensor's or a DTensor's shape is global; under `plan` on `mesh` a plain tensor is a shard,
    and a dim its placements cut is the sum of the shards along the mesh dims that cut it."""
    held: dict[str, int] = {}  # runtime key -> the first rank holding it
    for rank, part in enumerate(shapes):
        for key in part:
            held.setdefault(key, rank)
    if plan is None:
        return {key: shapes[rank][key] for key, rank in held.items()}
    out = {}
    for key, rank in held.items():
        shape, dtype = shapes[rank][key]
        at = mesh.coordinate(rank)
        placements = layout_for(key, shape, plan, mesh)
        size = list(shape)
        for dim in range(len(shape)):
            along = [m for m, p in enumerate(placements) if getattr(p, "dim", None) == dim]
            packed = [m for m in along if type(placements[m]) is PackedShard]
            if packed:
                size[dim] = _packed_length(shape[dim], placements, along, mesh, at, key)
            elif along:
                size[dim] = 0
                for index in product(*(range(mesh.sizes[m]) for m in along)):
                    coordinate = list(at)
                    for m, i in zip(along, index):
                        coordinate[m] = i
                    size[dim] += shapes[mesh.rank(coordinate)].get(key, (shape,))[0][dim]
        out[key] = (tuple(size), dtype)
    return out


def _packed_length(local: int, placements, along: list[int], mesh: Mesh, at: tuple[int, ...], key: str) -> int:
    """The global length of a dim a `PackedShard` alone cuts, from one rank's local length."""
    if len(along) > 1:
        raise _fail("E406", f"{', '.join(map(str, (placements[m] for m in along)))} cut one dim: a save without "
                    "`like` cannot derive its global length", "give `like`, or cut a packed dim on one mesh dim",
                    key)
    placement, n, c = placements[along[0]], mesh.sizes[along[0]], at[along[0]]
    held = sum(_held_units(u, n, c) for u in placement.units)
    if not held or local % held:
        raise _fail("E405", f"placement {placement}: this rank's {local} is not {held} units of one size", path=key)
    return local // held * sum(placement.units)


def _held_units(units: int, n: int, c: int) -> int:
    """How many units of a part of `units` coordinate c of n holds under `PackedShard`."""
    if units >= n:
        lo, hi = _chunk(units, n, c)
        return hi - lo
    return min(units, 1)
