"""An explicit, Hugging Face tp_plan-style layout plan: globs over runtime keys -> placements per mesh dim.

For plain (non-DTensor) tensors: `layout_for` gives a runtime tensor's placements under a plan,
`read_layout` reads a plan from JSON, `parse_mesh` a mesh from `dp=2,tp=4`."""

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
from .placements import REPLICATE, Mesh, Placement, Replicate, Shard, StridedShard, _fail, _Frozen, _normal_dim


Style = Literal["colwise", "rowwise", "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise",
                "grouped_gemm", "replicate"]
STYLES: tuple[str, ...] = Style.__args__  # type: ignore[attr-defined]


class PlanRule(_Frozen):
    """One entry of a layout plan: a glob over runtime keys and either a style (on `mesh_dim`, or the
    plan's) or an explicit placement per mesh dim."""

    pattern: str
    style: Style | None = None
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
        if (self.style is None) == (self.placements is None):
            raise _fail("E407", "a plan rule needs exactly one of a style or placements", path=self.pattern)
        if self.placements is not None and self.mesh_dim is not None:
            raise _fail("E407", "explicit placements cover every mesh dim; drop `mesh_dim`", path=self.pattern)
        return self


class LayoutPlan(_Frozen):
    """Runtime-key globs -> layout, in the style of a transformers tp_plan. The first matching rule wins;
    a key no rule matches is replicated. Styles shard over `mesh_dim` and replicate on every other dim."""

    rules: tuple[PlanRule, ...]
    mesh_dim: str = "tp"

    @classmethod
    def from_mapping(cls, plan: Mapping[str, str | Sequence[Placement]], *, mesh_dim: str = "tp",
                     prefix: str = "") -> LayoutPlan:
        """`{"layers.*.self_attn.q_proj": "colwise", ...}` in order; `prefix` is put before every pattern
        (`"model."` for a transformers `base_model_tp_plan`). A value may be a list of placements."""
        rules = []
        for pattern, value in plan.items():
            if isinstance(value, str):
                rules.append(PlanRule(pattern=prefix + pattern, style=value))
            else:
                value = tuple(value)
                for placement in value:
                    if not isinstance(placement, (Shard, Replicate, StridedShard)):
                        whose = "torch's " if type(placement).__module__.startswith("torch") else ""
                        raise _fail("E402", f"{whose}`{placement!r}` is not a placement remapdsl knows",
                                    "use remapdsl.sharding's Shard(dim), Replicate() or StridedShard(dim, "
                                    "split_factor), one per mesh dim (or a style name)", prefix + pattern)
                rules.append(PlanRule(pattern=prefix + pattern, placements=value))
        return cls(rules=tuple(rules), mesh_dim=mesh_dim)

    def match(self, runtime_key: str) -> PlanRule | None:
        """The first rule whose glob matches the key or the key's parent module (the key without its
        last `.segment`), or None."""
        names = (runtime_key, runtime_key.rpartition(".")[0]) if "." in runtime_key else (runtime_key,)
        return next((r for r in self.rules if any(fnmatch.fnmatchcase(n, r.pattern) for n in names)), None)


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


def layout_for(runtime_key: str, shape: Sequence[int], plan: LayoutPlan,
               mesh: Mesh) -> tuple[Shard | Replicate | StridedShard, ...]:
    """The placements (one per mesh dim) `plan` gives the runtime tensor `runtime_key` of `shape`.

    Args:
        runtime_key: the tensor's runtime name; matched against the plan's globs.
        shape: its global shape (styles pick dims by rank, as transformers does).
        plan: the layout plan; the first matching rule wins, no match replicates.
        mesh: the device mesh the tensor lives on.
    """
    rule = plan.match(runtime_key)
    if rule is None:
        return (REPLICATE,) * len(mesh.sizes)
    if rule.placements is not None:
        if len(rule.placements) != len(mesh.sizes):
            raise _fail("E403", f"rule `{rule.pattern}` gives {len(rule.placements)} placements for a "
                        f"{len(mesh.sizes)}-d mesh", "give one placement per mesh dim", runtime_key)
        dims = [None if type(p) is Replicate else _normal_dim(p.dim, len(shape), p, runtime_key)
                for p in rule.placements]
        return tuple(p if d is None or d == p.dim else p.model_copy(update={"dim": d})
                     for p, d in zip(rule.placements, dims))
    on = mesh.index(rule.mesh_dim or plan.mesh_dim)
    placement = _style_placement(rule.style, shape, runtime_key)  # type: ignore[arg-type]
    return tuple(placement if i == on else REPLICATE for i in range(len(mesh.sizes)))


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
    """A layout plan from JSON: {"mesh_dim": "tp", "plan": {glob: style or [placements]}}."""
    kinds = {"shard": Shard, "replicate": Replicate, "strided_shard": StridedShard}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        plan = {glob: value if isinstance(value, str) else
                [kinds[p.pop("kind")](**p) for p in value] for glob, value in data["plan"].items()}
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
            along = [m for m, p in enumerate(placements) if not isinstance(p, Replicate) and p.dim == dim]
            if along:
                size[dim] = 0
                for index in product(*(range(mesh.sizes[m]) for m in along)):
                    coordinate = list(at)
                    for m, i in zip(along, index):
                        coordinate[m] = i
                    size[dim] += shapes[mesh.rank(coordinate)].get(key, (shape,))[0][dim]
        out[key] = (tuple(size), dtype)
    return out
