"""Read, decode and write plans (remapdsl/sharding/plans.py) on tiny real checkpoints: a quantized
shard's block-grid check (E412, whole diagnostic), the decode items a plan gives for a dequantized
source (every part read, and the parts a format is shown), plans over DCP chunks (each part's
place, E356), the order of a plan's items, the bytes it owns, and the write plans of a save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import dcp_chunk, tiny_checkpoint
from formats import Int8Row

import remapdsl
from remapdsl.errors import RemapError, Span
from remapdsl.indexmap import Runs
from remapdsl.language import rules_from_text
from remapdsl.sharding import LayoutPlan, Mesh, Shard
from remapdsl.sharding.placements import Replicate, local_shard
from remapdsl.sharding.plans import DecodeItem, PartRead, ReadItem

# ------------------------------------------------------------------------------ quantized shards (E412)

QUANTIZED = """remap 1
quantized {P:path}.weight, {P}.weight_scale_inv | fp8_block(block=[%d, 4])
q.weight -> w
q.weight_scale_inv -> w_scale
"""


def _plan_quantized(tmp_path: Path, block_rows: int, dim: int, ranks: int, rank: int):
    """A 12 x 8 fp8 tensor kept quantized (blocks of block_rows x 4), w and its scales sharded on `dim`."""
    tiny_checkpoint(tmp_path, {"q.weight": torch.zeros(12, 8).to(torch.float8_e4m3fn),
                               "q.weight_scale_inv": torch.ones(12 // block_rows, 2)})
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text(QUANTIZED % block_rows, "t.remap"), inventory, {})
    layout = LayoutPlan.from_mapping({"w": [Shard(dim=dim)], "w_scale": [Shard(dim=dim)]}, mesh_dim="tp")
    return remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": ranks}), rank)


def test_shards_on_the_block_grid_plan_their_whole_blocks(tmp_path):
    """12 rows in 3 of 4 each: rank 1 reads rows 4:8 of the values and its one scale row, no more."""
    plan = _plan_quantized(tmp_path, 4, 0, 3, 1)
    assert (plan.bytes_read, plan.bytes_owned) == (4 * 8 + 2 * 4, 4 * 8 + 2 * 4)
    assert [(i.runtime_key, i.local_offsets, i.sizes, i.ckpt_key) for i in plan.items] == [
        ("w_scale", (0, 0), (1, 2), "q.weight_scale_inv"), ("w", (0, 0), (4, 8), "q.weight")]


@pytest.mark.parametrize("block_rows, dim, ranks, rank, diagnostic", [
    (4, 0, 2, 0, ("rank 0's shard of `w` (0:6 of dim 0) cuts inside a block of 4: the values are kept quantized, "
                  "and a shard edge at 6 would split one block's values from its scale",
                  "shard dim 0 in multiples of 4 (an even split of 3 blocks), or dequantize the tensor")),
    (2, 0, 4, 1, ("rank 1's shard of `w` (3:6 of dim 0) cuts inside a block of 2: the values are kept quantized, "
                  "and a shard edge at 3 would split one block's values from its scale",
                  "shard dim 0 in multiples of 2 (an even split of 6 blocks), or dequantize the tensor")),
    (4, 1, 4, 0, None),  # 8 columns in 4 of 2: each cuts a block of 4
    (4, 1, 3, 2, ("rank 2's shard of `w` (6:8 of dim 1) cuts inside a block of 4: the values are kept quantized, "
                  "and a shard edge at 6 would split one block's values from its scale",
                  "shard dim 1 in multiples of 4 (an even split of 2 blocks), or dequantize the tensor")),
])
def test_a_shard_edge_inside_a_block_is_e412_at_the_rule(tmp_path, block_rows, dim, ranks, rank, diagnostic):
    """The first edge off the grid (not the tensor's end) of the first dim that has one, the block,
    the shard, the rank, the rule's span, and the even split."""
    if diagnostic is None:
        diagnostic = ("rank 0's shard of `w` (0:2 of dim 1) cuts inside a block of 4: the values are kept quantized, "
                      "and a shard edge at 2 would split one block's values from its scale",
                      "shard dim 1 in multiples of 4 (an even split of 2 blocks), or dequantize the tensor")
    with pytest.raises(RemapError) as caught:
        _plan_quantized(tmp_path, block_rows, dim, ranks, rank)
    (d,) = caught.value.diagnostics
    assert (d.code, d.message, d.hint, d.span) == ("E412", *diagnostic, Span("t.remap", 3, 1, 3, 14))


# -------------------------------------------------------------------------- decode items of a plan


class _SeenParts(Int8Row):
    """The int8-row format, recording the parts (and, for `views`, the `to` argument) its `views`
    and `cover` are shown."""

    name = "recording_int8_row"
    seen: list = []

    def views(self, parts, params):
        self.seen.append(("views", tuple(parts), params["to"]))
        return tuple(p.shape for p in parts)

    def cover(self, box, parts, params):
        self.seen.append(("cover", tuple(parts)))
        return super().cover(box, parts, params)


@pytest.fixture
def seen_parts():
    """The recording format, registered for one test only (the registry is process-wide)."""
    from remapdsl.quant import register_format, unregister_format

    fmt = register_format(_SeenParts(), replace=True)
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)


