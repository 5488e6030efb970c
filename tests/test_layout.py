"""remapdsl.sharding.placements: placements -> held boxes, checked by hand, by a brute-force oracle, and against torch's
own DTensor on real gloo processes (one spawn per world size, many cases inside it)."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import random
from datetime import timedelta
from itertools import product

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, note, settings
from gloo import CHECK_FAILURES, shut_down
from hypothesis import strategies as st

from remapdsl.errors import RemapError
from remapdsl.sharding.layouts import LayoutPlan, PlanRule, layout_for
from remapdsl.sharding.placements import (
    Box,
    Mesh,
    Replicate,
    Shard,
    StridedShard,
    local_boxes,
    local_shard,
)

R = Replicate()


def S(dim):
    return Shard(dim=dim)


def SS(dim, sf):
    return StridedShard(dim=dim, split_factor=sf)


def held(shape, mesh, placements, rank):
    mesh = Mesh.of(mesh)
    return local_boxes(shape, mesh.sizes, placements, mesh.coordinate(rank))


# ------------------------------------------------------------------- worked examples of DTensor placements


@pytest.mark.parametrize(("length", "n", "sizes"), [(5, 4, [2, 2, 1, 0]), (4, 3, [2, 2, 0]), (8, 2, [4, 4])])
def test_shard_follows_torch_chunk(length, n, sizes):
    shards = [local_shard((length,), (n,), [S(0)], (c,)) for c in range(n)]
    assert [s.shape for s in shards] == [(k,) for k in sizes]
    assert [s.boxes for s in shards] == [
        (Box((sum(sizes[:c]),), (k,)),) if k else () for c, k in enumerate(sizes)
    ]


def test_fsdp_tp_strided_pattern_is_contiguous():
    mesh = {"dp": 2, "tp": 2}
    got = [held((8,), mesh, [SS(0, 2), S(0)], rank) for rank in range(4)]
    assert got == [(Box((0,), (2,)),), (Box((4,), (2,)),), (Box((2,), (2,)),), (Box((6,), (2,)),)]


def test_strided_then_replicate_is_two_boxes_never_one_bounding_box():
    mesh = Mesh.of({"dp": 2, "tp": 2})
    for rank in range(4):
        shard = local_shard((8, 3), mesh.sizes, [SS(0, 2), R], mesh.coordinate(rank))
        first = 0 if rank < 2 else 2
        assert shard.boxes == (Box((first, 0), (2, 3)), Box((first + 4, 0), (2, 3)))
        assert shard.local_offsets == ((0, 0), (2, 0))
        assert shard.shape == (4, 3)


def test_packed_colwise_gate_up_holds_two_runs():
    # [E, 2I, H] = [2, 8, 3] on tp=2: rank r holds gate rows and up rows r*2..r*2+2 of every expert
    shard = local_shard((2, 8, 3), (2,), [SS(1, 2)], (1,))
    assert shard.boxes == (Box((0, 2, 0), (2, 2, 3)), Box((0, 6, 0), (2, 2, 3)))
    assert shard.shape == (2, 4, 3)


def test_two_dims_sharded_gives_the_product_of_runs():
    shard = local_shard((8, 8), (2, 2), [SS(0, 2), SS(1, 2)], (1, 0))
    assert shard.boxes == (
        Box((2, 0), (2, 2)),
        Box((2, 4), (2, 2)),
        Box((6, 0), (2, 2)),
        Box((6, 4), (2, 2)),
    )
    assert shard.local_offsets == ((0, 0), (0, 2), (2, 0), (2, 2))


def test_empty_shard_holds_no_boxes_and_a_zero_local_shape():
    shard = local_shard((5, 7), (4,), [S(0)], (3,))
    assert shard.boxes == ()
    assert shard.shape == (0, 7)


def test_scalar_and_negative_dims():
    assert local_shard((), (2,), [R], (1,)).boxes == (Box((), ()),)
    assert local_boxes((3, 4), (2,), [S(-1)], (1,)) == (Box((0, 2), (3, 2)),)
    with pytest.raises(RemapError) as err:
        local_boxes((), (2,), [S(0)], (0,))
    assert err.value.diagnostic.code == "E405"


def test_large_dims_stay_runs():
    length = 10**9  # never a list of indices
    assert local_boxes((length, 4), (2, 4), [SS(0, 4), S(0)], (1, 3)) == (
        Box((length // 8 * 7, 0), (length // 8, 4)),
    )
    boxes = local_boxes((length, 4), (2, 4), [SS(0, 4), R], (1, 3))
    assert [b.offsets[0] for b in boxes] == [length // 8 * k for k in (1, 3, 5, 7)]
    assert {b.sizes for b in boxes} == {(length // 8, 4)}


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda: local_boxes((4,), (2, 2), [S(0)], (0, 0)), "E403"),
        (lambda: local_boxes((4,), (2,), [S(0)], (2,)), "E404"),
        (lambda: local_boxes((4,), (2,), [S(1)], (0,)), "E405"),
        (lambda: local_boxes((4,), (2,), [object()], (0,)), "E402"),
        (lambda: SS(0, 0), "E406"),
        (lambda: Mesh.of({"dp": 2, "tp": 0}), "E406"),
        (lambda: Mesh(names=("tp", "tp"), sizes=(2, 2)), "E406"),
        (lambda: Mesh.of({"tp": 2}).coordinate(2), "E404"),
    ],
)
def test_bad_inputs_raise_coded_errors(call, code):
    with pytest.raises(RemapError) as err:
        call()
    assert err.value.diagnostic.code == code


def test_mesh_rank_order_is_row_major():
    mesh = Mesh.of({"pp": 2, "dp": 3, "tp": 2})
    coords = [mesh.coordinate(r) for r in range(mesh.size)]
    assert coords == list(product(range(2), range(3), range(2)))
    assert [mesh.rank(c) for c in coords] == list(range(12))


# ------------------------------------------------------------------------------------- explicit layouts

HF_LLAMA_MOE = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.shared.gate_up": "packed_rowwise",
}


@pytest.mark.parametrize(
    ("key", "shape", "placement"),
    [
        ("model.embed_tokens.weight", (32, 8), S(0)),
        ("model.layers.0.self_attn.q_proj.weight", (16, 8), S(0)),
        ("model.layers.11.self_attn.q_proj.bias", (16,), S(0)),
        ("model.layers.0.self_attn.o_proj.weight", (8, 16), S(1)),
        ("model.layers.0.self_attn.o_proj.bias", (8,), R),
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 16, 8), SS(1, 2)),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 16), R),  # no rule names it
        ("model.layers.0.mlp.experts.down_proj", (4, 8, 16), S(2)),
        ("model.layers.0.mlp.shared.gate_up.weight", (8, 16), SS(1, 2)),
        ("model.layers.0.mlp.shared.gate_up.bias", (16,), R),
        ("model.norm.weight", (8,), R),
    ],
)
def test_tp_plan_styles_match_transformers(key, shape, placement):
    plan = LayoutPlan.from_mapping(HF_LLAMA_MOE, prefix="model.")
    mesh = Mesh.of({"dp": 2, "tp": 4})
    assert layout_for(key, shape, plan, mesh) == (R, placement)


def test_styles_by_rank():
    mesh = Mesh.of({"tp": 2})

    def one(style, shape):
        return layout_for("w", shape, LayoutPlan(rules=(PlanRule(pattern="w", style=style),)), mesh)[0]

    assert one("colwise", (4, 8, 2)) == S(1)
    assert one("packed_colwise", (6,)) == S(0)  # transformers shards a packed 1-D bias plainly
    assert one("embedding_colwise", (4, 8)) == S(1)
    assert one("grouped_gemm", (4, 8, 2)) == S(0)
    assert one("grouped_gemm", (4, 8)) == S(0)
    assert one("replicate", (4, 8)) == R
    with pytest.raises(RemapError) as err:
        one("embedding_colwise", (4,))
    assert err.value.diagnostic.code == "E405"


def test_first_match_wins_and_globs_are_anchored():
    plan = LayoutPlan.from_mapping({"layers.1*": "rowwise", "layers.*": "colwise", "*.bias": "replicate"})
    mesh = Mesh.of({"tp": 2})
    assert layout_for("layers.12.weight", (4, 4), plan, mesh) == (S(1),)  # matches the module `layers.12`
    assert layout_for("layers.2.weight", (4, 4), plan, mesh) == (S(0),)
    assert layout_for("layers.2.bias", (4,), plan, mesh) == (S(0),)  # `layers.*` comes first
    assert layout_for("xlayers.2", (4, 4), plan, mesh) == (R,)
    classes = LayoutPlan.from_mapping({"w[0-3].x": "colwise", "w[!0-3].x": "rowwise", "a?c": "colwise"})
    assert layout_for("w2.x", (4, 4), classes, mesh) == (S(0),)
    assert layout_for("w7.x", (4, 4), classes, mesh) == (S(1),)
    assert layout_for("abc", (4, 4), classes, mesh) == (S(0),)
    assert layout_for("a.c", (4, 4), classes, mesh) == (S(0),)
    assert layout_for("abbc", (4, 4), classes, mesh) == (R,)


@given(
    st.text("ab.*?[]!^-\\", max_size=8),
    st.lists(st.text("ab.^-]\\", max_size=6), max_size=5),
)
@example("[b-a]", ["a", "b"])
@example("[!]a]", ["]", "a", "b"])
@example("[]a]", ["]", "b"])
@example("[^a]", ["^", "b"])
@settings(max_examples=300, deadline=None)
def test_globs_are_fnmatchcase(pattern, keys):
    plan = LayoutPlan(rules=(PlanRule(pattern=pattern, style="colwise"),))
    for key in keys:
        if "." not in key:  # a dotted key also matches through its module
            assert (plan.match(key) is not None) == fnmatch.fnmatchcase(key, pattern), key


def test_explicit_placements_per_mesh_dim():
    plan = LayoutPlan.from_mapping({"*.gate_up_proj": [SS(-2, 2), S(-2)], "*": "colwise"}, mesh_dim="tp")
    mesh = Mesh.of({"dp": 2, "tp": 2})
    assert layout_for("m.gate_up_proj", (2, 8, 4), plan, mesh) == (SS(1, 2), S(1))
    assert layout_for("m.o", (2, 8, 4), plan, mesh) == (R, S(1))


@pytest.mark.parametrize(
    ("build", "code"),
    [
        (lambda: LayoutPlan.from_mapping({"a": "colwse"}), "E407"),
        (lambda: PlanRule(pattern="a"), "E407"),
        (
            lambda: layout_for("a", (4,), LayoutPlan.from_mapping({"a": "colwise"}), Mesh.of({"dp": 2})),
            "E408",
        ),
        (
            lambda: layout_for("a", (4,), LayoutPlan.from_mapping({"a": [S(0)]}), Mesh.of({"d": 2, "t": 2})),
            "E403",
        ),
        (lambda: layout_for("a", (4,), LayoutPlan.from_mapping({"a": [S(1)]}), Mesh.of({"tp": 2})), "E405"),
    ],
)
def test_bad_plans_raise_coded_errors(build, code):
    with pytest.raises(RemapError) as err:
        build()
    assert err.value.diagnostic.code == code


def test_unknown_style_suggests_the_closest():
    with pytest.raises(RemapError) as err:
        LayoutPlan.from_mapping({"a": "packed_colwse"})
    assert err.value.diagnostic.hint == "did you mean `packed_colwise`?"


# ------------------------------------------------------------------------------------ brute-force oracle


def _chunks(indices, n):
    """torch.chunk of an index list into exactly n pieces (trailing ones empty)."""
    pieces = [t.tolist() for t in torch.tensor(indices, dtype=torch.long).chunk(n)] if indices else []
    return pieces + [[]] * (n - len(pieces))


def oracle_indices(shape, mesh_shape, placements, coordinate):
    """Per tensor dim, the held global indices as a Python list (the recipe of torch's placement docs, index by index), and whether
    every _StridedShard split was even across its mesh dim (torch 2.13 asserts otherwise)."""
    held, even = [list(range(n)) for n in shape], True
    for p, n, c in zip(placements, mesh_shape, coordinate):
        if isinstance(p, Replicate):
            continue
        d = p.dim % len(shape)
        if isinstance(p, Shard):
            held[d] = _chunks(held[d], n)[c]
        else:
            split = [_chunks(piece, n) for piece in _chunks(held[d], p.split_factor)]
            even &= len({sum(len(s[k]) for s in split) for k in range(n)}) == 1
            held[d] = [i for s in split for i in s[c]]
    return held, even


def _runs(indices):
    return sum(1 for k, i in enumerate(indices) if k == 0 or indices[k - 1] + 1 != i)


def check_against_oracle(shape, mesh_shape, placements, coordinate):
    shard = local_shard(shape, mesh_shape, placements, coordinate)
    held, _ = oracle_indices(shape, mesh_shape, placements, coordinate)
    full = np.arange(math.prod(shape)).reshape(shape)
    expect = full[np.ix_(*held)] if shape else full
    assert shard.shape == expect.shape
    assert len(shard.boxes) == math.prod(_runs(h) for h in held)  # maximal runs, never a bounding box
    rebuilt = np.full(expect.shape, -1)
    for box, at in zip(shard.boxes, shard.local_offsets, strict=True):
        local = tuple(slice(a, a + s) for a, s in zip(at, box.sizes))
        assert (rebuilt[local] == -1).all()
        rebuilt[local] = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
    np.testing.assert_array_equal(rebuilt, expect)
    return shard


@st.composite
def placed_tensors(draw, max_ranks=8):
    if draw(st.booleans()):
        mesh_shape = (draw(st.integers(1, max_ranks)),)
    else:
        a = draw(st.integers(1, max_ranks))
        mesh_shape = (a, draw(st.integers(1, max_ranks // a)))
    shape = tuple(draw(st.lists(st.integers(0, 13), max_size=3)))
    ndim = len(shape)
    kinds = st.just(R)
    if ndim:
        dims = st.integers(-ndim, ndim - 1)
        kinds = st.one_of(kinds, dims.map(S), st.builds(SS, dims, st.integers(1, 4)))
    placements = tuple(draw(kinds) for _ in mesh_shape)
    return shape, mesh_shape, placements


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed_tensors())
def test_all_ranks_tile_the_tensor(case):
    shape, mesh_shape, placements = case
    note(f"shape={shape} mesh={mesh_shape} placements={[str(p) for p in placements]}")
    count = np.zeros(shape, dtype=np.int64)
    for coordinate in product(*(range(n) for n in mesh_shape)):
        shard = check_against_oracle(shape, mesh_shape, placements, coordinate)
        for box in shard.boxes:
            count[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] += 1
    copies = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    assert (count == copies).all()


# --------------------------------------------------------------------------- against torch's DTensor

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


def dtensor_cases(world, count, seed):
    """Random (shape, mesh shape, placements) with every _StridedShard even enough for torch 2.13, plus
    the worked examples above."""
    rng = random.Random(seed)
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


def _dtensor_worker(rank, world, rendezvous, cases, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
    from torch.distributed.tensor import Shard as TorchShard

    from remapdsl.sharding import placements_from_dtensor

    # a file rendezvous: no TCP port to race for with other tests or jobs on the machine
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    failures, held = [], []
    try:
        meshes = {}
        for mesh_shape in MESHES[world]:
            names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        for number, (shape, mesh_shape, placements) in enumerate(cases):
            full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
            try:
                mesh = meshes[mesh_shape]
                d = distribute_tensor(full, mesh, [_torch_placement(p) for p in placements])
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
    finally:
        shut_down()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"failures": failures, "held": held}, f)



@pytest.mark.parametrize(("world", "count", "seed"), [(2, 60, 2), (4, 60, 4)])
def test_boxes_match_dtensor_to_local(world, count, seed, tmp_path):
    import torch.multiprocessing as mp

    cases = dtensor_cases(world, count, seed)
    assert sum(any(isinstance(p, StridedShard) for p in c[2]) for c in cases) >= count // 5
    mp.spawn(_dtensor_worker, args=(world, str(tmp_path / 'rendezvous'), cases, str(tmp_path)), nprocs=world)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [f for r in ranks for f in r["failures"]] == []
    for number, (shape, mesh_shape, placements) in enumerate(cases):
        count_held = np.zeros(shape, dtype=np.int64)
        for r in ranks:
            for offsets, sizes in r["held"][number]:
                count_held[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        copies = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
        assert (count_held == copies).all(), (number, shape, mesh_shape, placements)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed_tensors())
def test_each_rank_owns_what_no_lower_rank_holds(case):
    """`owned` decides from the replicated mesh dims alone; the definition lists every lower rank."""
    from remapdsl.sharding.holdings import Holding, Placed, owned

    shape, mesh_shape, placements = case
    mesh = Mesh.of({f"m{i}": n for i, n in enumerate(mesh_shape)})
    for rank in range(mesh.size):
        shard = local_shard(shape, mesh.sizes, placements, mesh.coordinate(rank))
        holding = Holding({"t": Placed(shard, mesh.sizes, placements, mesh.rank, "spec", mesh.coordinate(rank))}, {})
        lower = {b for r in range(rank) for b in local_shard(shape, mesh.sizes, placements, mesh.coordinate(r)).boxes}
        expected = [b for b in shard.boxes if b not in lower]
        got = owned(holding, rank).get("t")
        assert (list(got.boxes) if got else []) == expected
