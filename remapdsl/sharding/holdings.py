"""A state dict and its placements (a DTensor's own, else whole or a layout plan's shard) -> what this rank
holds of each runtime tensor, and what it writes; each checked against the compiled shape and dtype."""

from __future__ import annotations

import re
import sys
import zlib
from collections.abc import Callable, Hashable, Mapping
from itertools import product
from typing import Any, NamedTuple

from ..compile.model import Compiled
from ..errors import BindError, Diagnostic, suggest
from .layouts import LayoutPlan, layout_for
from .placements import Box, LocalShard, Mesh, PackedShard, Replicate, local_shard, placements_from_dtensor


def whole_shard(shape: tuple[int, ...]) -> LocalShard:
    """A tensor held whole: one box, the whole shape, at the local origin."""
    return LocalShard(shape, (Box((0,) * len(shape), shape),), ((0,) * len(shape),))


def held_by_layout(compiled: Compiled, layout: LayoutPlan, mesh: Mesh, rank: int) -> dict[str, LocalShard]:
    """What `rank` holds of every runtime tensor when `layout` places the tensors on `mesh`."""
    coordinate = mesh.coordinate(rank)
    return {d.runtime_key: local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                       coordinate, runtime_key=d.runtime_key)
            for d in compiled.runtime_tensors}


class Placed(NamedTuple):
    """One runtime tensor's placement as this rank sees it."""

    shard: LocalShard  # what this rank holds
    sizes: tuple[int, ...]  # the mesh's size per dim; () for a tensor that is whole on every rank
    placements: tuple  # one per mesh dim
    rank_of: Callable[[tuple[int, ...]], int] | None  # mesh coordinate -> global rank
    spec: Hashable  # equal for tensors of one mesh, placement and shape
    coordinate: tuple[int, ...] = ()  # this rank's mesh coordinate
    writes: LocalShard | None = None  # of `shard`, what no lower coordinate holds too (packed parts); None: all


class Holding(NamedTuple):
    """What a rank holds of each runtime tensor, and the local tensors that hold it."""

    placed: dict[str, Placed]
    local: dict[str, Any]  # runtime key -> the local torch tensor (a DTensor's local shard)

    def held(self) -> dict[str, LocalShard]:
        return {k: p.shard for k, p in self.placed.items()}

    def everywhere(self) -> list[str]:
        """The keys every rank holds whole (replicated on every mesh dim), sorted."""
        return sorted(k for k, p in self.placed.items()
                      if all(isinstance(pl, Replicate) or n == 1 for pl, n in zip(p.placements, p.sizes)))


class Holders(NamedTuple):
    """Which rank holds which runtime tensors (pipeline stages): per rank a bit per runtime tensor."""

    bits: list[int]
    index: dict[str, int]  # runtime key -> its bit

    def has(self, rank: int, key: str) -> bool:
        return self.bits[rank] >> self.index[key] & 1 == 1

    def first(self, key: str, start: int = 0) -> int:
        """The first rank holding `key`, counting from `start` round the ranks."""
        world = len(self.bits)
        return next(r % world for r in range(start, start + world) if self.has(r % world, key))


def hold(compiled: Compiled, tensors: Mapping[str, Any], layout: LayoutPlan | None = None,
         mesh: Mesh | None = None, rank: int = 0, whole: bool = True) -> Holding:
    """Resolve the placement on this rank of every runtime tensor the state dict holds; all problems at
    once. `whole`: it must hold all of them (one process; in a job the ranks check that together)."""
    # no DTensor exists unless its module was imported: do not pay that import (~0.5 s) otherwise
    dtensor_type = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    tensor_type = sys.modules["torch"].Tensor if dtensor_type is not None else None
    check_state_dict(compiled, tensors, local_shards=layout is not None, whole=whole)
    coordinate = mesh.coordinate(rank) if layout is not None else None
    by_spec: dict = {}  # tensors of one mesh, placement and shape share their boxes
    placed: dict[str, Placed] = {}
    local: dict[str, Any] = {}
    problems = []
    for d in compiled.runtime_tensors:
        tensor = tensors.get(d.runtime_key)
        if tensor is None:
            continue  # held by other ranks
        local[d.runtime_key] = tensor
        if dtensor_type is not None and isinstance(tensor, dtensor_type):
            # the mesh by identity: hashing a DeviceMesh costs more than the rest of this loop
            spec = (id(tensor.device_mesh), tensor.placements, d.shape)
            p = by_spec.get(spec)  # one hash of the placements a tensor (torch hashes them in Python)
            if p is None:
                dt = placements_from_dtensor(tensor, d.runtime_key)
                grid = tensor.device_mesh.mesh  # the global rank at each mesh coordinate
                p = by_spec[spec] = Placed(dt.local_shard(), dt.mesh.sizes, dt.placements,
                                           lambda index, grid=grid: int(grid[index]), spec, dt.coordinate or ())
            inner = getattr(tensor, "_local_tensor", None)  # the local shard, without to_local()'s
            local[d.runtime_key] = inner if isinstance(inner, tensor_type) else tensor.to_local()  # autograd call
        elif layout is not None:
            placements = layout_for(d.runtime_key, d.shape, layout, mesh)
            spec = (placements, d.shape)
            if spec not in by_spec:
                shard = local_shard(d.shape, mesh.sizes, placements, coordinate, runtime_key=d.runtime_key)
                writes = local_shard(d.shape, mesh.sizes, placements, coordinate, owned=True) \
                    if any(type(pl) is PackedShard for pl in placements) else None
                by_spec[spec] = Placed(shard, mesh.sizes, placements, mesh.rank, spec, coordinate, writes)
            p = by_spec[spec]
        else:
            p = Placed(whole_shard(d.shape), (), (), None, None)
        placed[d.runtime_key] = p
        if local[d.runtime_key].shape != p.shard.shape:
            problems.append(Diagnostic(code="E233", span=d.rule, message=f"`{d.runtime_key}` is "
                            f"{list(local[d.runtime_key].shape)} on rank {rank}, but its layout gives "
                            f"this rank {list(p.shard.shape)} of {list(d.shape)}"))
    if problems:
        raise BindError(problems)
    return Holding(placed, local)