def test_a_dequantized_shard_s_decode_item_reads_each_part_s_rows(tmp_path, seen_parts):
    """Rows 2:4 of a 4 x 6 int8_row tensor on rank 1 of 2: one decode item, the box and, per part,
    its covering box, byte runs and row-major strides; the format is shown the parts as the
    header has them; the whole load decodes the values."""
    from remapdsl.quant import Part

    fmt = seen_parts
    values = torch.arange(24, dtype=torch.int8).reshape(4, 6) - 12
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0])
    tiny_checkpoint(tmp_path, {"q.qweight": values, "q.scales": scales})
    text = "remap 1\ndequantize q.qweight, q.scales -> q.weight | recording_int8_row(to=float32)\nq.weight -> w\n"
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    fmt.seen.clear()
    layout = LayoutPlan.from_mapping({"w": [Shard(dim=0)]}, mesh_dim="tp")
    plan = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 2}), 1)
    v, s = inventory.tensors["q.qweight"], inventory.tensors["q.scales"]
    assert plan.items == ()
    assert plan.decodes == (DecodeItem(
        "w", (0, 0), (2, 6), "q.weight", "recording_int8_row", (("to", "float32"),), ((2, 0), (2, 6)),
        (PartRead("q.qweight", "model.safetensors", "int8", (2, 0), (2, 6), Runs(v.byte_offset + 12, 12), (6, 1)),
         PartRead("q.scales", "model.safetensors", "float32", (2,), (2,), Runs(s.byte_offset + 8, 8), (1,))),
        (6, 1), 0, "float32", ()),)
    assert (plan.bytes_read, plan.bytes_owned, plan.scale_bytes_read, plan.files) == (20, 12, 8, ("model.safetensors",))
    assert type(plan.bytes_owned) is int  # a byte count, as `remapdsl plan` prints it
    shown = (Part("q.qweight", "int8", (4, 6)), Part("q.scales", "float32", (4,)))
    assert fmt.seen == [("views", shown, "float32"), ("cover", shown)]
    target = {"w": torch.full((4, 6), float("nan"))}
    remapdsl.load(target, tmp_path, rules_from_text(text, "t.remap"), config={})
    assert torch.equal(target["w"], values.float() * scales[:, None])



class _Int16Row(Int8Row):
    """The int8-row format with two-byte values."""

    name = "int16_row"
    values_dtype = "int16"


