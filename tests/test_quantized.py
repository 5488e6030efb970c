"""Quantized checkpoints: every format against the numpy reference written from its definition
(tests/quant_reference.py), on every box a plan can ask for, through layout ops and shards, with
the bytes read accounted; the errors; a format registered from Python."""

from __future__ import annotations

import pytest
import quant_reference as ref
import torch
from checkpoints import tiny_checkpoint
from depth import scaled
from formats import Int8Row
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl import BindError, Inventory
from remapdsl.compile import compile_rules
from remapdsl.compile.quantized import check_formats
from remapdsl.language import ir, rules_from_text
from remapdsl.quant import Part, get_format, register_format, unregister_format
from remapdsl.sharding import LayoutPlan, Mesh, Shard, layout_for, local_shard
from remapdsl.testing.reference import apply_ops
from remapdsl.testing.strategies import memory_layouts

BF16 = torch.bfloat16
NAN_AND_SUBNORMAL_E4M3 = (0x7F, 0xFF, 0x01, 0x81, 0x07, 0x00, 0x80, 0x7E)
E8M0_EDGES = (0, 1, 127, 254, 255)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit equality, NaN in the same places (any NaN payload)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = torch.isnan(got)
    return bool(torch.equal(nan, torch.isnan(want)) and torch.equal(got[~nan], want[~nan]))


def load_text(text, folder, target=None, **kwargs):
    rules = rules_from_text(text, "t.remap")
    compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), {})
    if target is None:
        target = {d.runtime_key: torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
                  for d in compiled.runtime_tensors}
    report = remapdsl.load(target, folder, rules, config={}, **kwargs)
    return target, report, compiled


# ------------------------------------------------------------------------------ random quantized parts


