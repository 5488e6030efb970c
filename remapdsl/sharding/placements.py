"""A tensor's placement on a device mesh -> the boxes of the global tensor this rank holds.

Placements follow torch DTensor exactly: per tensor dim, the held indices are narrowed by each mesh
dim's placement left to right (`Shard`: torch.chunk, uneven and empty shards included; `StridedShard`:
torch's `_StridedShard`); the product over dims, split into maximal contiguous runs, gives one box per
run product (never a widened bounding box). Plain integer arithmetic on (start, stop) runs: no DTensor
helper is called per tensor. Placements come from a live DTensor or a layout plan (layouts.py).

Two placements have no DTensor form; they describe serving engines' tensor parallelism (vLLM's
`QKVParallelLinear`, `MergedColumnParallelLinear` and row-parallel biases): `PackedShard`, parts of
unequal sizes each split on its own (a part with fewer units than ranks replicated, so replicas may
overlap in part: `local_shard(..., owned=True)` picks one writer per element), and `FirstOnly`, held by
the first coordinate while the others hold zeros.
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


class PackedShard(_Frozen):
    """A dim made of parts of `units` each (heads, or rows), one after another; each part is split over the
    mesh dim by whole units (torch.chunk of its units), and coordinate c holds the concatenation of its
    slices, part by part. A part with fewer units than the mesh dim has coordinates is replicated: c
    holds unit `c * units // n` (vLLM's `QKVParallelLinear` with KV heads fewer than TP ranks). A unit is
    `length // sum(units)` indices. A unit count may name a config key (`"num_key_value_heads"`, with
    `??` between alternatives): `LayoutPlan.resolved(config)` replaces it with the config's value."""

    kind: Literal["packed_shard"] = "packed_shard"
    dim: int
    units: tuple[int | str, ...]

    @model_validator(mode="after")
    def _check(self) -> PackedShard:
        if not self.units or any(isinstance(u, int) and u < 0 for u in self.units):
            raise _fail("E406", f"packed_shard needs one unit count (0 or more) per part, got {list(self.units)}")
        return self

    def __str__(self) -> str:
        return f"P({self.dim}, {list(self.units)})"


class FirstOnly(_Frozen):
    """Coordinate 0 holds the whole extent, the others hold zeros of the same shape (vLLM's row-parallel
    biases under TP: the all-reduce adds them once). A load fills the others with zeros; a save or an
    export takes the values from coordinate 0 only."""

    kind: Literal["first_only"] = "first_only"

    def __str__(self) -> str:
        return "F"


Placement = Annotated[Shard | Replicate | StridedShard | PackedShard | FirstOnly, Field(discriminator="kind")]
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
    each box sits in the local tensor (the local tensor is the held indices in ascending order per dim).
    `zeros`: the rank holds zeros in place of values (`FirstOnly`, not the first coordinate)."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    local_offsets: tuple[tuple[int, ...], ...]
    zeros: bool = False


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


def _intersect(a: list[Run], b: list[Run]) -> list[Run]:
    """The indices in both sorted run lists, as sorted runs."""
    out: list[Run] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _packed_windows(count: int, placement: PackedShard, n: int, c: int,
                    runtime_key: str | None) -> tuple[list[Run], list[Run]]:
    """The positions coordinate c holds of a packed dim of `count` indices, and those of them it is the
    first coordinate to hold (a replicated part's unit is held by several)."""
    units = placement.units
    if any(isinstance(u, str) for u in units):
        raise _fail("E406", f"placement {placement} names config keys; the layout plan was not resolved "
                    "against a config", "pass the config the rules compile with (LayoutPlan.resolved(config))",
                    runtime_key)
    total = sum(units)
    if not total or count % total:
        raise _fail("E405", f"placement {placement}: a dim of {count} is not {total} units of one size",
                    "the parts' unit counts must add up to a divisor of the dim", runtime_key)
    size = count // total
    held: list[Run] = []
    first: list[Run] = []
    start = 0
    for u in units:
        if u >= n:
            lo, hi = _chunk(u, n, c)
            first.append((start + lo * size, start + hi * size))
        elif u:
            lo, hi = c * u // n, c * u // n + 1
            if c == 0 or (c - 1) * u // n != lo:
                first.append((start + lo * size, start + hi * size))
        else:
            lo = hi = 0
        held.append((start + lo * size, start + hi * size))
        start += u * size
    return held, first


def held_runs(length: int, steps: Sequence[tuple[Shard | StridedShard | PackedShard, int, int]]) -> list[Run]:
    """The global indices of one dim of `length` a rank holds after `steps` = (placement, mesh size,
    coordinate) in mesh-dim order, as sorted maximal runs."""
    return _runs(length, steps, None)[0]


def _runs(length: int, steps: Sequence[tuple[Shard | StridedShard | PackedShard, int, int]],
          runtime_key: str | None) -> tuple[list[Run], list[Run]]:
    """`held_runs`, and those of them the rank is the first to hold (all of them unless a packed part is
    replicated)."""
    runs: list[Run] = [(0, length)] if length else []
    first = runs
    count = length
    for placement, n, c in steps:
        kind = type(placement)
        if kind is Shard:
            windows = mine = [_chunk(count, n, c)]
        elif kind is StridedShard:
            windows = []
            for j in range(placement.split_factor):
                start, stop = _chunk(count, placement.split_factor, j)
                lo, hi = _chunk(stop - start, n, c)
                windows.append((start + lo, start + hi))
            mine = windows
        else:
            windows, mine = _packed_windows(count, placement, n, c, runtime_key)
        held = _select(runs, windows)
        first = held if mine is windows and first is runs else _intersect(first, _select(runs, mine))
        runs = held
        count = sum(b - a for a, b in windows)
    return runs, first


def _normal_dim(dim: int, ndim: int, placement: Any, path: str | None) -> int:
    if -ndim <= dim < ndim:
        return dim + ndim if dim < 0 else dim
    raise _fail("E405", f"placement {placement} names dim {dim} of a {ndim}-d tensor", path=path)


def local_shard(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
                coordinate: Sequence[int], *, runtime_key: str | None = None, owned: bool = False) -> LocalShard:
    """What the rank at `coordinate` holds of a tensor of `global_shape` placed by `placements`.

    Args:
        global_shape: the full tensor's shape.
        mesh_shape: the mesh's size on each dim (`Mesh.sizes`).
        placements: one placement per mesh dim, applied left to right as DTensor does.
        coordinate: this rank's index on each mesh dim (`Mesh.coordinate(rank)`).
        runtime_key: names the tensor in errors.
        owned: only the boxes this coordinate is the first to hold along `PackedShard` mesh dims (what it
            writes on save; replicas on `Replicate` dims are chosen by the caller), at their places in
            the whole local tensor.
    """
    if len(placements) != len(mesh_shape):
        raise _fail("E403", f"{len(placements)} placements for a {len(mesh_shape)}-d mesh",
                    "give one placement per mesh dim", runtime_key)
    if len(coordinate) != len(mesh_shape) or not all(0 <= c < n for c, n in zip(coordinate, mesh_shape)):
        raise _fail("E404", f"coordinate {tuple(coordinate)} is outside mesh {tuple(mesh_shape)}", path=runtime_key)
    ndim = len(global_shape)
    steps: list[list[tuple[Shard | StridedShard | PackedShard, int, int]]] = [[] for _ in range(ndim)]
    zeros = False
    for placement, n, c in zip(placements, mesh_shape, coordinate):
        kind = type(placement)
        if kind is Shard or kind is StridedShard or kind is PackedShard:
            steps[_normal_dim(placement.dim, ndim, placement, runtime_key)].append((placement, n, c))
        elif kind is FirstOnly:
            zeros = zeros or c > 0
        elif kind is not Replicate:
            raise _fail("E402", f"{placement!r} is not a remapdsl placement", "use remapdsl.sharding.placements's "
                        "Shard, Replicate, StridedShard, PackedShard or FirstOnly (placements_from_dtensor "
                        "converts torch's)", runtime_key)
    whole = [[(0, length)] if length else [] for length in global_shape]
    per_dim = [_runs(length, dim_steps, runtime_key) if dim_steps else (runs, runs)
               for length, dim_steps, runs in zip(global_shape, steps, whole)]
    local_starts = []
    for runs, _ in per_dim:
        starts, total = [], 0
        for a, b in runs:
            starts.append(total)
            total += b - a
        local_starts.append(starts)
    shape = tuple(sum(b - a for a, b in runs) for runs, _ in per_dim)
    if zeros:
        return LocalShard(shape, (), (), zeros=True)
    if owned and any(first != runs for runs, first in per_dim):
        # each first-held run at its place in the local tensor: inside the held run that contains it
        per_dim_owned = []
        for (runs, first), starts in zip(per_dim, local_starts):
            placed, i = [], 0
            for a, b in first:
                while runs[i][1] <= a:
                    i += 1
                placed.append(((a, b), starts[i] + a - runs[i][0]))
            per_dim_owned.append(placed)
        combos = list(product(*per_dim_owned))
        return LocalShard(shape, tuple(Box(tuple(a for (a, _), _ in combo), tuple(b - a for (a, b), _ in combo))
                                       for combo in combos), tuple(tuple(at for _, at in combo) for combo in combos))
    boxes = tuple(Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo))
                  for combo in product(*(runs for runs, _ in per_dim)))
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