def test_a_one_element_dequantized_tensor_owns_all_its_value_bytes(tmp_path):
    """bytes_owned counts the bytes of the values behind the elements a rank holds: both bytes of a
    lone int16 value."""
    from remapdsl.quant import register_format, unregister_format

    tiny_checkpoint(tmp_path, {"q.qweight": torch.tensor([[7]], dtype=torch.int16),
                               "q.scales": torch.tensor([0.5])})
    fmt = register_format(_Int16Row(), replace=True)
    try:
        text = "remap 1\ndequantize q.qweight, q.scales -> q.weight | int16_row(to=float32)\nq.weight -> w\n"
        inventory = remapdsl.open_checkpoint(tmp_path)
        compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
        plan = remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping({"w": [Replicate()]}, mesh_dim="tp"),
                                  Mesh.of({"tp": 1}), 0)
    finally:
        unregister_format(fmt.name)
    assert (plan.bytes_owned, plan.bytes_read) == (2, 6)

# ---------------------------------------------------------------------------------- DCP chunks

def _dcp_folder(root: Path, chunked_values: bool) -> Path:
    """`a` [6, 4] in two chunks of 3 rows, one a file; fp8 values `q.weight` [8, 8] (in two chunks
    too when `chunked_values`) and their scales whole."""
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    q = (torch.arange(64, dtype=torch.float32).reshape(8, 8) / 8).to(torch.float8_e4m3fn)
    first = {"a": a[:3], "q.weight_scale_inv": torch.full((2, 2), 2.0)}
    first_offsets = {"a": [0, 0], "q.weight_scale_inv": [0, 0]}
    second, second_offsets = {"a": a[3:].clone()}, {"a": [3, 0]}
    if chunked_values:
        first["q.weight"], first_offsets["q.weight"] = q[:4].clone(), [0, 0]
        second["q.weight"], second_offsets["q.weight"] = q[4:].clone(), [4, 0]
    else:
        first["q.weight"], first_offsets["q.weight"] = q, [0, 0]
    dcp_chunk(root, "shard-00001-model-00001-of-00001.safetensors", first, first_offsets)
    dcp_chunk(root, "shard-00002-model-00001-of-00001.safetensors", second, second_offsets)
    return root


DCP_RULES = """remap 1
dequantize q.weight, q.weight_scale_inv -> q | fp8_block(block=[4, 4], to=float32)
q -> q
a -> a
"""


def test_a_column_shard_across_chunks_reads_each_chunk_s_rows_into_place(tmp_path):
    """Rank 1 of 2 holds columns 2:4 of `a`: one item per chunk, rows 0:3 and 3:6 of the local
    tensor, each from its own file; the dequantized `q` beside it (its parts whole) plans too."""
    folder = _dcp_folder(tmp_path, chunked_values=False)
    inventory = remapdsl.open_checkpoint(folder)
    assert set(inventory.chunks) == {"a"}
    compiled = remapdsl.compile_rules(rules_from_text(DCP_RULES, "t.remap"), inventory, {})
    layout = LayoutPlan.from_mapping({"a": [Shard(dim=1)], "q": [Shard(dim=1)]}, mesh_dim="tp")
    plan = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 2}), 1)
    chunks = inventory.chunks["a"]
    assert [(i.runtime_key, i.local_offsets, i.sizes, i.ckpt_key, i.file, i.runs) for i in plan.items] == [
        ("a", (0, 0), (3, 2), "a", chunks[0].file, Runs(chunks[0].byte_offset + 8, 8, (3,), (16,))),
        ("a", (3, 0), (3, 2), "a", chunks[1].file, Runs(chunks[1].byte_offset + 8, 8, (3,), (16,))),
    ]
    assert [(d.runtime_key, d.local_offsets, d.sizes, d.box) for d in plan.decodes] == [
        ("q", (0, 0), (8, 4), ((0, 4), (8, 4)))]
    assert (plan.bytes_read, plan.bytes_owned) == (48 + 32 + 8, 48 + 32)
    other = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 2}), 0)
    assert plan.digest() == remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 2}), 1).digest()
    assert len(plan.digest()) == 64 and plan.digest() != other.digest()
    target = {"a": torch.zeros(6, 4), "q": torch.zeros(8, 8)}
    remapdsl.load(target, folder, rules_from_text(DCP_RULES, "t.remap"), config={})
    assert torch.equal(target["a"], torch.arange(24, dtype=torch.float32).reshape(6, 4))


