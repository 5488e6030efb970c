"""Hypothesis strategies for a rule file's properties: checkpoints with random values in a
snapshot's layout (optionally scaled down), device meshes, and valid placements for each runtime
tensor. The one module of `remapdsl.testing` that imports hypothesis."""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hypothesis import strategies as st

from remapdsl import open_checkpoint
from remapdsl.sharding import LayoutError, LayoutPlan, Mesh, Replicate, Shard, StridedShard, local_shard
from remapdsl.testing.data import write_checkpoint

MESH_NAMES = ("dp", "tp", "ep")


def _strategy(value) -> st.SearchStrategy:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


def checkpoints(source, *, root: str | os.PathLike | None = None, layers=None, experts=None,
                seeds: st.SearchStrategy[int] = st.integers(0, 2**31 - 1)) -> st.SearchStrategy[Path]:
    """Checkpoint folders written in the layout of `source` (a snapshot, checkpoint folder or
    Inventory): its keys, dtypes, shapes, files and index, random finite values (FP8 and FP4 codes
    included), each drawn example a new folder under `root` (by default a temporary folder removed
    when the process exits).

    Args:
        layers, experts: keep the first N layers / experts (an int, or a strategy of ints, e.g.
            `st.integers(1, 2)`), config adjusted (`remapdsl.testing.scale_down`); None keeps all.
        seeds: the values' seeds.
    """
    inventory = open_checkpoint(source)  # read once; every example reuses it
    if root is None:
        base = Path(tempfile.mkdtemp(prefix="remapdsl-checkpoints-"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
    else:
        base = Path(root)

    @st.composite
    def build(draw) -> Path:
        seed = draw(seeds)
        n_layers, n_experts = draw(_strategy(layers)), draw(_strategy(experts))
        folder = Path(tempfile.mkdtemp(prefix=f"seed{seed}-", dir=base))
        return write_checkpoint(inventory, folder, seed=seed, layers=n_layers, experts=n_experts)

    return build()


@st.composite
def meshes(draw, max_ranks: int = 8, max_dims: int = 3, names: Sequence[str] = MESH_NAMES) -> Mesh:
    """Device meshes of 1 to `max_dims` dims (named from `names`, outermost first) and at most
    `max_ranks` ranks; dims of size 1 included."""
    count = draw(st.integers(1, min(max_dims, len(names))))
    dims, left = {}, max_ranks
    for name in draw(st.permutations(list(names)))[:count]:
        size = draw(st.integers(1, max(1, left)))
        dims[name] = size
        left //= size
    return Mesh.of(dims)


def _valid(shape: Sequence[int], mesh: Mesh, chosen: tuple) -> bool:
    try:
        for rank in range(mesh.size):
            local_shard(shape, mesh.sizes, chosen, mesh.coordinate(rank))
    except LayoutError:
        return False
    return True


def placements(shape: Sequence[int], mesh: Mesh) -> st.SearchStrategy[tuple]:
    """Placements of a tensor of `shape` on `mesh` (one per mesh dim) that every rank can hold:
    `Replicate`, `Shard(d)` (uneven and empty shards included) and `StridedShard(d, k)`."""
    ndim = len(shape)
    one = [st.just(Replicate())]
    if ndim:
        dims = st.integers(0, ndim - 1)
        one.append(st.builds(Shard, dim=dims))
        one.append(st.builds(StridedShard, dim=dims, split_factor=st.integers(1, 4)))
    chosen = st.tuples(*[st.one_of(one) for _ in mesh.sizes])
    return chosen.filter(lambda c: _valid(shape, mesh, c))


@st.composite
def layouts(draw, compiled, mesh: Mesh) -> LayoutPlan:
    """A layout plan giving each runtime tensor of `compiled` its own valid placements on `mesh`
    (rules that move stored quantized values may still refuse a shard edge inside a block, E412)."""
    plan = {glob.escape(t.runtime_key): list(draw(placements(t.shape, mesh))) for t in compiled.runtime_tensors}
    return LayoutPlan.from_mapping(plan, mesh_dim=mesh.names[0])
