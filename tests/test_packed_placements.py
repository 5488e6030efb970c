"""PackedShard and FirstOnly (remapdsl.sharding.placements), the placements of serving engines' tensor
parallelism, against a reference written the way vLLM 0.32's weight loaders cut a tensor
(`QKVParallelLinear`, `MergedColumnParallelLinear`, gpt-oss's rank-0 bias); their JSON spelling, the config
keys a layout plan names, and the global shapes a save without `like` derives from them.
The same placements against vLLM's own goldens on gloo ranks: tests/test_vllm_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.errors import RemapError
from remapdsl.sharding import FirstOnly, LayoutPlan, Mesh, PackedShard, Replicate, Shard, read_layout
from remapdsl.sharding.layouts import global_shapes, layout_for
from remapdsl.sharding.placements import held_runs, local_shard
from remapdsl.sharding.plans import ReadItem


def vllm_cut(t: torch.Tensor, units: list[int], n: int, c: int) -> torch.Tensor:
    """Rank c of n's rows of `t`, cut as vLLM's packed linears do: each part on its own, in n equal blocks;
    a part of fewer units (heads) than ranks replicated on n // units consecutive ranks."""
    size = t.shape[0] // sum(units)
    pieces = []
    for part, u in zip(t.split([u * size for u in units]), units):
        replicas = max(1, n // u)
        pieces.append(part.chunk(n // replicas)[c // replicas])
    return torch.cat(pieces)


def gathered(t: torch.Tensor, shard) -> torch.Tensor:
    """The local tensor a rank holding `shard` of `t` has: each box's values at its local offsets."""
    local = torch.full(shard.shape, -1, dtype=t.dtype)
    for (offsets, sizes), at in zip(shard.boxes, shard.local_offsets):
        source = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        local[tuple(slice(a, a + s) for a, s in zip(at, sizes))] = source
    return local


@st.composite
def packed(draw, vllms_only: bool = False):
    """(units, unit size, ranks): every part a multiple or a divisor of the ranks (what vLLM accepts), or
    any counts, 0 included (what torch.chunk defines)."""
    n = draw(st.integers(1, 5))
    fits = st.one_of(st.integers(1, 3).map(lambda k: k * n), st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    units = draw(st.lists(fits if vllms_only else st.integers(0, 6), min_size=1, max_size=4).filter(sum))
    return units, draw(st.integers(1, 3)), n


@settings(max_examples=300, deadline=None)
@given(packed(vllms_only=True), st.integers(1, 3))
def test_packed_shard_holds_what_vllms_loaders_give_each_rank(case, cols):
    units, unit, n = case
    t = torch.arange(sum(units) * unit * cols).reshape(-1, cols)
    for c in range(n):
        shard = local_shard(t.shape, (n,), [PackedShard(dim=0, units=tuple(units))], (c,))
        assert torch.equal(gathered(t, shard), vllm_cut(t, units, n, c)), c


@settings(max_examples=300, deadline=None)
@given(packed(), st.integers(1, 3), st.sampled_from(["replicate", "shard", "shard the packed dim", "one dim only"]))
def test_every_element_has_one_writer_and_the_writer_holds_it_there(case, other, kind):
    """`owned=True` boxes over every coordinate tile the tensor once (replicated units written by their
    first holder), each at the place in the local tensor where the rank holds it; with a second mesh dim
    that replicates, cuts another dim, or cuts what the packed placement left of its own dim."""
    units, unit, n = case
    t = torch.arange(sum(units) * unit * 4).reshape(-1, 4)
    if kind == "one dim only":  # a bias: the packed dim is the tensor's only one
        t = t[:, 0].contiguous()
    second = {"replicate": Replicate(), "shard": Shard(dim=1), "shard the packed dim": Shard(dim=0),
              "one dim only": Replicate()}[kind]
    placements = [PackedShard(dim=0, units=tuple(units)), second]
    writes = torch.zeros(t.shape, dtype=torch.long)
    for c in range(n):
        for d in range(1 if type(second) is Replicate else other):  # replicas on a Replicate dim: the caller chooses
            held = local_shard(t.shape, (n, other), placements, (c, d))
            mine = local_shard(t.shape, (n, other), placements, (c, d), owned=True)
            assert mine.shape == held.shape
            local = gathered(t, held)
            for (offsets, sizes), at in zip(mine.boxes, mine.local_offsets):
                assert all(sizes), sizes  # no empty box, as held boxes never are
                box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assert torch.equal(local[tuple(slice(a, a + s) for a, s in zip(at, sizes))], t[box])
                writes[box] += 1
    assert torch.equal(writes, torch.ones_like(writes))


def test_kv_heads_fewer_than_ranks_are_replicated_as_vllm_assigns_them():
    """4 query heads, 1 KV head of 2 rows, tp=2: each rank holds its 2 query heads and the one k and v head;
    rank 1's three parts are one run, and it writes only its query rows."""
    placement = [PackedShard(dim=0, units=(4, 1, 1))]
    assert local_shard((12, 3), (2,), placement, (0,)).boxes == (((0, 0), (4, 3)), ((8, 0), (4, 3)))
    assert local_shard((12, 3), (2,), placement, (1,)).boxes == (((4, 0), (8, 3)),)
    assert local_shard((12, 3), (2,), placement, (1,), owned=True).boxes == (((4, 0), (4, 3)),)


def test_held_runs_of_a_packed_dim_are_every_unit_a_coordinate_holds():
    """Replicated units included: `held_runs` says what a rank holds, not what it writes."""
    assert held_runs(12, [(PackedShard(dim=0, units=(4, 1, 1)), 2, 1)]) == [(4, 12)]
    assert held_runs(12, [(PackedShard(dim=0, units=(4, 1, 1)), 2, 0)]) == [(0, 4), (8, 12)]


def test_first_only_is_whole_on_the_first_coordinate_and_zeros_elsewhere():
    assert (str(FirstOnly()), str(PackedShard(dim=1, units=(2, "kv")))) == ("F", "P(1, [2, 'kv'])")
    first = local_shard((4, 6), (2, 3), [FirstOnly(), Shard(dim=1)], (0, 1))
    assert first.boxes == (((0, 2), (4, 2)),) and not first.zeros
    other = local_shard((4, 6), (2, 3), [FirstOnly(), Shard(dim=1)], (1, 1))
    assert (other.shape, other.boxes, other.zeros) == ((4, 2), (), True)


def test_the_load_plan_of_first_onlys_other_ranks_fills_zeros(tmp_path):
    """vLLM's rank 1 of gpt-oss's w2 bias: zeros, whatever the tensor held before, and nothing read."""
    from safetensors.torch import save_file

    save_file({"b": torch.arange(6, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "r.remap").write_text("remap 1\nb -> b\n")
    compiled = remapdsl.compile_rules(str(tmp_path / "r.remap"), str(tmp_path))
    plan = LayoutPlan.from_mapping({"b": [FirstOnly()]})
    mesh = Mesh.of({"tp": 2})
    inventory = remapdsl.open_checkpoint(str(tmp_path))
    other = remapdsl.plan_rank(compiled, inventory, plan, mesh, 1)
    assert other.items == (ReadItem("b", (0,), (6,), None, None, None, None, (), (), 0.0),)  # a fill, no steps
    assert [i.ckpt_key for i in remapdsl.plan_rank(compiled, inventory, plan, mesh, 0).items] == ["b"]


def test_unit_counts_name_config_keys_resolved_by_the_plan():
    plan = LayoutPlan.from_mapping({"*.qkv": [PackedShard(dim=0, units=("heads", "kv ?? heads", 2))]})
    resolved = plan.resolved({"heads": 4, "kv": None})
    assert resolved.rules[0].placements == (PackedShard(dim=0, units=(4, 4, 2)),)
    assert plan.resolved({"heads": 4, "kv": 1}).rules[0].placements[0].units == (4, 1, 2)
    plain = LayoutPlan.from_mapping({"*.qkv": "colwise"})
    assert plain.resolved({}) is plain
    with pytest.raises(RemapError) as missing:
        plan.resolved({"kv": 1})
    assert missing.value.diagnostics[0].code == "E406" and "`heads`" in str(missing.value)
    with pytest.raises(RemapError, match="it is 2.5"):
        plan.resolved({"heads": 2.5})


def test_an_unresolved_name_or_units_that_do_not_divide_are_errors_naming_the_tensor():
    with pytest.raises(RemapError) as unresolved:
        local_shard((6,), (2,), [PackedShard(dim=0, units=("heads", 1))], (0,), runtime_key="w")
    d = unresolved.value.diagnostics[0]
    assert (d.code, d.path) == ("E406", "w")
    assert "names config keys; the layout plan was not resolved against a config" in d.message
    assert d.hint == "pass the config the rules compile with (LayoutPlan.resolved(config))"
    with pytest.raises(RemapError) as uneven:
        local_shard((7,), (2,), [PackedShard(dim=0, units=(2, 1))], (0,), runtime_key="w")
    d = uneven.value.diagnostics[0]
    assert (d.code, d.path) == ("E405", "w") and "a dim of 7 is not 3 units of one size" in d.message
    assert d.hint == "the parts' unit counts must add up to a divisor of the dim"
    for units in ((), (2, -1)):
        with pytest.raises(RemapError, match="E406"):
            PackedShard(dim=0, units=units)


def test_placements_print_and_read_back_from_json(tmp_path):
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"mesh_dim": "tp", "plan": {
        "*.qkv_proj": [{"kind": "packed_shard", "dim": 0, "units": ["num_attention_heads", 2, 2]}],
        "*.w2_bias": {"kind": "first_only"}, "*.sinks": {"kind": "shard", "dim": -1}}}))
    plan = read_layout(path)
    mesh = Mesh.of({"tp": 2})
    assert [str(p) for p in layout_for("a.qkv_proj.weight", (8, 4), plan, mesh)] == \
        ["P(0, ['num_attention_heads', 2, 2])"]
    assert layout_for("a.w2_bias", (3, 4), plan, mesh) == (FirstOnly(),)
    # one placement, not a list: on the plan's mesh dim, as a style is, its dim made positive
    assert layout_for("a.sinks", (3, 4), plan, Mesh.of({"dp": 2, "tp": 2})) == (Replicate(), Shard(dim=1))


def test_the_shipped_vllm_layouts_read_by_name_and_replicate_over_engine_replicas():
    plan = read_layout("vllm_tp").resolved({"num_attention_heads": 8, "num_key_value_heads": 2})
    key = "model.layers.0.self_attn.qkv_proj.weight"
    assert layout_for(key, (24, 16), plan, Mesh.of({"tp": 2})) == (PackedShard(dim=0, units=(8, 2, 2)),)
    assert layout_for(key, (24, 16), plan, Mesh.of({"dp": 2, "tp": 2})) == \
        (Replicate(), PackedShard(dim=0, units=(8, 2, 2)))
    assert layout_for("model.layers.0.mlp.experts.routed_experts.w2_bias", (4, 16),
                      read_layout("vllm_gpt_oss_tp"), Mesh.of({"dp": 2, "tp": 2})) == (Replicate(), FirstOnly())
    with pytest.raises(RemapError, match="E409"):
        read_layout("no_such_layout")


def test_a_save_without_like_derives_a_packed_dims_global_length():
    """Each rank's rows over the units it holds (replicated KV heads count once per rank), times every unit."""
    plan = LayoutPlan.from_mapping({"qkv": [PackedShard(dim=0, units=(4, 1, 1))], "b": [FirstOnly()]})
    mesh = Mesh.of({"tp": 2})
    shapes = [{"qkv": ((8, 3), "bfloat16"), "b": ((5,), "float32")}] * 2
    assert global_shapes(shapes, plan, mesh) == {"qkv": ((12, 3), "bfloat16"), "b": ((5,), "float32")}
    two = LayoutPlan.from_mapping({"qkv": [PackedShard(dim=0, units=(4, 1, 1)), Shard(dim=0)]})
    with pytest.raises(RemapError, match="cannot derive"):
        global_shapes([{"qkv": ((4, 3), "bfloat16")}] * 4, two, Mesh.of({"a": 2, "b": 2}))