def test_quantized_values_in_chunks_are_e356_naming_the_part_and_its_chunks(tmp_path):
    folder = _dcp_folder(tmp_path, chunked_values=True)
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules_from_text(DCP_RULES, "t.remap"), inventory, {})
    with pytest.raises(RemapError) as caught:
        remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping({}, mesh_dim="tp"), Mesh.of({"tp": 1}), 0)
    (d,) = caught.value.diagnostics
    assert (d.code, d.message, d.hint, d.path) == (
        "E356", "`q` (fp8_block) is made from `q.weight`, which is stored in 2 DCP chunks: quantized parts are read "
                "from whole tensors only",
        "consolidate the checkpoint first (`remapdsl convert CKPT OUT --rules identity`), then load that",
        inventory.root)



# ---------------------------------------------------------------------------------- a plan's order


def test_fill_items_come_first_whatever_the_file_is_named(tmp_path):
    """A `pad`'s fill item is first in a plan, before the reads of a file whose name sorts before
    any letter (`0.safetensors`); it has no key, file, runs or strides (the plan's digest hashes them)."""
    tiny_checkpoint(tmp_path, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, file="0.safetensors")
    inventory = remapdsl.open_checkpoint(tmp_path)
    text = "remap 1\nw -> t | pad(dim=1, to=4, value=7)\n"
    compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    plan = remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping({}, mesh_dim="tp"), Mesh.of({"tp": 1}), 0)
    w = inventory.tensors["w"]
    assert plan.items == (
        ReadItem("t", (0, 3), (2, 1), None, None, None, None, (), (("cast", "float32"),), 7.0, ()),
        ReadItem("t", (0, 0), (2, 3), "w", "0.safetensors", "float32", Runs(w.byte_offset, 24), (3, 1), (), None,
                 (3, 1)))


