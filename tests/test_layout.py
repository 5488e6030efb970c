"""remapdsl.sharding.placements and layouts: placements -> held boxes, checked by hand and by a
brute-force oracle (tests/placement_oracle.py); a mesh's dims and ranks, the runs a strided shard
holds, local_shard's errors; layout plans from tp_plan styles and globs. Against torch's own DTensor
on gloo ranks: tests/test_dtensor_placements.py."""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from itertools import product

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st
from placement_oracle import oracle_indices

from remapdsl.errors import RemapError
from remapdsl.sharding.layouts import LayoutPlan, PlanRule, layout_for
from remapdsl.sharding.placements import (
    Box,
    LocalShard,
    Mesh,
    Replicate,
    Shard,
    StridedShard,
    held_runs,
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


# ------------------------------------------------------------- a mesh, held runs, local_shard's errors


def test_an_unknown_mesh_dim_suggests_the_closest_or_lists_them():
    """E408: a near name is suggested; a far one lists the mesh's dims; a known one is its index."""
    mesh = Mesh.of({"data": 2, "tensor": 4})
    assert (mesh.index("data"), mesh.index("tensor")) == (0, 1)
    with pytest.raises(RemapError) as near:
        mesh.index("tensr")
    with pytest.raises(RemapError) as far:
        mesh.index("expert")
    assert [(d.code, d.message, d.hint, d.path) for d in (near.value.diagnostic, far.value.diagnostic)] == [
        ("E408", "the mesh has no dim `tensr`", "did you mean `tensor`?", None),
        ("E408", "the mesh has no dim `expert`", "the mesh has data, tensor", None),
    ]


def test_a_coordinate_of_the_wrong_length_has_no_rank():
    """`Mesh.rank` of a coordinate that names fewer or more dims than the mesh has is an error, not
    the rank of a coordinate cut short (`(1,)` on a 2x4 mesh is not rank 1 nor rank 4)."""
    mesh = Mesh.of({"data": 2, "tensor": 4})
    assert [mesh.rank(mesh.coordinate(r)) for r in range(8)] == list(range(8))
    for wrong in ((1,), (1, 2, 0)):
        with pytest.raises(ValueError):
            mesh.rank(wrong)


def test_placements_print_as_torch_prints_its_own():
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    assert (str(Replicate()), str(Shard(dim=1))) == (str(TorchReplicate()), str(TorchShard(1))) == ("R", "S(1)")




def test_a_shard_of_a_strided_shard_ends_inside_its_second_run():
    """8 rows, `_StridedShard(0, split_factor=2)` on 2 ranks then `Shard(0)` on 4: coordinate (0, 2)
    holds rows {0, 1, 4, 5} after the first, of those the third, row 4 alone (a window that ends
    inside the second run is cut there)."""
    steps = [(StridedShard(dim=0, split_factor=2), 2, 0), (Shard(dim=0), 4, 2)]
    assert held_runs(8, steps[:1]) == [(0, 2), (4, 6)]
    assert held_runs(8, steps) == [(4, 5)]
    assert local_shard((8, 3), (2, 4), [steps[0][0], steps[1][0]], (0, 2)) == LocalShard((1, 3), (((4, 0), (1, 3)),),
                                                                                       ((0, 0),))


@pytest.mark.parametrize("length, split, ranks", [(9, 2, 4), (7, 3, 2), (10, 4, 3)])
def test_a_strided_shard_of_uneven_splits_holds_what_torch_gives_each_rank(length, split, ranks):
    """9 rows in splits of 5 and 4 over 4 ranks: the last rank's window of the first split is empty
    and of the second is row 8; every rank holds the rows torch's own `_StridedShard` gives it."""
    from torch.distributed.tensor.placement_types import _StridedShard

    shards, _ = _StridedShard(0, split_factor=split)._split_tensor(torch.arange(length), ranks, with_padding=False)
    for c, shard in enumerate(shards):
        runs = held_runs(length, [(StridedShard(dim=0, split_factor=split), ranks, c)])
        assert [i for a, b in runs for i in range(a, b)] == shard.tolist()


def test_an_empty_dim_holds_no_runs():
    """`held_runs` of a dim of length 0 is no run at all, with or without placements on it."""
    assert held_runs(0, []) == []
    assert held_runs(0, [(Shard(dim=0), 2, 1)]) == []
    assert held_runs(3, []) == [(0, 3)]


class _NotAPlacement:
    def __repr__(self) -> str:
        return "NotAPlacement()"


@pytest.mark.parametrize("args, diagnostic", [
    (((4,), (2, 2), [Shard(dim=0)], (0, 0)), ("E403", "1 placements for a 2-d mesh", "give one placement per mesh dim")),
    (((4,), (2,), [Shard(dim=0)], (2,)), ("E404", "coordinate (2,) is outside mesh (2,)", None)),
    (((4,), (2,), [Shard(dim=0)], (-1,)), ("E404", "coordinate (-1,) is outside mesh (2,)", None)),
    (((4,), (2, 2), [Shard(dim=0), Replicate()], (1,)), ("E404", "coordinate (1,) is outside mesh (2, 2)", None)),
    (((4,), (2,), [_NotAPlacement()], (0,)), ("E402", "NotAPlacement() is not a remapdsl placement",
                                             ("use remapdsl.sharding.placements's Shard, Replicate, StridedShard, "
                                              "PackedShard or FirstOnly (placements_from_dtensor converts torch's)"))),
    (((4,), (2,), [Shard(dim=1)], (0,)), ("E405", "placement S(1) names dim 1 of a 1-d tensor", None)),
])
def test_local_shard_s_errors_name_the_tensor(args, diagnostic):
    """Each refusal of `local_shard`, whole: code, message, hint, and the runtime key as its path
    (no path without one)."""
    for key in ("model.w", None):
        with pytest.raises(RemapError) as caught:
            local_shard(*args, runtime_key=key)
        d = caught.value.diagnostic
        assert (d.code, d.message, d.hint, d.path) == (*diagnostic, key)


# ------------------------------------------------------------------------------------ brute-force oracle


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


def test_the_json_layout_in_docs_reads_as_the_page_says(tmp_path):
    """docs/layout.md's layout file example: experts cut on `ep`, gate/up packed on `tp`."""
    import re

    from remapdsl.sharding import Mesh, layout_for, read_layout
    from remapdsl.sharding.placements import Shard, StridedShard

    page = (Path(__file__).resolve().parent.parent / "docs" / "layout.md").read_text()
    (tmp_path / "layout.json").write_text(re.search(r"```json\n(.*?)```", page, re.DOTALL).group(1))
    plan = read_layout(tmp_path / "layout.json")
    assert layout_for("model.layers.0.mlp.experts.gate_up_proj", (4, 16, 16), plan, Mesh.of({"ep": 2, "tp": 2})) \
        == (Shard(dim=0), StridedShard(dim=1, split_factor=2))
