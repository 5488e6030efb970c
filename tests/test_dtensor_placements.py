"""What remapdsl reads of torch's own DTensors (`placements_from_dtensor`: mesh, coordinate,
placements, local shard) against `to_local` and the brute-force oracle (tests/placement_oracle.py):
random placements on 2 and 4 real gloo ranks (one spawn per world size, every case inside it), a
rank outside the mesh, named and unnamed meshes, and the placements it refuses; the same on a
one-rank group in the test process itself."""

from __future__ import annotations

import math
import random
import traceback
from itertools import product

import numpy as np
import pytest
import torch
from gloo import CHECK_FAILURES
from placement_oracle import oracle_indices

from remapdsl.errors import RemapError
from remapdsl.sharding import Mesh
from remapdsl.sharding.placements import (
    LocalShard,
    Replicate,
    Shard,
    StridedShard,
    TensorPlacement,
    local_shard,
    placements_from_dtensor,
)
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

R = Replicate()


def S(dim):
    return Shard(dim=dim)


def SS(dim, sf):
    return StridedShard(dim=dim, split_factor=sf)


MESHES = {2: [(2,), (1, 2), (2, 1)], 4: [(4,), (2, 2)]}


def _torch_placement(p):
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, Replicate):
        return TR()
    if isinstance(p, Shard):
        return TS(p.dim)
    return _StridedShard(p.dim, split_factor=p.split_factor)


def _length(rng):
    """A dim length: sometimes empty, often one that strided shards split evenly."""
    r = rng.random()
    return 0 if r < 0.05 else rng.randint(1, 9) if r < 0.5 else rng.choice((4, 6, 8, 12, 16))


def dtensor_cases(world, count=60):
    """`count` random (shape, mesh shape, placements), the same for a world size every time, with
    every _StridedShard even enough for torch 2.13, and worked examples."""
    rng = random.Random(world)
    cases = [((8, 3), (2, 2), (SS(0, 2), S(0))), ((8, 3), (2, 2), (SS(0, 2), R))] if world == 4 else []
    cases += [((5, 3), (world,), (S(0),)), ((2, 8), (world,), (SS(1, 2),))]
    while len(cases) < count:
        mesh_shape = rng.choice(MESHES[world])
        shape = tuple(_length(rng) for _ in range(rng.choice((0, 1, 2, 2, 3, 3))))
        placements = []
        for _ in mesh_shape:
            d = rng.randrange(-len(shape), len(shape)) if shape else 0
            kind = rng.choice("RSSXX") if shape else "R"
            placements.append(R if kind == "R" else S(d) if kind == "S" else SS(d, rng.randint(1, 3)))
        ok = all(
            oracle_indices(shape, mesh_shape, placements, c)[1]
            for c in product(*(range(n) for n in mesh_shape))
        )
        if ok:
            cases.append((shape, mesh_shape, tuple(placements)))
    return cases