def test_a_plan_skips_the_tensors_a_rank_does_not_hold_and_is_rank_0_by_default(tmp_path):
    """`make_load_plan` with only the second of two runtime tensors held plans that one (the first
    is passed over, not the end of the plan); without a rank the plan is rank 0's; it owns 12 bytes.
    The same for `make_write_plan`."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_load_plan, make_write_plan

    tiny_checkpoint(tmp_path, {"a": torch.zeros(2, 2), "b": torch.ones(3)})
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\na -> a\nb -> b\n", "t.remap"), inventory, {})
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["a", "b"]
    plan = make_load_plan(compiled, inventory, {"b": whole_shard((3,))})
    assert plan.rank == 0
    assert [(i.runtime_key, i.ckpt_key, i.sizes) for i in plan.items] == [("b", "b", (3,))]
    assert (plan.bytes_owned, plan.bytes_read) == (12, 12)
    assert type(plan.bytes_owned) is int  # a byte count, as `remapdsl plan` prints it
    written = make_write_plan(writers(compiled), inventory, {"b": whole_shard((3,))})
    assert (written.rank, [(i.runtime_key, i.ckpt_key) for i in written.items], written.bytes_written) == (
        0, [("b", "b")], 12)


def test_bytes_owned_add_up_over_the_chunked_tensors_a_rank_holds(tmp_path):
    """Rank 1 of 2 holds columns 2:4 of `a` (both chunks) and rows 3:6 of its copy `b` (the second
    chunk): it owns 48 + 48 bytes, an int, and reads them and no more."""
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    dcp_chunk(tmp_path, "shard-00001-model-00001-of-00001.safetensors", {"a": a[:3]}, {"a": [0, 0]})
    dcp_chunk(tmp_path, "shard-00002-model-00001-of-00001.safetensors", {"a": a[3:].clone()}, {"a": [3, 0]})
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\na -> a\na -> b\n", "t.remap"), inventory, {})
    layout = LayoutPlan.from_mapping({"a": [Shard(dim=1)], "b": [Shard(dim=0)]}, mesh_dim="tp")
    plan = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 2}), 1)
    assert [(i.runtime_key, i.local_offsets, i.sizes) for i in plan.items] == [
        ("a", (0, 0), (3, 2)), ("b", (0, 0), (3, 4)), ("a", (3, 0), (3, 2))]
    assert (plan.bytes_owned, plan.bytes_read) == (96, 96)
    assert type(plan.bytes_owned) is int


DECODE_ORDER_RULES = """remap 1
dequantize a.w, s2 -> x | fp8_block(block=[4, 4], to=float32)
dequantize b.w, s1 -> y | fp8_block(block=[4, 4], to=float32)
x -> zz
y -> aa
"""


@pytest.mark.parametrize("files", [
    {"model.safetensors": ["a.w", "b.w", "s1", "s2"]},  # x's scales stored after y's
    {"a.safetensors": ["a.w", "s1"], "b.safetensors": ["b.w", "s2"]},  # x's scales in y's values' file
])
def test_decode_items_are_in_the_order_of_their_values_in_the_files(tmp_path, files):
    """A plan's decode items go by where their values part lies (file, then offset), not by their
    scales nor by runtime key: `zz` (values `a.w`) before `aa` (values `b.w`)."""
    for name, keys in files.items():
        values = {k: torch.ones(4, 4).to(torch.float8_e4m3fn) for k in keys if k.endswith(".w")}
        tiny_checkpoint(tmp_path, {k: values.get(k, torch.ones(1, 1)) for k in keys}, file=name)
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text(DECODE_ORDER_RULES, "t.remap"), inventory, {})
    plan = remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping({}, mesh_dim="tp"), Mesh.of({"tp": 1}), 0)
    assert [(i.runtime_key, [p.ckpt_key for p in i.parts]) for i in plan.decodes] == [
        ("zz", ["a.w", "s2"]), ("aa", ["b.w", "s1"])]


def test_a_write_plan_keeps_the_stored_scales_unless_asked_to_requantize(tmp_path):
    """`make_write_plan` of a dequantized tensor writes its 16 fp8 values and, by default, not its
    scale (the stored one is kept); with `requantize=True` the 4-byte scale too."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_write_plan

    tiny_checkpoint(tmp_path, {"q.weight": torch.ones(4, 4).to(torch.float8_e4m3fn),
                               "q.weight_scale_inv": torch.ones(1, 1)})
    inventory = remapdsl.open_checkpoint(tmp_path)
    text = "remap 1\ndequantize q.weight, q.weight_scale_inv -> q | fp8_block(block=[4, 4], to=float32)\nq -> w\n"
    compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    args = (writers(compiled), inventory, {"w": whole_shard((4, 4))}, 0, compiled.logical_by_key())
    kept, requantized = make_write_plan(*args), make_write_plan(*args, requantize=True)
    assert (kept.requantize, kept.bytes_written, [i.box for i in kept.encodes]) == (False, 16, [((0, 0), (4, 4))])
    assert (requantized.requantize, requantized.bytes_written) == (True, 20)