def check_fillable(compiled: Compiled, local: Mapping[str, Any]) -> None:
    """E234 for a tensor a load would fill whose elements share memory (a dim of several at stride 0)."""
    problems = unfillable(compiled, local)
    if problems:
        raise BindError(problems)


def unfillable(compiled: Compiled, local: Mapping[str, Any]) -> list[Diagnostic]:
    """`check_fillable`'s problems."""
    problems = []
    for key, tensor in local.items():
        shared = [d for d, (n, step) in enumerate(zip(tensor.shape, tensor.stride())) if n > 1 and step == 0] \
            if tensor.numel() else []
        if shared:
            problems.append(Diagnostic(code="E234", span=compiled.runtime_tensor(key).rule, message=f"`{key}` "
                            f"{list(tensor.shape)} holds dim {shared[0]} at stride 0 (an expanded view: its "
                            "elements share memory), so a load cannot fill it in place",
                            hint="give it memory of its own (`.clone()`) before loading into it"))
    return problems


def owned(holding: Holding, rank: int, spread_over: int = 0, holders: Holders | None = None) -> dict[str, LocalShard]:
    """What this rank writes of each runtime tensor on save: what it holds unless a lower replica holds it
    too (packed parts: the first coordinate holding a unit). `spread_over` (an export: the job's rank count)
    picks the replica by the key's hash instead; `holders` passes over ranks not holding a tensor."""
    out: dict[str, LocalShard] = {}
    lowest: dict = {}
    for key, p in holding.placed.items():
        if p.rank_of is None:
            writer = zlib.crc32(key.encode()) % spread_over if spread_over else 0
            if holders is not None:
                writer = holders.first(key, writer)
        elif not p.shard.boxes:
            continue
        elif spread_over or holders is not None:
            replicas = [r for r in _replicas(p) if holders is None or holders.has(r, key)]
            writer = replicas[zlib.crc32(key.encode()) % len(replicas)] if spread_over else min(replicas)
        else:
            if p.spec not in lowest:
                lowest[p.spec] = min(_replicas(p))
            writer = lowest[p.spec]
        if writer == rank:
            out[key] = p.shard if p.writes is None else p.writes
    return out


def _replicas(p: Placed) -> list[int]:
    """The ranks holding what this rank holds (itself among them), in coordinate order."""
    axes = [range(n) if isinstance(pl, Replicate) else (c,)
            for pl, n, c in zip(p.placements, p.sizes, p.coordinate)]
    return [p.rank_of(index) for index in product(*axes)]


def check_state_dict(compiled: Compiled, tensors: Mapping[str, Any], local_shards: bool = False,
                     whole: bool = True) -> None:
    """Every runtime tensor is in the state dict (unless not `whole`) with the compiled shape and dtype, and
    every state-dict tensor is made by a rule or kept. `local_shards`: shapes checked by `hold` instead."""
    problems = []
    keep = [re.compile(p) for p in compiled.keep]
    produced = {d.runtime_key for d in compiled.runtime_tensors}
    for d in compiled.runtime_tensors:
        tensor = tensors.get(d.runtime_key)
        if tensor is None:
            if whole:  # a close name no rule makes is the likely misnaming
                close = suggest(d.runtime_key, [k for k in tensors if k not in produced])
                problems.append(Diagnostic(code="E230", span=d.rule, message=f"the rules produce "
                                f"`{d.runtime_key}`, but the model has no such tensor",
                                hint=f"did you mean `{close}`?" if close else None))
            continue
        if not (hasattr(tensor, "dtype") and hasattr(tensor, "shape")):
            problems.append(Diagnostic(code="E232", span=d.rule, message=f"`{d.runtime_key}` is a "
                            f"{type(tensor).__name__} in the model, not a tensor",
                            hint="the state dict maps each runtime key to a torch tensor or a DTensor"))
            continue
        shape = d.shape if local_shards else tuple(tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if (shape, dtype) != (d.shape, d.dtype):
            problems.append(Diagnostic(code="E232", span=d.rule, message=f"`{d.runtime_key}` is "
                            f"{list(shape)} {dtype} in the model, but the rules make it {list(d.shape)} "
                            f"{d.dtype}",
                            hint="add `| cast(...)` to the rule" if shape == d.shape else None))
    for key in tensors:
        if key not in produced and not any(k.fullmatch(key) for k in keep):
            problems.append(Diagnostic(code="E231", message=f"model tensor `{key}` is produced by no "
                            "rule", hint="map it from the checkpoint, or name it in a `keep`"))
    if problems:
        raise BindError(problems)