def _dtensors_on_ranks(rank: int, world: int, cases: list) -> dict:
    """Each case distributed by torch on this world's meshes: what remapdsl reads of the DTensor
    (its placements, coordinate and local shard, checked against `to_local`) and the boxes it
    holds; a rank outside a mesh and a Partial placement. Failures are recorded, not raised: the
    other ranks must not wait in a collective this one never reaches."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
    from torch.distributed.tensor import Shard as TorchShard

    from remapdsl.sharding import placements_from_dtensor

    failures, held = [], []
    meshes = {}
    for mesh_shape in MESHES[world]:
        names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
        meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for number, (shape, mesh_shape, placements) in enumerate(cases):
        full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        try:
            mesh = meshes[mesh_shape]
            # every rank holds the same `full`: torch splits it on each rank (`src_data_rank=None`)
            # as it would have split it on rank 0 to scatter, with no collective per case to wait on
            d = distribute_tensor(full, mesh, [_torch_placement(p) for p in placements], src_data_rank=None)
            layout = placements_from_dtensor(d)
            assert layout.mesh.sizes == mesh_shape and layout.shape == shape
            assert layout.coordinate == tuple(mesh.get_coordinate())
            normal = tuple(
                p if isinstance(p, Replicate) else p.model_copy(update={"dim": p.dim % len(shape)})
                for p in placements
            )
            assert layout.placements == normal, (layout.placements, normal)
            shard = layout.local_shard()
            local = d.to_local()
            assert tuple(local.shape) == shard.shape, (tuple(local.shape), shard.shape)
            rebuilt = torch.full(shard.shape, -1, dtype=torch.int64)
            for box, at in zip(shard.boxes, shard.local_offsets):
                rebuilt[tuple(slice(a, a + s) for a, s in zip(at, box.sizes))] = full[
                    tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
                ]
            assert torch.equal(rebuilt, local), (rebuilt.tolist(), local.tolist())
            held.append([[list(b.offsets), list(b.sizes)] for b in shard.boxes])
        except CHECK_FAILURES as e:  # recorded, not raised: the other ranks must not wait
            failures.append(f"case {number} {shape} {mesh_shape} {[str(p) for p in placements]}: {e!r}")
            held.append(None)
    outside = DeviceMesh("cpu", torch.tensor([0]))  # every rank but 0 is outside it
    d = distribute_tensor(torch.arange(6).reshape(2, 3), outside, [TorchShard(0)])
    layout = placements_from_dtensor(d)
    if (layout.coordinate is None) != (rank > 0) or layout.local_shard().shape != tuple(
        d.to_local().shape
    ):
        failures.append(f"outside the mesh: {layout} vs {tuple(d.to_local().shape)}")
    partial = DTensor.from_local(torch.ones(2, 2), meshes[MESHES[world][0]], [Partial()], run_check=False)
    try:
        placements_from_dtensor(partial, "w")
        failures.append("Partial was not refused")
    except RemapError as e:
        if e.diagnostic.code != "E401":
            failures.append(f"Partial refused with {e.diagnostic.code}")
    return {"failures": failures, "held": held}


def _on_ranks(rank: int, world: int, cases: list) -> dict:
    """Every check of this file on one gloo group of `world` ranks: the random cases, and on four
    ranks the DTensors `_placements_on_ranks` builds (its failure kept, not raised)."""
    out = _dtensors_on_ranks(rank, world, cases)
    out["placements"] = None
    if world == 4:
        try:
            _placements_on_ranks(rank, world)
        except CHECK_FAILURES:
            out["placements"] = f"rank {rank}: {traceback.format_exc()}"
    return out


@pytest.fixture(scope="module")
def on_ranks():
    """`on_ranks(world)`: each rank's results of the one spawn of `world` ranks (made on first use)."""
    runs: dict[int, list[dict]] = {}

    def run(world: int) -> list[dict]:
        if world not in runs:
            runs[world] = run_ranks(_on_ranks, world, dtensor_cases(world), timeout=180)
        return runs[world]

    return run


@pytest.mark.parametrize("world", [2, 4])
def test_boxes_match_dtensor_to_local(world, on_ranks):
    cases = dtensor_cases(world)
    assert sum(any(isinstance(p, StridedShard) for p in c[2]) for c in cases) >= len(cases) // 5
    ranks = on_ranks(world)
    assert [f for r in ranks for f in r["failures"]] == []
    for number, (shape, mesh_shape, placements) in enumerate(cases):
        count_held = np.zeros(shape, dtype=np.int64)
        for r in ranks:
            for offsets, sizes in r["held"][number]:
                count_held[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        copies = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
        assert (count_held == copies).all(), (number, shape, mesh_shape, placements)


def _dtensor(mesh, placements, shape, local=None):
    from torch.distributed.tensor import DTensor

    strides = tuple(int(torch.tensor(shape[k + 1:]).prod()) for k in range(len(shape)))
    local = torch.zeros((1,) * len(shape)) if local is None else local  # torch reads negative dims by its ndim
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=strides)