def test_a_save_reports_every_file_it_wrote_into(tmp_path):
    """FP8 values in a.safetensors, their scale in b.safetensors: the save writes the values into
    a and copies the stored scale into b, or, with requantize, writes a new scale there: both files
    are the rank's, in its write plan (values; new scales) and in the save's report (copies too)."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_write_plan

    source = tiny_checkpoint(tmp_path / "src", {"q.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)},
                             file="a.safetensors")
    tiny_checkpoint(source, {"q.weight_scale_inv": torch.ones(1, 1)}, {}, file="b.safetensors")
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"q.weight": "a.safetensors", "q.weight_scale_inv": "b.safetensors"}}))
    inventory = remapdsl.open_checkpoint(source)
    rules = rules_from_text("remap 1\ndequantize q.weight, q.weight_scale_inv -> q | fp8_block(block=[4, 4], "
                            "to=float32)\nq -> w\n", "t.remap")
    compiled = remapdsl.compile_rules(rules, inventory, {})
    args = (writers(compiled), inventory, {"w": whole_shard((4, 4))}, 0, compiled.logical_by_key())
    assert make_write_plan(*args).files == ("a.safetensors",)
    assert make_write_plan(*args, requantize=True).files == ("a.safetensors", "b.safetensors")
    state = {"w": torch.ones(4, 4)}
    for requantize in (False, True):
        report = remapdsl.save(state, tmp_path / f"out{requantize}", rules, like=source, requantize=requantize)
        assert report.files == ("a.safetensors", "b.safetensors"), requantize


_DEQUANTIZE_Q = "remap 1\ndequantize q.weight, q.weight_scale_inv -> q | fp8_block(block=[1, 4], to=float32)\n"


def _fp8_rows(tmp_path: Path) -> Path:
    """A checkpoint of q [8, 4] in FP8 with a scale a row."""
    return tiny_checkpoint(tmp_path / "src", {"q.weight": torch.ones(8, 4).to(torch.float8_e4m3fn),
                                              "q.weight_scale_inv": torch.ones(8, 1)}, {})


def test_a_strided_part_of_a_dequantized_tensor_is_e503_on_save(tmp_path):
    """q [8, 4] (FP8, a scale a row) seen as [2, 4, 4] and cut in two on the middle dim: w.a holds
    rows 0, 1, 4, 5, not one box of q, which its format cannot encode: E503 naming both, and no
    output is written."""
    source = _fp8_rows(tmp_path)
    rules = rules_from_text(_DEQUANTIZE_Q + "q -> w.{a,b} | reshape([2, 4, 4]) | split(dim=1, sizes=[2, 2])\n",
                            "t.remap")
    state = {"w.a": torch.zeros(2, 2, 4), "w.b": torch.zeros(2, 2, 4)}
    remapdsl.load(state, source, rules, config={})
    with pytest.raises(RemapError) as caught:
        remapdsl.save(state, tmp_path / "out", rules, like=source)
    (d,) = caught.value.diagnostics
    assert (d.code, d.message) == ("E503", "`w.a` holds a strided part of `q`: it cannot be written back in its format")
    assert (d.span.path, d.span.line) == ("t.remap", 3)
    assert d.hint == ("its format encodes boxes of `q` only: cut it along its own dims, or declare it `quantized` "
                      "to move its stored bytes as they are")
    assert not (tmp_path / "out").exists()


def test_a_strided_part_a_later_rule_writes_is_e503_at_that_rule(tmp_path):
    """q seen as [4, 2, 4] and cut in two on the middle dim: w.a holds the even rows of q (one
    strided box); a first rule reads row 1, so w.a is written as the new part of a later writer,
    and E503 still names the rule that made w.a (line 4)."""
    source = _fp8_rows(tmp_path)
    rules = rules_from_text(_DEQUANTIZE_Q + "q -> w0 | slice(dim=0, start=1, stop=2)\n"
                            "q -> w.{a,b} | reshape([4, 2, 4]) | split(dim=1, sizes=[1, 1])\n", "t.remap")
    state = {"w0": torch.zeros(1, 4), "w.a": torch.zeros(4, 1, 4), "w.b": torch.zeros(4, 1, 4)}
    remapdsl.load(state, source, rules, config={})
    with pytest.raises(RemapError) as caught:
        remapdsl.save(state, tmp_path / "out", rules, like=source)
    (d,) = caught.value.diagnostics
    assert d.code == "E503" and d.message.startswith("`w.a` holds a strided part of `q`")
    assert (d.span.path, d.span.line) == ("t.remap", 4)


def test_a_scalar_tensor_plans_its_read_and_its_write(tmp_path):
    """A 0-d tensor (no first dim to index its blocks by) is read and written whole: 4 bytes each."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_write_plan

    tiny_checkpoint(tmp_path, {"s": torch.tensor(3.0), "v": torch.ones(2)})
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\ns -> s\nv -> v\n", "t.remap"), inventory, {})
    plan = remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping({}, mesh_dim="tp"), Mesh.of({"tp": 1}), 0)
    written = make_write_plan(writers(compiled), inventory, {"s": whole_shard(()), "v": whole_shard((2,))})
    assert [(i.runtime_key, i.sizes, i.runs.total) for i in plan.items] == [("s", (), 4), ("v", (2,), 8)]
    assert [(i.runtime_key, i.sizes, i.runs.total) for i in written.items] == [("s", (), 4), ("v", (2,), 8)]