def make_parts(fmt: str, lead: tuple, rows: int, cols: int, block, g: torch.Generator, scale="float32"):
    """Random physical parts of one logical [*lead, rows, cols] tensor, and its reference decode."""
    if fmt == "fp8_block":
        values = ref.random_codes(g, (*lead, rows, cols), NAN_AND_SUBNORMAL_E4M3).view(torch.float8_e4m3fn)
        grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        if scale == "e8m0":
            scales = ref.random_codes(g, grid, E8M0_EDGES) % 40 + 107  # near 1, then the edges
            scales.view(-1)[:len(E8M0_EDGES)] = torch.tensor(E8M0_EDGES, dtype=torch.uint8)[:scales.numel()]
            scales = scales.view(torch.float8_e8m0fnu)
        else:
            scales = torch.rand(grid, generator=g) * 4 + 1e-3
        return [values, scales], ref.fp8_block(values, scales, block, BF16, scale)
    if fmt == "fp8_tensor":
        values = ref.random_codes(g, (*lead, rows, cols), NAN_AND_SUBNORMAL_E4M3).view(torch.float8_e4m3fn)
        scale_ = torch.rand((1,), generator=g) * 3
        return [values, scale_], ref.fp8_tensor(values, scale_, BF16)
    if fmt == "fp8_channel":
        values = ref.random_codes(g, (*lead, rows, cols), NAN_AND_SUBNORMAL_E4M3).view(torch.float8_e4m3fn)
        scales = torch.rand((*lead, rows, 1), generator=g) * 3
        return [values, scales], ref.fp8_channel(values, scales, BF16)
    if fmt == "mxfp4":
        groups = -(-cols // 32)
        blocks = ref.random_codes(g, (*lead, rows, groups, 16))
        scales = ref.random_codes(g, (*lead, rows, groups)) % 16 + 120
        scales.view(-1)[:len(E8M0_EDGES)] = torch.tensor(E8M0_EDGES, dtype=torch.uint8)[:scales.numel()]
        return [blocks, scales], ref.mxfp4(blocks, scales, BF16)
    assert fmt == "nvfp4"
    half = -(-cols // 2)
    packed = ref.random_codes(g, (*lead, rows, half))
    scales = ref.random_codes(g, (*lead, rows, -(-2 * half // 16)), NAN_AND_SUBNORMAL_E4M3)
    scales = scales.view(torch.float8_e4m3fn)
    global_scale = torch.rand((), generator=g) + 0.01
    return [packed, scales, global_scale], ref.nvfp4(packed, scales, global_scale, BF16)


PARAMS = {"fp8_block": lambda block, scale: {"block": block, "scale": scale, "to": "bfloat16"},
          "fp8_tensor": lambda *_: {"to": "bfloat16"}, "fp8_channel": lambda *_: {"to": "bfloat16"},
          "mxfp4": lambda *_: {"to": "bfloat16"}, "nvfp4": lambda *_: {"to": "bfloat16"}}


def decode_box(fmt_name, tensors, params, box):
    """What a plan does for one box: cover, cut the parts to their covers, decode."""
    fmt = get_format(fmt_name)
    parts = [Part(f"p{i}", str(t.dtype).removeprefix("torch."), tuple(t.shape)) for i, t in enumerate(tensors)]
    shape = fmt.logical_shape(parts, params)
    views = fmt.views(parts, params)
    covers = fmt.cover(box, parts, params)
    cut = []
    for t, view, (offsets, sizes) in zip(tensors, views, covers):
        t = t.reshape(view)
        cut.append(t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous())
    out = torch.empty(box[1], dtype=BF16)
    fmt.decode(cut, box, covers, params, out)
    return shape, covers, out


@st.composite
def format_cases(draw):
    fmt = draw(st.sampled_from(sorted(PARAMS)))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    rows = draw(st.integers(1, 40))
    if fmt == "mxfp4":
        cols = 32 * draw(st.integers(1, 3))
    elif fmt == "nvfp4":
        cols = 2 * draw(st.integers(1, 40))
    else:
        cols = draw(st.integers(1, 40))
    block = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    scale = draw(st.sampled_from(["float32", "e8m0"]))
    shape = (*lead, rows, cols)
    offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))
    return fmt, lead, rows, cols, block, scale, (offsets, sizes), draw(st.integers(0, 2**31))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(format_cases())
def test_every_box_decodes_like_the_reference(case):
    """Any box of any format, edge blocks and every byte code included, equals the reference's
    decode of the whole tensor cut to that box; the covers stay inside the parts."""
    fmt, lead, rows, cols, block, scale, box, seed = case
    tensors, want = make_parts(fmt, lead, rows, cols, block, torch.Generator().manual_seed(seed), scale)
    params = PARAMS[fmt](block, scale)
    shape, covers, got = decode_box(fmt, tensors, params, box)
    assert shape == tuple(want.shape)
    (offsets, sizes) = box
    assert same(got, want[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    views = get_format(fmt).views([Part("", "", tuple(t.shape)) for t in tensors], params)
    for (o, n), view in zip(covers, views):
        assert all(0 <= a and a + b <= v for a, b, v in zip(o, n, view)), (covers, views)


@pytest.mark.parametrize("rows", [576, 1000, 128, 1])
def test_partial_edge_blocks_load_exactly(tmp_path, rows):
    """A 576- or 1000-row weight in 128-blocks (a partial last block row; transformers raises on
    the first and mis-scales the second) dequantizes exactly."""
    g = torch.Generator().manual_seed(rows)
    (values, scales), want = make_parts("fp8_block", (), rows, 256, (128, 128), g)
    tiny_checkpoint(tmp_path, {"w.weight": values, "w.weight_scale_inv": scales}, {})
    got, report, _ = load_text("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[128, 128], to=bfloat16)
w.weight -> w
""", tmp_path)
    assert same(got["w"], want)
    assert report.bytes_read == values.numel() + scales.numel() * 4
    assert report.scale_bytes_read == scales.numel() * 4


def test_layout_ops_after_dequantize_equal_torch_ops_on_the_reference(tmp_path):
    """Stack experts, fuse gate/up, transpose, cast: the ops apply to the logical tensors."""
    g = torch.Generator().manual_seed(0)
    tensors, want = {}, {}
    for e in range(3):
        for name, rows in (("gate", 40), ("up", 40), ("down", 24)):
            cols = 24 if name != "down" else 40
            (v, s), w = make_parts("fp8_block", (), rows, cols, (16, 16), g)
            tensors[f"e.{e}.{name}.weight"], tensors[f"e.{e}.{name}.weight_scale_inv"] = v, s
            want[(e, name)] = w
    tiny_checkpoint(tmp_path, tensors, {})
    got, _, compiled = load_text("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[16, 16], to=bfloat16)
e.{E}.{gate,up}.weight -> gate_up | stack(E, dim=0) | concat(dim=1)
e.{E}.down.weight -> down_t | stack(E, dim=0) | transpose(1, 2) | cast(float32)
""", tmp_path)
    assert len(compiled.logical) == 9
    gate_up = torch.stack([torch.cat([want[(e, "gate")], want[(e, "up")]]) for e in range(3)])
    assert same(got["gate_up"], gate_up)
    down_t = torch.stack([want[(e, "down")] for e in range(3)]).transpose(1, 2).float()
    assert same(got["down_t"], down_t)


# format -> (the checkpoint's names of its parts, the dequantize statement, the logical key), block (8, 16)
STATEMENTS = {
    "fp8_block": (("x.weight", "x.weight_scale_inv"), ("{P:path}.weight, {P}.weight_scale_inv -> {P}.weight "
                  "| fp8_block(block=[8, 16], to=bfloat16)"), "x.weight"),
    "fp8_tensor": (("x.weight", "x.weight_scale"), ("{P:path}.weight, {P}.weight_scale -> {P}.weight "
                   "| fp8_tensor(to=bfloat16)"), "x.weight"),
    "fp8_channel": (("x.weight", "x.weight_scale"), ("{P:path}.weight, {P}.weight_scale -> {P}.weight "
                    "| fp8_channel(to=bfloat16)"), "x.weight"),
    "mxfp4": (("x_blocks", "x_scales"), "{P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)", "x"),
    "nvfp4": (("x.weight", "x.weight_scale", "x.weight_scale_2"), ("{P:path}.weight, {P}.weight_scale, "
              "{P}.weight_scale_2 -> {P}.weight | nvfp4(to=bfloat16)"), "x.weight"),
}


@pytest.mark.parametrize("fmt", sorted(PARAMS))
def test_each_format_through_a_load(tmp_path, fmt):
    g = torch.Generator().manual_seed(7)
    cols = {"mxfp4": 64, "nvfp4": 48}.get(fmt, 40)
    tensors, want = make_parts(fmt, (), 20, cols, (8, 16), g)
    names, statement, logical = STATEMENTS[fmt]
    tiny_checkpoint(tmp_path, dict(zip(names, tensors)), {})
    got, report, _ = load_text(f"remap 1\ndequantize {statement}\n{logical} -> out | transpose(0, 1)\n", tmp_path)
    assert same(got["out"], want.t())
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in tensors)


@settings(max_examples=scaled(40), deadline=None)
@given(st.sampled_from(sorted(PARAMS)), st.data())
def test_a_dequantized_tensor_fills_any_destination_through_any_ops_and_shard(tmp_path_factory, fmt, data):
    """Each format's logical tensor, then ops drawn after it (transpose, a cast to float32 of the bfloat16
    decode, a scale, rows in rotary order), into rank 0's shard of a drawn cut (or the whole tensor),
    held in a drawn memory layout: the destination holds the reference decode with the reference's ops
    applied (`remapdsl.testing.reference`), cut as `torch.chunk` cuts it (DTensor's Shard), bit for bit,
    and nothing around it changes."""
    rows = data.draw(st.integers(1, 20), label="rows")
    cols = {"mxfp4": 32 * data.draw(st.integers(1, 2)), "nvfp4": 2 * data.draw(st.integers(1, 12))}.get(
        fmt, data.draw(st.integers(1, 24), label="cols"))
    tensors, want = make_parts(fmt, (), rows, cols, (8, 16), torch.Generator().manual_seed(data.draw(
        st.integers(0, 2**16), label="seed")))
    rotary = ["rope_permute(heads=1)"] if rows % 2 == 0 else []  # rows in pair order: a strided piece of the box
    ops = data.draw(st.lists(st.sampled_from(["transpose(0, 1)", "cast(float32)", "scale(3)", *rotary]), max_size=3,
                             unique=True), label="ops")
    if rotary and "transpose(0, 1)" in ops[:ops.index(rotary[0]) if rotary[0] in ops else 0] and cols % 2:
        ops.remove(rotary[0])  # the rows it would order are the transposed columns: an odd count
    names, statement, logical = STATEMENTS[fmt]
    rules = rules_from_text(f"remap 1\ndequantize {statement}\n{logical} -> out" + "".join(f" | {o}" for o in ops)
                            + "\n", "t.remap")
    (rule,) = [r for r in rules.statements if isinstance(r, ir.Rule)]
    (want,) = apply_ops(list(rule.ops), [want])
    pieces = data.draw(st.integers(1, 3), label="ranks")
    dim = data.draw(st.integers(0, 1), label="cut dim")
    want = torch.chunk(want, pieces, dim)[0]
    held = data.draw(memory_layouts(want.shape, want.dtype), label="destination")
    folder = tiny_checkpoint(tmp_path_factory.mktemp("q"), dict(zip(names, tensors)), {})
    shard = {"layout": LayoutPlan.from_mapping({"out": [Shard(dim=dim)]}), "mesh": Mesh.of({"tp": pieces})}
    remapdsl.load({"out": held.tensor}, folder, rules, config={}, **(shard if pieces > 1 else {}))
    assert same(held.tensor, want), held.how
    assert held.outside().isnan().all(), held.how

def test_a_weight_without_a_scale_passes_through(tmp_path):
    g = torch.Generator().manual_seed(1)
    (v, s), want = make_parts("fp8_block", (), 8, 8, (4, 4), g)
    norm = torch.randn(8).to(BF16)
    tiny_checkpoint(tmp_path, {"a.weight": v, "a.weight_scale_inv": s, "norm.weight": norm}, {})
    got, _, compiled = load_text("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[4, 4], to=bfloat16)
{n:seg}.weight -> {n}
""", tmp_path)
    assert [s.logical_key for s in compiled.logical] == ["a.weight"]
    assert same(got["a"], want) and torch.equal(got["norm"], norm)


# ------------------------------------------------------------------------------------ narrow reads


def test_tp_shards_read_only_their_values_and_covering_scales(tmp_path):
    """Column and row shards under TP=4 of dequantized weights (blocks cut by the shard edges):
    each rank's values are exactly its elements, its scales the covering tiles, and what it
    decodes equals the reference cut to its shard."""
    g = torch.Generator().manual_seed(3)
    (qv, qs), q_want = make_parts("fp8_block", (), 200, 96, (32, 32), g)  # 200 rows: uneven, partial
    (ov, os_), o_want = make_parts("fp8_block", (), 96, 200, (32, 32), g)
    (ev, es), e_want = make_parts("mxfp4", (4,), 48, 64, None, g)
    tiny_checkpoint(tmp_path, {"q.weight": qv, "q.weight_scale_inv": qs, "o.weight": ov,
                               "o.weight_scale_inv": os_, "experts_blocks": ev, "experts_scales": es}, {})
    text = """remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[32, 32], to=bfloat16)
dequantize {P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)
q.weight -> q
o.weight -> o
experts -> experts | transpose(1, 2)
"""
    rules = rules_from_text(text, "t.remap")
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    mesh = Mesh.of({"tp": 4})
    layout = LayoutPlan.from_mapping({"q": "colwise", "o": "rowwise", "experts": [Shard(dim=2)]}, mesh_dim="tp")
    full = {"q": q_want, "o": o_want, "experts": e_want.transpose(1, 2)}
    total_values = 0
    for rank in range(4):
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        assert plan.bytes_read == plan.bytes_owned + plan.scale_bytes_read
        local, shards = {}, {}
        for key, whole in full.items():
            shard = local_shard(whole.shape, mesh.sizes, layout_for(key, whole.shape, layout, mesh),
                                mesh.coordinate(rank))
            local[key] = torch.full(shard.shape, float("nan"), dtype=BF16)
            shards[key] = shard
        from remapdsl.runtime.read import run_load_plan

        run_load_plan(plan, inventory, local)
        for key, shard in shards.items():
            (box,) = shard.boxes
            assert same(local[key], full[key][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))])
        total_values += plan.bytes_owned
        # the values read are the rank's elements; the scale rows read are those its rows touch
        q_rows = shards["q"].boxes[0]
        q_item = next(i for i in plan.decodes if i.runtime_key == "q")
        assert q_item.parts[0].runs.total == q_rows.sizes[0] * 96
        first, last = q_rows.offsets[0] // 32, -(-(q_rows.offsets[0] + q_rows.sizes[0]) // 32)
        assert q_item.parts[1].runs.total == (last - first) * 3 * 4
    assert total_values == qv.numel() + ov.numel() + ev.numel()


# ------------------------------------------------------------------------------------------ errors


def bind_error(text, folder) -> BindError:
    with pytest.raises(BindError) as info:
        remapdsl.compile_rules(rules_from_text(text, "t.remap"), remapdsl.open_checkpoint(folder), {})
    return info.value


def test_a_scale_grid_that_does_not_fit_is_an_error(tmp_path):
    tiny_checkpoint(tmp_path, {"a.weight": torch.zeros(576, 256).to(torch.float8_e4m3fn),
                               "a.weight_scale_inv": torch.ones(4, 2)}, {})
    err = bind_error("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[128, 128], to=bfloat16)
a.weight -> a
""", tmp_path)
    d = err.diagnostics[0]
    assert d.code == "E221" and d.span.line == 2
    assert "[4, 2]" in d.message and "[5, 2]" in d.message and "a.weight_scale_inv" in d.message


def test_values_of_the_wrong_dtype_are_an_error(tmp_path):
    tiny_checkpoint(tmp_path, {"a.weight": torch.zeros(8, 8, dtype=BF16), "a.weight_scale_inv": torch.ones(1, 1)},
                    {})
    err = bind_error("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[8, 8], to=bfloat16)
a.weight -> a
""", tmp_path)
    assert err.diagnostics[0].code == "E221" and "bfloat16, expected float8_e4m3fn" in err.diagnostics[0].message


def test_a_scale_without_its_weight_is_an_error(tmp_path):
    tiny_checkpoint(tmp_path, {"a.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn),
                               "a.weight_scale_inv": torch.ones(1, 1), "b.weight_scale_inv": torch.ones(1, 1)}, {})
    err = bind_error("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[8, 8], to=bfloat16)
a.weight -> a
""", tmp_path)
    assert err.diagnostics[0].code == "E222" and "b.weight_scale_inv" in err.diagnostics[0].message


def test_the_wrong_number_of_parts_is_an_error(tmp_path):
    tiny_checkpoint(tmp_path, {"a.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn), "a.weight_scale": torch.ones(1)},
                    {})
    err = bind_error("""remap 1
dequantize {P:path}.weight, {P}.weight_scale, {P}.weight_scale -> {P}.weight | fp8_tensor(to=bfloat16)
a.weight -> a
""", tmp_path)
    assert err.diagnostics[0].code == "E221" and "takes 2 source tensors" in err.diagnostics[0].message


def test_a_logical_name_taken_by_a_checkpoint_tensor_is_an_error(tmp_path):
    tiny_checkpoint(tmp_path, {"a.q": torch.zeros(8, 8).to(torch.float8_e4m3fn), "a.s": torch.ones(1),
                               "a.weight": torch.zeros(2)}, {})
    err = bind_error("""remap 1
dequantize {P:path}.q, {P}.s -> {P}.weight | fp8_tensor(to=bfloat16)
a.weight -> a
""", tmp_path)
    assert err.diagnostics[0].code == "E223"


# ------------------------------------------------------------------------ a format from Python


@pytest.fixture
def int8_row():
    fmt = register_format(Int8Row())
    yield fmt
    unregister_format("int8_row")


def test_a_format_registered_from_python(tmp_path, int8_row):
    values = torch.randint(-128, 128, (6, 10), dtype=torch.int8)
    scales = torch.rand(6)
    tiny_checkpoint(tmp_path, {"a.qweight": values, "a.scales": scales}, {})
    got, _, _ = load_text("""remap 1
dequantize {P:path}.qweight, {P}.scales -> {P}.weight | int8_row(to=bfloat16)
a.weight -> a
""", tmp_path)
    assert torch.equal(got["a"], (values.double() * scales.double()[:, None]).float().to(BF16))
    formatted = remapdsl.language.format_rules(remapdsl.language.parse_text(
        "remap 1\ndequantize {P:path}.qweight, {P}.scales -> {P}.weight | int8_row(to=bfloat16)\n", "t.remap"))
    assert "int8_row(to=bfloat16)" in formatted


def test_registered_format_arguments_are_checked(int8_row):
    with pytest.raises(remapdsl.RemapError) as info:
        check_formats(rules_from_text("remap 1\nquantized {P:path}.q, {P}.s | int8_row(too=bfloat16)\n", "t.remap"))
    codes = [d.code for d in info.value.diagnostics]
    assert "E128" in codes and "`too`" in str(info.value) and "did you mean `to`" in str(info.value)


def test_an_unknown_format_names_the_registered_ones(int8_row, tmp_path):
    path = tmp_path / "t.remap"
    path.write_text("remap 1\ndequantize {P:path}.q, {P}.s -> {P} | int8_rows(to=bfloat16)\n")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.load_rules(path)  # the public loader checks format calls against the registry
    assert info.value.diagnostics[0].code == "E035" and "int8_row" in str(info.value)


def test_rules_naming_a_format_load_before_it_is_registered_and_compile_checks_it(int8_row):
    """The language layer does not ask the registry; the compile layer does, before anything binds."""
    text = "remap 1\ndequantize {P:path}.q, {P}.s -> {P} | int8_row(to=bfloat16)\nw -> w\n"
    unregister_format("int8_row")
    rules = rules_from_text(text, "t.remap")
    inventory = Inventory.from_shapes({"w.q": ("int8", (2, 4)), "w.s": ("float32", (2,))})
    with pytest.raises(remapdsl.RemapError) as info:
        compile_rules(rules, inventory)
    assert info.value.diagnostic.code == "E035"
    register_format(int8_row)
    assert [t.runtime_key for t in compile_rules(rules, inventory).runtime_tensors] == ["w"]


@pytest.mark.parametrize("sizes, takes", [(("rows", "cols"), "two sizes, [rows, cols]"),
                                          (tuple("abcde"), "5 sizes, [a, b, c, d, e]")])
def test_a_format_parameter_of_fixed_sizes_is_checked_like_block(int8_row, sizes, takes):
    """`Param(sizes=...)` fixes the length of a literal list (E125, the count in words up to four) and each
    size's least value (E122)."""
    from remapdsl.params import Param

    class Tiled(Int8Row):
        name = "int8_tiled"
        params = (Param("tile", "ints", sizes=sizes), *Int8Row.params)

    register_format(Tiled())
    try:
        with pytest.raises(remapdsl.RemapError) as info:
            check_formats(rules_from_text(
                "quantized a, s | int8_tiled(tile=[4])\nquantized b, t | int8_tiled(tile=[4, 0])\n"))
        want = [("E125", f"`tile` takes {takes}; got 1")]
        if len(sizes) != 2:  # [4, 0] is of another length too
            want.append(("E125", f"`tile` takes {takes}; got 2"))
        assert [(d.code, d.message) for d in info.value.diagnostics] == [
            *want, ("E122", "tile sizes must be at least 1, not 0")]
    finally:
        unregister_format("int8_tiled")


@pytest.mark.parametrize("first, second", [("builtin", "registry"), ("registry", "builtin"), ("format", "builtin")])
def test_the_quant_modules_import_in_any_order(first, second):
    """quant/ has no import cycle: its modules import in any order, and Param is the shared one."""
    import subprocess
    import sys

    code = (f"import remapdsl.quant.{first}, remapdsl.quant.{second}, remapdsl.quant as q; "
            "assert q.get_format('nvfp4').params[0].__class__.__module__ == 'remapdsl.params'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------- stored as they are


PASS_THROUGH = """remap 1
quantized {P:path}.weight, {P}.weight_scale_inv | fp8_block(block=[128, 128])
e.{E}.{gate,up}.weight -> gate_up | stack(E, dim=0) | concat(dim=1)
e.{E}.{gate,up}.weight_scale_inv -> gate_up_scale | stack(E, dim=0) | concat(dim=1)
"""


def fp8_experts(folder, rows, g=None):
    g = g or torch.Generator().manual_seed(rows)
    tensors = {}
    for e in range(2):
        for name in ("gate", "up"):
            (v, s), _ = make_parts("fp8_block", (), rows, 256, (128, 128), g)
            tensors[f"e.{e}.{name}.weight"], tensors[f"e.{e}.{name}.weight_scale_inv"] = v, s
    return tiny_checkpoint(folder, tensors, {}), tensors


def test_stored_fp8_moves_as_it_is_when_cuts_fall_on_blocks(tmp_path):
    folder, tensors = fp8_experts(tmp_path, 256)
    got, report, compiled = load_text(PASS_THROUGH, folder)
    want = torch.stack([torch.cat([tensors[f"e.{e}.gate.weight"], tensors[f"e.{e}.up.weight"]]) for e in range(2)])
    assert torch.equal(got["gate_up"].view(torch.uint8), want.view(torch.uint8))
    scales = torch.stack([torch.cat([tensors[f"e.{e}.{n}.weight_scale_inv"] for n in ("gate", "up")]) for e in range(2)])
    assert torch.equal(got["gate_up_scale"], scales)
    assert compiled.runtime_tensor("gate_up").grid == (1, 128, 128)
    assert [q.values for q in compiled.quantized] == sorted(k for k in tensors if k.endswith(".weight"))


def test_fusing_stored_fp8_off_the_block_grid_is_an_error(tmp_path):
    """gate and up of 200 rows: up would start at row 200 of the fused tensor, inside a block whose
    one scale cannot serve both (transformers mixes the scales silently; vLLM refuses at start)."""
    folder, _ = fp8_experts(tmp_path, 200)
    err = bind_error(PASS_THROUGH, folder)
    d = err.diagnostics[0]
    assert d.code == "E224" and d.span.line == 3
    assert "`e.0.gate.weight`" in d.message and "offset 200" in d.message and "`gate_up`" in d.message


def test_slicing_stored_fp8_inside_a_block_is_an_error(tmp_path):
    folder, _ = fp8_experts(tmp_path, 256)
    err = bind_error("""remap 1
quantized {P:path}.weight, {P}.weight_scale_inv | fp8_block(block=[128, 128])
e.{E}.{gate,up}.weight -> e{E}.{gate,up}.head | slice(dim=0, start=0, stop=100)
drop e.{E}.{gate,up}.weight_scale_inv
""", folder)
    assert err.diagnostics[0].code == "E224" and "source offset 100" in err.diagnostics[0].message


def test_fusing_two_one_scale_tensors_is_an_error(tmp_path):
    fp8 = torch.zeros(8, 8).to(torch.float8_e4m3fn)
    tiny_checkpoint(tmp_path, {"q.weight": fp8, "q.weight_scale": torch.ones(1), "k.weight": fp8.clone(),
                               "k.weight_scale": torch.ones(1)}, {})
    err = bind_error("""remap 1
quantized {P:path}.weight, {P}.weight_scale | fp8_tensor()
{q,k}.weight -> qk | concat(dim=0)
{q,k}.weight_scale -> qk_scale | concat(dim=0)
""", tmp_path)
    assert err.diagnostics[0].code == "E224" and "one scale" in err.diagnostics[0].message


def test_a_shard_edge_inside_a_block_of_stored_values_is_an_error(tmp_path):
    folder, _ = fp8_experts(tmp_path, 256)
    rules = rules_from_text(PASS_THROUGH, "t.remap")
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    layout = LayoutPlan.from_mapping({"gate_up": [Shard(dim=1)], "gate_up_scale": [Shard(dim=1)]}, mesh_dim="tp")
    for rank in range(4):  # 512 rows in 4: 128 each, whole blocks, and the scale rows follow
        plan = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 4}), rank)
        assert plan.bytes_read == plan.bytes_owned
    with pytest.raises(remapdsl.RemapError) as info:  # 512 rows in 3: 171 per rank
        remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": 3}), 0)
    d = info.value.diagnostics[0]
    assert d.code == "E412" and "gate_up" in d.message and "171" in d.message


# --------------------------------------------------------------------------- saving back


SAFE_E4M3 = tuple(c for c in range(256) if c & 0x7F != 0x7F)  # every code but NaN (its sign is not kept)


@pytest.mark.parametrize("fmt, rows, to", [("fp8_block", 576, "bfloat16"), ("fp8_block", 100, "float32"),
                                           ("fp8_tensor", 40, "bfloat16"), ("fp8_channel", 40, "float16")])
def test_a_dequantized_load_saves_back_byte_for_byte(tmp_path, fmt, rows, to):
    """Values decoded and left unchanged are encoded again with the stored scales, exactly; the
    scales are copied. Every finite code, subnormals included, a partial last block."""
    import filecmp

    g = torch.Generator().manual_seed(rows)
    codes = torch.tensor(SAFE_E4M3, dtype=torch.uint8)[torch.randint(0, len(SAFE_E4M3), (rows, 200), generator=g)]
    values = codes.view(torch.float8_e4m3fn)
    scale = {"fp8_block": torch.rand(-(-rows // 128), 2, generator=g) * 4 + 1e-3,
             "fp8_tensor": torch.rand(1, generator=g) + 0.1, "fp8_channel": torch.rand(rows, 1, generator=g) + 0.1}[fmt]
    suffix = "weight_scale_inv" if fmt == "fp8_block" else "weight_scale"
    source = tiny_checkpoint(tmp_path / "src", {"w.weight": values, f"w.{suffix}": scale}, {})
    call = "fp8_block(block=[128, 128], to=DT)" if fmt == "fp8_block" else f"{fmt}(to=DT)"
    text = f"remap 1\nlet DT = {to}\ndequantize {{P:path}}.weight, {{P}}.{suffix} -> {{P}}.weight | {call}\n" \
           "w.weight -> w | transpose(0, 1)\n"
    got, _, _ = load_text(text, source)
    rules = rules_from_text(text, "t.remap")
    remapdsl.save(got, tmp_path / "out", rules, like=source)
    assert filecmp.cmp(source / "model.safetensors", tmp_path / "out" / "model.safetensors", shallow=False)


def test_a_dequantized_tensor_read_through_value_steps_saves_back_byte_for_byte(tmp_path):
    """`scale(2) | add(1)` on decoded values: the save undoes them (`add(-1)`, then `scale(0.5)`)
    before encoding with the stored scales, so the bytes come back; applying the load's steps
    again, or none, would encode other values."""
    import filecmp

    g = torch.Generator().manual_seed(7)
    signed = [c for c in SAFE_E4M3 if c != 0x80]  # -0 comes back +0 through `add`
    codes = torch.tensor(signed, dtype=torch.uint8)[torch.randint(0, len(signed), (130, 64), generator=g)]
    source = tiny_checkpoint(tmp_path / "src", {"w.weight": codes.view(torch.float8_e4m3fn),
                                                "w.weight_scale_inv": torch.rand(2, 1, generator=g) + 0.5}, {})
    text = "remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | " \
           "fp8_block(block=[128, 128], to=float64)\nw.weight -> w | scale(2) | add(1)\n"
    got, _, _ = load_text(text, source)
    plain, _, _ = load_text(text.replace(" | scale(2) | add(1)", ""), source)
    assert torch.allclose(got["w"], plain["w"] * 2 + 1, rtol=1e-6, atol=0)
    remapdsl.save(got, tmp_path / "out", rules_from_text(text, "t.remap"), like=source)
    assert filecmp.cmp(source / "model.safetensors", tmp_path / "out" / "model.safetensors", shallow=False)


def test_a_value_beyond_the_stored_scale_cannot_be_saved(tmp_path):
    source = tiny_checkpoint(tmp_path / "src", {"w.weight": torch.ones(4, 4).to(torch.float8_e4m3fn),
                                                "w.weight_scale_inv": torch.ones(1, 1)}, {})
    text = "remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | " \
           "fp8_block(block=[4, 4], to=float32)\nw.weight -> w\n"
    got, _, _ = load_text(text, source)
    got["w"][0, 0] = 1000.0  # 448 is the largest E4M3 value times a scale of 1
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.save(got, tmp_path / "out", rules_from_text(text, "t.remap"), like=source)
    assert info.value.diagnostics[0].code == "E503" and "beyond 448" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_requantize_writes_new_block_scales(tmp_path):
    """requantize=True: scales amax / 448 per block from the values the model holds (here doubled),
    the values their nearest E4M3 codes; a partial last block included."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 72, generator=g)
    q, s = __import__("quant_reference").quantize_fp8_block(weight, (64, 64))
    source = tiny_checkpoint(tmp_path / "src", {"w.weight": q, "w.weight_scale_inv": s}, {})
    text = "remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | " \
           "fp8_block(block=[64, 64], to=float32)\nw.weight -> w\n"
    got, _, _ = load_text(text, source)
    got["w"] *= 2
    remapdsl.save(got, tmp_path / "out", rules_from_text(text, "t.remap"), like=source, requantize=True)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    want_q, want_s = __import__("quant_reference").quantize_fp8_block(got["w"], (64, 64))
    assert torch.equal(saved["w.weight_scale_inv"], want_s)
    assert torch.equal(saved["w.weight"].view(torch.uint8), want_q.view(torch.uint8))


def test_requantize_needs_whole_blocks_on_a_rank(tmp_path):
    source = tiny_checkpoint(tmp_path / "src", {"w.weight": torch.ones(8, 8).to(torch.float8_e4m3fn),
                                                "w.weight_scale_inv": torch.ones(2, 2)}, {})
    text = "remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | " \
           "fp8_block(block=[4, 4], to=float32)\nw.weight -> a | slice(dim=0, start=0, stop=6)\n" \
           "w.weight -> b | slice(dim=0, start=6, stop=8)\n"
    got, _, _ = load_text(text, source)
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.save(got, tmp_path / "out", rules_from_text(text, "t.remap"), like=source, requantize=True)
    assert info.value.diagnostics[0].code == "E503" and "whole blocks" in str(info.value)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_loads_save_back_byte_for_byte(tmp_path, fmt):
    """Every byte of packed values, finite scales: decoded to bfloat16 and written back unchanged."""
    import filecmp

    g = torch.Generator().manual_seed(11)
    if fmt == "mxfp4":
        blocks = ref.random_codes(g, (3, 10, 4, 16))
        scales = ref.random_codes(g, (3, 10, 4)) % 60 + 100  # 2^-27 .. 2^32
        tensors, names = [blocks, scales], ("x_blocks", "x_scales")
        statement = "{P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)"
    else:
        packed = ref.random_codes(g, (10, 24))
        scale_codes = torch.tensor(SAFE_E4M3, dtype=torch.uint8)[torch.randint(0, len(SAFE_E4M3), (10, 3), generator=g)]
        tensors = [packed, scale_codes.view(torch.float8_e4m3fn), torch.tensor(0.75)]
        names = ("x.weight", "x.weight_scale", "x.weight_scale_2")
        statement = "{P:path}.weight, {P}.weight_scale, {P}.weight_scale_2 -> {P}.weight | nvfp4(to=bfloat16)"
    source = tiny_checkpoint(tmp_path / "src", dict(zip(names, tensors)), {})
    logical = "x" if fmt == "mxfp4" else "x.weight"
    text = f"remap 1\ndequantize {statement}\n{logical} -> out | transpose(-1, -2)\n"
    got, _, _ = load_text(text, source)
    remapdsl.save(got, tmp_path / "out", rules_from_text(text, "t.remap"), like=source)
    assert filecmp.cmp(source / "model.safetensors", tmp_path / "out" / "model.safetensors", shallow=False)


@pytest.mark.parametrize("sizes", [[64, 192], [128, 128], [200, 56]])
def test_a_dequantized_tensor_split_inside_a_block_saves_back_to_the_same_bytes(tmp_path, sizes):
    """fp8 blocks of 128 x 128 split by rows at `sizes` (at row 64 or 200: inside a block) into two runtime
    tensors: each piece is encoded back at its own place in its block, so the unchanged model saves to the
    files it was loaded from, byte for byte, with the stored scales."""
    g = torch.Generator().manual_seed(sizes[0])
    values = (torch.randn(256, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5], [2.0]])  # powers of two: bfloat16 holds each value times its scale exactly
    like = tiny_checkpoint(tmp_path / "like", {"a.weight": values, "a.weight_scale_inv": scales}, {})
    rules = rules_from_text(
        "remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[128, 128], "
        f"to=bfloat16)\na.weight -> {{p,q}} | split(dim=0, sizes={sizes})\n", "split.remap")
    state = remapdsl.compile_rules(rules, like).empty_state_dict()
    remapdsl.load(state, like, rules)
    remapdsl.save(state, tmp_path / "out", rules, like=like)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (like / "model.safetensors").read_bytes()