def _placements_on_ranks(rank: int, world: int) -> None:
    """On 4 gloo ranks: every rank builds the same meshes (their groups are collective); rank 1
    checks what remapdsl reads of DTensors on them, every rank its own coordinate."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = DeviceMesh("cpu", [[0, 1], [2, 3]])
    upper = DeviceMesh("cpu", [2, 3])

    # a named 2x2 mesh: Shard, _StridedShard kept with its factor, Replicate; the local shard is
    # what local_shard gives for them
    got = placements_from_dtensor(_dtensor(named, [TorchShard(0), _StridedShard(1, split_factor=2)], (6, 8)), "k")
    assert got.coordinate == tuple(named.get_coordinate())
    assert got.local_shard() == local_shard((6, 8), (2, 2), got.placements, got.coordinate)
    # an unnamed mesh's dims are dim0, dim1
    unnamed_got = placements_from_dtensor(_dtensor(unnamed, [TorchShard(0), TorchReplicate()], (4,)))
    # a rank outside the mesh (ranks 0 and 1 of a mesh of ranks 2 and 3) holds nothing, as torch's
    local = torch.zeros(0) if rank < 2 else torch.zeros(2, 2)
    outside = placements_from_dtensor(_dtensor(upper, [TorchShard(0)], (4, 2), local))
    if rank >= 2:
        assert outside.coordinate == (rank - 2,)
    if rank != 1:
        return
    assert got == TensorPlacement(shape=(6, 8), mesh=Mesh(names=("dp", "tp"), sizes=(2, 2)),
                                  placements=(Shard(dim=0), StridedShard(dim=1, split_factor=2)), coordinate=(0, 1))
    assert type(got.coordinate[0]) is int and type(got.shape[0]) is int and type(got.mesh.sizes[0]) is int
    assert got.local_shard() == LocalShard((3, 4), (((0, 2), (3, 2)), ((0, 6), (3, 2))), ((0, 0), (0, 2)))
    again = placements_from_dtensor(_dtensor(named, [TorchReplicate(), TorchShard(1)], (6, 8)))
    assert again.placements == (Replicate(), Shard(dim=1)) and again.local_shard().boxes == (((0, 4), (6, 4)),)
    assert unnamed_got == TensorPlacement(shape=(4,), mesh=Mesh(names=("dim0", "dim1"), sizes=(2, 2)),
                                          placements=(Shard(dim=0), Replicate()), coordinate=(0, 1))
    assert outside == TensorPlacement(shape=(4, 2), mesh=Mesh(names=("dim0",), sizes=(2,)),
                                      placements=(Shard(dim=0),), coordinate=None)
    assert outside.local_shard() == LocalShard((0,), (), ())

    _check_refusals(named)


def _check_refusals(named) -> None:
    """Placements remapdsl cannot read, on a mesh named (dp, tp): Partial is E401 naming the mesh
    dim, with the redistribute hint; a placement type torch added that remapdsl does not know,
    E402; a shard dim outside the tensor, E405 naming torch's placement. Each names the tensor."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import Placement, _StridedShard

    class Unknown(Placement):
        def __repr__(self) -> str:
            return "Unknown()"

    found = []
    for placements in ([TorchReplicate(), Partial()], [TorchReplicate(), Unknown()], [TorchShard(2), TorchReplicate()],
                       [TorchReplicate(), _StridedShard(2, split_factor=2)]):
        try:
            placements_from_dtensor(_dtensor(named, placements, (4, 4)), "model.w")
        except RemapError as caught:
            d = caught.diagnostic
            found.append((d.code, d.message, d.hint, d.path))
        else:
            found.append(f"{placements}: no error")
    assert found == [
        ("E401", "placement P(sum) on mesh dim `tp` holds partial values, not a layout",
         "redistribute to Replicate() or Shard(d) before loading or saving", "model.w"),
        ("E402", "unknown placement Unknown() on mesh dim `tp`", None, "model.w"),
        ("E405", "placement S(2) names dim 2 of a 2-d tensor", None, "model.w"),
        ("E405", f"placement {_StridedShard(2, split_factor=2)} names dim 2 of a 2-d tensor", None, "model.w"),
    ], found


@pytest.fixture
def one_gloo_rank(tmp_path):
    """A real gloo process group of one rank, in the test process itself: what a DTensor on a 1 x 1
    mesh gives is checked in the test process, where a mutation run sees it (it cannot see into
    spawned ranks)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_placements_read_on_one_gloo_rank(one_gloo_rank):
    """A 1 x 1 mesh, named and not: Shard (a negative dim as torch normalizes it), _StridedShard
    with its factor, Replicate, plain ints, the local shard (the whole tensor), and the placements
    refused (`_check_refusals`). More ranks (coordinates, a rank outside the mesh): the test below."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    named = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    got = placements_from_dtensor(_dtensor(named, [TorchShard(-2), _StridedShard(1, split_factor=2)], (6, 8)), "k")
    assert got == TensorPlacement(shape=(6, 8), mesh=Mesh(names=("dp", "tp"), sizes=(1, 1)),
                                  placements=(Shard(dim=0), StridedShard(dim=1, split_factor=2)), coordinate=(0, 0))
    assert all(type(v) is int for v in (*got.shape, *got.mesh.sizes, *got.coordinate))
    whole = LocalShard((6, 8), (((0, 0), (6, 8)),), ((0, 0),))
    assert got.local_shard() == local_shard((6, 8), (1, 1), got.placements, (0, 0)) == whole
    unnamed = placements_from_dtensor(_dtensor(DeviceMesh("cpu", [[0]]), [TorchReplicate(), TorchShard(0)], (4,)))
    assert unnamed == TensorPlacement(shape=(4,), mesh=Mesh(names=("dim0", "dim1"), sizes=(1, 1)),
                                      placements=(Replicate(), Shard(dim=0)), coordinate=(0, 0))
    with pytest.raises(RemapError) as caught:  # Partial on the first mesh dim names that dim
        placements_from_dtensor(_dtensor(named, [Partial(), TorchReplicate()], (4, 4)), "model.w")
    assert caught.value.diagnostic.message == "placement P(sum) on mesh dim `dp` holds partial values, not a layout"
    _check_refusals(named)


def test_dtensor_placements_read_on_four_gloo_ranks(on_ranks):
    """A DTensor's placements as remapdsl reads them (its mesh, named or not, strided shards, a
    rank outside the mesh, and the placements it refuses), on real gloo ranks."""
    failures = [r["placements"] for r in on_ranks(4) if r["placements"]]
    assert not failures, "\n\n".join(failures)