def test_write_items_are_in_file_order_with_their_source_strides(tmp_path):
    """A write plan's items go by where they write (`y`, stored first, before `z`), not by runtime
    key; each carries its element strides in the file (`b` is `y` transposed: (1, 3))."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import WriteItem, make_write_plan

    tiny_checkpoint(tmp_path, {"y": torch.ones(2, 3), "z": torch.ones(3)})
    inventory = remapdsl.open_checkpoint(tmp_path)
    text = "remap 1\nz -> a\ny -> b | transpose(0, 1)\n"
    compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    plan = make_write_plan(writers(compiled), inventory, {"a": whole_shard((3,)), "b": whole_shard((3, 2))})
    y, z = inventory.tensors["y"], inventory.tensors["z"]
    assert plan.items == (
        WriteItem("b", (0, 0), (3, 2), "y", "model.safetensors", "float32", Runs(y.byte_offset, 24), (1, 3), (), (1, 3)),
        WriteItem("a", (0,), (3,), "z", "model.safetensors", "float32", Runs(z.byte_offset, 12), (1,), (), (1,)))
    assert y.byte_offset < z.byte_offset


def test_a_write_across_chunks_writes_each_chunk_s_part_from_its_place(tmp_path):
    """`a` [6, 4] in two chunks of 3 rows, loaded transposed and scaled: rank 1 of 2 owns runtime
    rows 2:4 (source columns 2:4) and writes them back as one item per chunk, each from its own
    columns of the local tensor, the scale undone."""
    from remapdsl.compile.inverse import writers
    from remapdsl.sharding.plans import WriteItem, make_write_plan

    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    dcp_chunk(tmp_path, "shard-00001-model-00001-of-00001.safetensors", {"a": a[:3]}, {"a": [0, 0]})
    dcp_chunk(tmp_path, "shard-00002-model-00001-of-00001.safetensors", {"a": a[3:].clone()}, {"a": [3, 0]})
    inventory = remapdsl.open_checkpoint(tmp_path)
    text = "remap 1\na -> a | transpose(0, 1) | scale(2)\n"
    compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    owned = {"a": local_shard((4, 6), (2,), [Shard(dim=0)], (1,))}
    plan = make_write_plan(writers(compiled), inventory, owned, 1)
    first, second = inventory.chunks["a"]
    assert plan.items == tuple(
        WriteItem("a", at, (2, 3), "a", chunk.file, "float32", Runs(chunk.byte_offset + 8, 8, (3,), (16,)), (1, 2),
                  (("scale", 0.5),), (1, 4))
        for at, chunk in (((0, 0), first), ((0, 3), second)))
    assert (plan.bytes_written, plan.files) == (48, (first.file, second.file))
