"""A tensor's placement on a device mesh -> the boxes of the global tensor this rank holds.

Placements follow torch DTensor exactly: per tensor dim, the held indices are narrowed by each mesh
dim's placement left to right (`Shard`: torch.chunk, uneven and empty shards included; `StridedShard`:
torch's `_StridedShard`); the product over dims, split into maximal contiguous runs, gives one box per
run product (never a widened bounding box). Plain integer arithmetic on (start, stop) runs: no DTensor
helper is called per tensor. Placements come from a live DTensor or a layout plan (layouts.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import product
from math import prod
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import Diagnostic, RemapError, did_you_mean
from ..indexmap import Box


class LayoutError(RemapError):
    """A placement, mesh or layout plan that cannot describe a tensor (codes E4xx)."""


def _fail(code: str, message: str, hint: str | None = None, path: str | None = None) -> LayoutError:
    return LayoutError(Diagnostic(code=code, message=message, hint=hint, path=path))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ----------------------------------------------------------------------------------------- placements


class Shard(_Frozen):
    """torch `Shard(dim)`: torch.chunk the dim into n pieces, coordinate c holds piece c (may be empty)."""

    kind: Literal["shard"] = "shard"
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


class Replicate(_Frozen):
    """torch `Replicate()`: every coordinate holds the whole extent."""

    kind: Literal["replicate"] = "replicate"

    def __str__(self) -> str:
        return "R"


class StridedShard(_Frozen):
    """torch `_StridedShard(dim, split_factor=sf)`: chunk the dim into sf pieces, chunk each piece into
    n, coordinate c holds the c-th chunk of every piece, in ascending order."""

    kind: Literal["strided_shard"] = "strided_shard"
    dim: int
    split_factor: int

    @model_validator(mode="after")
    def _check(self) -> StridedShard:
        if self.split_factor < 1:
            raise _fail("E406", f"split_factor must be at least 1, got {self.split_factor}")
        return self

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


Placement = Annotated[Shard | Replicate | StridedShard, Field(discriminator="kind")]
REPLICATE = Replicate()


class Mesh(_Frozen):
    """A device mesh: named dims and their sizes; ranks in row-major order, like torch DeviceMesh."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @model_validator(mode="after")
    def _check(self) -> Mesh:
        if len(self.names) != len(self.sizes) or not self.sizes:
            raise _fail("E406", f"a mesh needs one size per dim name, got {self.names} and {self.sizes}")
        if len(set(self.names)) != len(self.names) or not all(self.names):
            raise _fail("E406", f"mesh dim names must be distinct and non-empty, got {self.names}")
        if any(size < 1 for size in self.sizes):
            raise _fail("E406", f"mesh sizes must be at least 1, got {dict(zip(self.names, self.sizes))}")
        return self

    @classmethod
    def of(cls, dims: Mapping[str, int]) -> Mesh:
        """`Mesh.of({"dp": 2, "tp": 2})`: dims in the order given, the last one fastest."""
        return cls(names=tuple(dims), sizes=tuple(dims.values()))

    @property
    def size(self) -> int:
        """The number of ranks."""
        return prod(self.sizes)

    def index(self, name: str) -> int:
        if name not in self.names:
            hint = did_you_mean(name, self.names) or f"the mesh has {', '.join(self.names)}"
            raise _fail("E408", f"the mesh has no dim `{name}`", hint)
        return self.names.index(name)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """A rank's index on each mesh dim (row-major, like DeviceMesh)."""
        if not 0 <= rank < self.size:
            raise _fail("E404", f"rank {rank} is outside a mesh of {self.size} ranks")
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coordinate: Sequence[int]) -> int:
        rank = 0
        for c, size in zip(coordinate, self.sizes, strict=True):
            rank = rank * size + c
        return rank


# --------------------------------------------------------------------------------------- the arithmetic


class LocalShard(NamedTuple):
    """What one rank holds of a tensor: the local tensor's shape, the global boxes it holds, and where
    each box sits in the local tensor (the local tensor is the held indices in ascending order per dim)."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    local_offsets: tuple[tuple[int, ...], ...]


Run = tuple[int, int]  # [start, stop) of global indices


def _select(runs: list[Run], windows: list[Run]) -> list[Run]:
    """Positions [a, b) of each window (ascending, disjoint) taken from the index set `runs`, as runs."""
    out: list[Run] = []
    i, pos = 0, 0  # runs[i] starts at position pos of the held set
    for a, b in windows:
        if a >= b:
            continue
        while i < len(runs) and pos + runs[i][1] - runs[i][0] <= a:
            pos += runs[i][1] - runs[i][0]
            i += 1
        j, p = i, pos
        while j < len(runs) and p < b:
            start, stop = runs[j]
            lo, hi = start + max(a - p, 0), start + min(b - p, stop - start)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
            p += stop - start
            j += 1
    return out


def _chunk(length: int, n: int, c: int) -> Run:
    """torch.chunk(length, n)[c] as [start, stop), empty at the end when it does not divide."""
    step = -(-length // n)
    return min(length, c * step), min(length, (c + 1) * step)


def held_runs(length: int, steps: Sequence[tuple[Shard | StridedShard, int, int]]) -> list[Run]:
    """The global indices of one dim of `length` a rank holds after `steps` = (placement, mesh size,
    coordinate) in mesh-dim order, as sorted maximal runs."""
    runs: list[Run] = [(0, length)] if length else []
    count = length
    for placement, n, c in steps:
        if type(placement) is Shard:
            windows = [_chunk(count, n, c)]
        else:
            windows = []
            for j in range(placement.split_factor):
                start, stop = _chunk(count, placement.split_factor, j)
                lo, hi = _chunk(stop - start, n, c)
                windows.append((start + lo, start + hi))
        runs = _select(runs, windows)
        count = sum(b - a for a, b in windows)
    return runs


def _normal_dim(dim: int, ndim: int, placement: Any, path: str | None) -> int:
    if -ndim <= dim < ndim:
        return dim + ndim if dim < 0 else dim
    raise _fail("E405", f"placement {placement} names dim {dim} of a {ndim}-d tensor", path=path)


def local_shard(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
                coordinate: Sequence[int], *, runtime_key: str | None = None) -> LocalShard:
    """What the rank at `coordinate` holds of a tensor of `global_shape` placed by `placements`.

    Args:
        global_shape: the full tensor's shape.
        mesh_shape: the mesh's size on each dim (`Mesh.sizes`).
        placements: one placement per mesh dim, applied left to right as DTensor does.
        coordinate: this rank's index on each mesh dim (`Mesh.coordinate(rank)`).
        runtime_key: names the tensor in errors.
    """
    if len(placements) != len(mesh_shape):
        raise _fail("E403", f"{len(placements)} placements for a {len(mesh_shape)}-d mesh",
                    "give one placement per mesh dim", runtime_key)
    if len(coordinate) != len(mesh_shape) or not all(0 <= c < n for c, n in zip(coordinate, mesh_shape)):
        raise _fail("E404", f"coordinate {tuple(coordinate)} is outside mesh {tuple(mesh_shape)}", path=runtime_key)
    ndim = len(global_shape)
    steps: list[list[tuple[Shard | StridedShard, int, int]]] = [[] for _ in range(ndim)]
    for placement, n, c in zip(placements, mesh_shape, coordinate):
        kind = type(placement)
        if kind is Shard or kind is StridedShard:
            steps[_normal_dim(placement.dim, ndim, placement, runtime_key)].append((placement, n, c))
        elif kind is not Replicate:
            raise _fail("E402", f"{placement!r} is not a remapdsl placement", "use remapdsl.sharding.placements's "
                        "Shard, Replicate, StridedShard (placements_from_dtensor converts torch's)", runtime_key)
    per_dim = [held_runs(length, dim_steps) if dim_steps else ([(0, length)] if length else [])
               for length, dim_steps in zip(global_shape, steps)]
    local_starts = []
    for runs in per_dim:
        starts, total = [], 0
        for a, b in runs:
            starts.append(total)
            total += b - a
        local_starts.append(starts)
    shape = tuple(sum(b - a for a, b in runs) for runs in per_dim)
    boxes = tuple(Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in product(*per_dim))
    return LocalShard(shape, boxes, tuple(product(*local_starts)))


def local_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
                coordinate: Sequence[int]) -> tuple[Box, ...]:
    """The global boxes the rank at `coordinate` holds, in local-tensor order (see `local_shard`)."""
    return local_shard(global_shape, mesh_shape, placements, coordinate).boxes


# ------------------------------------------------------------------------------------------- DTensor


class TensorPlacement(_Frozen):
    """A DTensor's global shape, mesh, placements, and this rank's coordinate (None: this rank is not in
    the mesh and holds nothing; its local tensor is then 1-D and empty, as torch makes it)."""

    shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]
    coordinate: tuple[int, ...] | None

    def local_shard(self) -> LocalShard:
        if self.coordinate is None:
            return LocalShard((0,), (), ())
        return local_shard(self.shape, self.mesh.sizes, self.placements, self.coordinate)


def placements_from_dtensor(t: Any, runtime_key: str | None = None) -> TensorPlacement:
    """Read a DTensor's placement into remapdsl's types; refuse `Partial` (a pending reduction).

    Args:
        t: a `torch.distributed.tensor.DTensor`.
        runtime_key: names the tensor in errors.
    """
    from torch.distributed.tensor.placement_types import Partial as TorchPartial
    from torch.distributed.tensor.placement_types import Replicate as TorchReplicate
    from torch.distributed.tensor.placement_types import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard

    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    shape = tuple(int(s) for s in t.shape)
    placements: list[Shard | Replicate | StridedShard] = []
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, TorchStridedShard):
            dim = _normal_dim(p.dim, len(shape), p, runtime_key)
            placements.append(StridedShard(dim=dim, split_factor=int(p.split_factor)))
        elif isinstance(p, TorchShard):
            placements.append(Shard(dim=_normal_dim(p.dim, len(shape), p, runtime_key)))
        elif isinstance(p, TorchReplicate):
            placements.append(REPLICATE)
        elif isinstance(p, TorchPartial):
            raise _fail("E401", f"placement {p} on mesh dim `{names[mesh_dim]}` holds partial values, not a layout",
                        "redistribute to Replicate() or Shard(d) before loading or saving", runtime_key)
        else:
            raise _fail("E402", f"unknown placement {p!r} on mesh dim `{names[mesh_dim]}`", path=runtime_key)
    coordinate = mesh.get_coordinate()
    return TensorPlacement(shape=shape, mesh=Mesh(names=tuple(names), sizes=tuple(int(s) for s in mesh.shape)),
                           placements=tuple(placements),
                           coordinate=None if coordinate is None else tuple(int(c) for c in coordinate))
