"""The save direction's inverse (remapdsl/compile/inverse.py) and the symbolic tensors
(remapdsl/compile/symbolic.py), as the mutation run found them untested: E503's whole diagnostic
with and without requantize, a format that writes back with its stored scales but makes no new
ones, and a checkpoint tensor two rules read in overlapping parts (the first rule writes the
overlap, the second only what is left). Real checkpoints, loaded and saved through the public API."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from formats import Int8Row
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl.language import rules_from_text
from remapdsl.quant import get_format, register_format, unregister_format


def _write(folder: Path, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


def _load(text: str, folder: Path) -> tuple[dict, object]:
    """The runtime tensors the rules make from the checkpoint (filled by remapdsl.load), and the rules."""
    rules = rules_from_text("remap 1\n" + text, "t.remap")
    compiled = remapdsl.compile_rules(rules, folder, {})
    state = {d.runtime_key: torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
             for d in compiled.runtime_tensors}
    remapdsl.load(state, folder, rules, config={})
    return state, rules


def _save_error(state: dict, out: Path, rules, like: Path, **kwargs) -> list[tuple]:
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.save(state, out, rules, like=like, **kwargs)
    assert not out.exists()  # refused before any byte is written
    return [(d.code, d.message, tuple(d.span[:5]) if d.span else None, d.hint) for d in info.value.diagnostics]


# -- inverse.py: which formats write back, and E503 --

_FP8_TENSOR = "dequantize {P:path}.weight, {P}.weight_scale -> {P}.weight | fp8_tensor(to=float32)\nq.weight -> q\n"


@pytest.fixture
def fp8_tensor_checkpoint(tmp_path) -> Path:
    """q.weight: float8 [4, 4] values (multiples of 0.5) with one float32 scale of 2."""
    values = (torch.arange(16, dtype=torch.float32).reshape(4, 4) / 2).to(torch.float8_e4m3fn)
    return _write(tmp_path / "src", {"q.weight": values, "q.weight_scale": torch.tensor([2.0])})


def test_a_format_that_encodes_writes_back_with_its_stored_scales(tmp_path, fp8_tensor_checkpoint):
    """fp8_tensor encodes but does not requantize: a plain save writes the same bytes back."""
    assert get_format("fp8_tensor").encodes and not get_format("fp8_tensor").requantizes
    state, rules = _load(_FP8_TENSOR, fp8_tensor_checkpoint)
    assert torch.equal(state["q"], torch.arange(16, dtype=torch.float32).reshape(4, 4))
    remapdsl.save(state, tmp_path / "out", rules, like=fp8_tensor_checkpoint)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (fp8_tensor_checkpoint / "model.safetensors").read_bytes()


def test_requantizing_a_format_that_makes_no_new_scales_is_e503(tmp_path, fp8_tensor_checkpoint):
    state, rules = _load(_FP8_TENSOR, fp8_tensor_checkpoint)
    assert _save_error(state, tmp_path / "out", rules, fp8_tensor_checkpoint, requantize=True) == [
        ("E503", "`q` holds `q.weight` dequantized (fp8_tensor); writing it back in that format with new "
         "scales is not supported yet", ("t.remap", 3, 1, 3, 14),
         "move the stored values as they are (`quantized`), or save a dequantized checkpoint")]


class _Int8Row(Int8Row):
    """A format that decodes but neither encodes nor requantizes, under a name of its own."""

    name = "int8_row_readonly"


@pytest.fixture
def int8_row_readonly():
    register_format(_Int8Row())
    yield
    unregister_format("int8_row_readonly")


def test_a_format_that_cannot_encode_is_e503_without_requantize(tmp_path, int8_row_readonly):
    source = _write(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8), "a.scales": torch.ones(2)})
    state, rules = _load("dequantize {P:path}.qweight, {P}.scales -> {P}.weight | int8_row_readonly(to=float32)\n"
                         "a.weight -> a\n", source)
    assert _save_error(state, tmp_path / "out", rules, source) == [
        ("E503", "`a` holds `a.weight` dequantized (int8_row_readonly); writing it back in that format is not "
         "supported yet", ("t.remap", 3, 1, 3, 14),
         "move the stored values as they are (`quantized`), or save a dequantized checkpoint")]


def test_the_writers_defaults_keep_the_stored_scales_and_refuse_a_dropped_tensor(tmp_path, fp8_tensor_checkpoint):
    """`inverse.writers(compiled)` as a caller without options gets it: no new scales asked of a
    format that cannot make them (fp8_tensor), and a tensor the rules drop is E501, not skipped."""
    from remapdsl.compile.inverse import writers

    compiled = remapdsl.compile_rules(rules_from_text("remap 1\n" + _FP8_TENSOR, "t.remap"), fp8_tensor_checkpoint, {})
    assert [w.runtime_key for w in writers(compiled)] == ["q"]
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\n" + _FP8_TENSOR.replace("q.weight -> q\n", "drop q.weight\n"),
                                                      "t.remap"), fp8_tensor_checkpoint, {}, strict=False)
    with pytest.raises(remapdsl.RemapError) as info:
        writers(compiled)
    assert [(d.code, d.message) for d in info.value.diagnostics] == [
        ("E501", "checkpoint tensor `q.weight` is dropped by the rules: no runtime tensor holds it")]


def test_an_add_step_is_undone_on_save(tmp_path):
    """`add(1.5)` then `scale(2)` on load: the save halves, then subtracts 1.5 (the inverse steps, in
    reverse order), and writes the bytes as they were."""
    from remapdsl.compile.inverse import writers

    source = _write(tmp_path / "src", {"w": torch.arange(8, dtype=torch.float32).reshape(4, 2)})
    state, rules = _load("w -> s | add(1.5) | scale(2)\n", source)
    assert torch.equal(state["s"], (torch.arange(8, dtype=torch.float32).reshape(4, 2) + 1.5) * 2)
    (w,) = writers(remapdsl.compile_rules(rules, source, {}))
    assert w.steps == (("scale", 0.5), ("add", -1.5))
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_tensor_that_cannot_be_written_back_leaves_the_rest_of_its_rule_to_be_checked(tmp_path, int8_row_readonly):
    """s concatenates a (a format that cannot write back: E503) and b (read through a lossy cast:
    E502): the save names both, each whole, not only the first block's."""
    source = _write(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8), "a.scales": torch.ones(2),
                                       "b": torch.ones(2, 3)})
    state, rules = _load("dequantize {P:path}.qweight, {P}.scales -> {P}.weight | int8_row_readonly(to=float32)\n"
                         "a.weight, b -> s | cast(bfloat16) | concat(dim=0)\n", source)
    assert _save_error(state, tmp_path / "out", rules, source) == [
        ("E503", "`s` holds `a.weight` dequantized (int8_row_readonly); writing it back in that format is not "
         "supported yet", ("t.remap", 3, 1, 3, 50),
         "move the stored values as they are (`quantized`), or save a dequantized checkpoint"),
        ("E502", "`s` reads `b` through `cast(bfloat16)`, which loses values: the checkpoint cannot be written "
         "back exactly", ("t.remap", 3, 1, 3, 50), "pass allow_lossy=True to write the rounded values")]


_E501_HINT = "the save writes back only what the load read"


@pytest.mark.parametrize("dropped, expected", [
    ("error", [("E501", "checkpoint tensor `b` is dropped by the rules: no runtime tensor holds it",
                _E501_HINT + ": pass dropped=\"copy\" (`--dropped copy`) to copy it unchanged from `like`, "
                "or dropped=\"omit\" (`--dropped omit`) to leave it out of the output")]),
    ("copy", []),
])
def test_every_tensor_a_save_cannot_write_is_named_whole(tmp_path, dropped, expected):
    """a (empty, read), b (dropped), c (half read through a `slice`), d (read by no rule, lenient
    rules): each E501 of `inverse.writers`, code, message and hint, none hidden by the tensors before."""
    from remapdsl.compile.inverse import writers

    source = _write(tmp_path / "src", {"a": torch.zeros(0), "b": torch.zeros(4), "c": torch.zeros(4, 2),
                                       "d": torch.zeros(3)})
    rules = rules_from_text("remap 1\na -> a\ndrop b\nc -> c | slice(dim=0, start=0, stop=2)\n", "t.remap")
    compiled = remapdsl.compile_rules(rules, source, {}, strict=False)
    with pytest.raises(remapdsl.RemapError) as info:
        writers(compiled, dropped=dropped)
    assert [(d.code, d.message, d.hint) for d in info.value.diagnostics] == expected + [
        ("E501", "checkpoint tensor `c` [4, 2]: the runtime tensors hold 4 of its 8 elements (a `slice` left the "
         "rest out)", _E501_HINT),
        ("E501", "checkpoint tensor `d` is read by no rule: no runtime tensor holds it", _E501_HINT)]


# -- inverse.py: overlapping readers of one checkpoint tensor --

@pytest.mark.parametrize("first, second", [((0, 6), (2, 8)), ((0, 2), (0, 8)), ((5, 8), (0, 8)), ((0, 1), (0, 2))])
def test_the_first_rule_writes_an_overlap_and_the_second_only_what_is_left(tmp_path, first, second):
    """w [2, 8, 3] (or [2, 2, 3]) read by two rules, each a range of dim 1: the save takes the first
    rule's rows from `a` and the rest from `b`, the part of b's block no earlier block covers (found
    by halving b's block along its largest dim)."""
    rows = max(first[1], second[1])
    source = _write(tmp_path / "src", {"w": torch.zeros(2, rows, 3)})
    state, rules = _load(f"w -> a | slice(dim=1, start={first[0]}, stop={first[1]})\n"
                         f"w -> b | slice(dim=1, start={second[0]}, stop={second[1]})\n", source)
    state["a"] = torch.arange(state["a"].numel(), dtype=torch.float32).reshape(state["a"].shape) + 100
    state["b"] = torch.arange(state["b"].numel(), dtype=torch.float32).reshape(state["b"].shape) + 200
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = torch.zeros(2, rows, 3)
    want[:, second[0]:second[1]] = state["b"]
    want[:, first[0]:first[1]] = state["a"]  # the first rule wins the overlap
    assert list(saved) == ["w"] and torch.equal(saved["w"], want)


def test_rules_whose_blocks_are_no_strided_box_each_write_their_own_rows(tmp_path):
    """w [8, 3] read as [2, 4, 3] by two rules, each a range of the middle dim: a's block reads rows
    {0, 1, 4, 5} and b's rows {2, 3, 6, 7}, neither one strided box of w. The save checks b's block
    against a's by cutting both into boxes: each writes only its own rows."""
    source = _write(tmp_path / "src", {"w": torch.zeros(8, 3)})
    state, rules = _load("w -> a | reshape([2, 4, 3]) | slice(dim=1, start=0, stop=2)\n"
                         "w -> b | reshape([2, 4, 3]) | slice(dim=1, start=2, stop=4)\n", source)
    state["a"] = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3) + 100
    state["b"] = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3) + 200
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))["w"]
    want = torch.cat([state["a"], state["b"]], dim=1).reshape(8, 3)
    assert torch.equal(saved, want)


def test_the_first_rule_in_the_file_wins_an_overlap_whatever_the_names(tmp_path):
    """z (line 2) and b (line 3) both read rows 2:6 of w: z's rule comes first, so z writes them,
    though `b` sorts first by name. A hand-built tensor without a rule span goes before every
    rule's (here z without its span still wins, now over a rule file at an absolute path)."""
    from remapdsl.compile.inverse import writers

    source = _write(tmp_path / "src", {"w": torch.zeros(8, 3)})
    rules = rules_from_text("remap 1\nw -> z | slice(dim=0, start=0, stop=6)\nw -> b | slice(dim=0, start=2, stop=8)\n",
                            "/rules/t.remap")
    compiled = remapdsl.compile_rules(rules, source, {})
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["b", "z"]
    rows = [(w.runtime_key, w.block.base[0], w.block.sizes[0]) for w in writers(compiled)]
    assert rows == [("z", 0, 6), ("b", 6, 2)]
    unnamed = compiled.model_copy(update={"runtime_tensors": tuple(
        dataclasses.replace(d, rule=None) if d.runtime_key == "z" else d for d in compiled.runtime_tensors)})
    assert [(w.runtime_key, w.block.base[0], w.block.sizes[0]) for w in writers(unnamed)] == rows


# -- symbolic.py: each op's error, as the user reads it (E207, E209) --

@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """w and v float32 [4, 2], h float32 [4, 3], i bfloat16 [4, 2], x float32 [4]."""
    return _write(tmp_path_factory.mktemp("shapes"), {"w": torch.zeros(4, 2), "v": torch.zeros(4, 2),
                                                      "h": torch.zeros(4, 3), "x": torch.zeros(4),
                                                      "i": torch.zeros(4, 2, dtype=torch.bfloat16)})


def _op_error(folder: Path, text: str, config: dict | None = None) -> tuple:
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules_from_text("remap 1\n" + text + "\n", "t.remap"), folder, config or {},
                               strict=False)
    (d,) = info.value.diagnostics
    return d.code, d.message, d.span[2], d.span[4], d.hint


@pytest.mark.parametrize("text, message, columns", [
    ("w -> s | transpose(0, 2)", "`transpose`: b=2 is out of range for a 2-d tensor", (10, 25)),
    ("w, v -> s | stack(dim=3)", "`stack`: dim=3 is out of range for a 3-d tensor", (13, 25)),
    ("w -> s.{x,y} | split(dim=0, sizes=[1, 2])", "`split`: split sizes [1, 2] add up to 3, but dim 0 has 4",
     (16, 42)),
    ("w -> s.{x,y,z} | chunk(dim=0, n=3)", "`chunk`: dim 0 of size 4 does not divide into 3 equal parts", (18, 35)),
    ("w, v -> s | interleave(dim=1, groups=4)", "`interleave`: dim 1 of size 2 does not divide into 4 groups",
     (13, 40)),
    ("w -> s.{x,y} | deinterleave(dim=0, groups=3)",
     "`deinterleave`: dim 0 of size 4 does not divide into 3 groups of 2 parts", (16, 45)),
    ("w -> s | permute([0])", "`permute`: permute needs 2 dims for a 2-d tensor, got 1", (10, 22)),
    ("w -> s | slice(dim=0, start=2, stop=9)", "`slice`: slice [2, 9) is not inside dim 0 of size 4", (10, 39)),
    ("w -> s | slice(dim=0, start=2, stop=2)", "`slice`: slice [2, 2) is not inside dim 0 of size 4", (10, 39)),
    ("w -> s | pad(dim=0, to=2)", "`pad`: pad to 2 would shrink dim 0 of size 4", (10, 26)),
    ("w -> s | reshape([3, -1])", "`reshape`: cannot reshape [4, 2] into [3, -1]", (10, 26)),
    ("w -> s | reshape([3, 3])", "`reshape`: cannot reshape [4, 2] (8 elements) into [3, 3] (9 elements)", (10, 25)),
    ("w -> s | rope_permute(heads=3)", "`rope_permute`: 4 rows do not divide into 3 heads of pairs", (10, 31)),
    ("w -> s | rope_unpermute(heads=3)", "`rope_unpermute`: 4 rows do not divide into 3 heads of pairs", (10, 33)),
    ("w, h -> s | concat(dim=0)", "`concat`: concat needs matching shapes outside dim 0: [4, 2] and [4, 3]", (13, 26)),
    ("w, v, h -> s | concat(dim=0)", "`concat`: concat needs matching shapes outside dim 0: [4, 2] and [4, 3]",
     (16, 29)),
    ("w, h -> s | interleave(dim=0, groups=2)",
     "`interleave`: interleave needs matching shapes outside dim 0: [4, 2] and [4, 3]", (13, 40)),
    ("w -> s | transpose(-3, 0)", "`transpose`: a=-3 is out of range for a 2-d tensor", (10, 26)),
    ("w, h -> s | stack(dim=0)", "`stack`: stack needs matching shapes: [4, 2] and [4, 3]", (13, 25)),
    ("w, i -> s | concat(dim=0)", "`concat`: concat needs one dtype: float32 and bfloat16", (13, 26)),
])
def test_an_op_that_does_not_fit_its_shapes_is_e207(shapes, text, message, columns):
    keys = text.split(" -> ")[0].split(", ")
    hint = "while binding " + ", ".join(f"`{k}`" for k in keys)
    assert _op_error(shapes, text) == ("E207", message, *columns, hint)


def test_dims_and_shapes_from_the_config_are_checked_at_the_op(shapes):
    """A literal list is checked before binding (E124); one from the config only at the op."""
    assert _op_error(shapes, "w -> s | permute(config.p)", {"p": [1, -1]}) == (
        "E207", "`permute`: [1, -1] is not a permutation of the 2 dims", 10, 27, "while binding `w`")
    assert _op_error(shapes, "w -> s | reshape(config.s)", {"s": [-1, -1]}) == (
        "E207", "`reshape`: a reshape may infer one size (-1), not several", 10, 27, "while binding `w`")


def _block(offsets, sizes, key="x"):
    """A block of x (an identity map) or, with key None, a fill of zeros."""
    from remapdsl.indexmap import Block

    if key is None:
        return Block(tuple(offsets), tuple(sizes), None, (), (), (), 0.0)
    eye = tuple(tuple(int(i == j) for j in range(len(sizes))) for i in range(len(sizes)))
    return Block(tuple(offsets), tuple(sizes), key, tuple(offsets), eye)


@pytest.mark.parametrize("blocks, shape, tiles", [
    ([((0,), (2,))], (4,), True),  # one block, not the whole tensor: inside, nothing to overlap
    ([((0,), (2,)), ((2,), (3,))], (4,), False),  # the second ends past the tensor
    ([((-1,), (2,)), ((1,), (3,))], (4,), False),  # the first starts before it
    ([((0, 0), (2, 1)), ((0, 1), (2, 3))], (2, 4), True),
    ([((0, 0), (2, 2)), ((0, 1), (2, 3))], (2, 4), False),  # same rows, columns 1:2 twice
    ([((0,), (2,)), ((2,), (1,)), ((3,), (1,))], (4,), True),  # blocks that meet, end to start
    ([((), ()), ((), ())], (), False),  # a scalar made twice
])
def test_the_tiling_check_tells_blocks_outside_or_overlapping(blocks, shape, tiles):
    """E206's check (`symbolic.tiles`: an invariant of the ops, so no rule breaks it) on blocks made
    to break it, of sizes that differ (the general sweep, not the fast paths)."""
    from remapdsl.compile.symbolic import tiles as check

    assert check(tuple(_block(o, n) for o, n in blocks), shape) is tiles


def test_the_tiling_check_tells_a_fill_and_a_read_at_one_place():
    from remapdsl.compile.symbolic import tiles

    assert tiles((_block((0,), (2,), None), _block((0,), (2,)), _block((2,), (2,))), (4,)) is False


@pytest.mark.parametrize("blocks, shape, tiles", [
    ([((0, 0), (2, 4))], (2, 4), True),  # the whole tensor
    ([((0,), (5,))], (4,), False),  # at the origin, but longer than the tensor
    ([((1,), (4,))], (4,), False),  # the tensor's size, but not at the origin
    ([((0, 0), (1, 4)), ((1, 0), (1, 4))], (2, 4), True),  # what `stack` makes: a grid of one size
    ([((0,), (2,)), ((4,), (2,))], (4,), False),  # on the grid, the second past the end
    ([((-2,), (2,)), ((0,), (2,))], (4,), False),  # on the grid, the first before the start
    ([((0,), (2,)), ((1,), (2,))], (4,), False),  # one size, off the grid: they overlap
    ([((0,), (0,)), ((1,), (0,))], (4,), True),  # empty blocks cover nothing (no grid of size 0)
])
def test_the_tiling_check_s_fast_paths_tell_blocks_outside_or_overlapping(blocks, shape, tiles):
    """One block, and blocks of one size (the shortcuts before the general sweep): each as the
    sweep would tell it."""
    from remapdsl.compile.symbolic import tiles as check

    assert check(tuple(_block(o, n) for o, n in blocks), shape) is tiles


_LIMIT_HINT = "sizes and counts this large cannot be a model's tensors (limits: docs/errors.md)"


def test_a_count_from_the_config_beyond_the_limit_is_e209(shapes):
    assert _op_error(shapes, "w -> s | repeat(dim=0, times=config.t)", {"t": 70000}) == (
        "E209", "`repeat`: `times=70000` is more than 2^16 = 65536, the most pieces one op makes", 10, 39, _LIMIT_HINT)


def test_a_size_from_the_config_beyond_the_limit_is_e209(shapes):
    big = 2**48 + 1
    assert _op_error(shapes, "w -> s | pad(dim=0, to=config.big)", {"big": big}) == (
        "E209", f"`pad`: pad to {big} makes a tensor of shape [{big}, 2], {2 * big} elements: more than 2^48 = "
        f"{2**48}, the largest size", 10, 35, _LIMIT_HINT)


@pytest.mark.parametrize("text, config, diagnostic", [
    ("x -> s.{a,b} | deinterleave(dim=0, groups=config.g)", {"g": 70000},
     ("E209", "`deinterleave`: `groups=70000` is more than 2^16 = 65536, the most pieces one op makes", 16, 52,
      _LIMIT_HINT)),
    ("x -> s.{a,b} | deinterleave(dim=0, groups=config.g)", {"g": 0},
     ("E207", "`deinterleave`: `groups` must be at least 1, not 0", 16, 52, "while binding `x`")),
    ("x, x -> s | interleave(dim=0, groups=config.g)", {"g": 0},
     ("E207", "`interleave`: `groups` must be at least 1, not 0", 13, 47, "while binding `x`, `x`")),
    ("x -> s | rope_permute(heads=config.g)", {"g": 0},
     ("E207", "`rope_permute`: `heads` must be at least 1, not 0", 10, 38, "while binding `x`")),
    ("x -> s | rope_unpermute(heads=config.g)", {"g": 0},
     ("E207", "`rope_unpermute`: `heads` must be at least 1, not 0", 10, 40, "while binding `x`")),
    # 17 parts of one block each, cut into 65,536 groups: checked before any is built
    ("x.{a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q} -> s | interleave(dim=0, groups=65536)", {},
     ("E209", "`interleave`: interleaving 65536 groups would describe one tensor by 1114112 blocks: more than "
      "2^20 = 1048576, the most one tensor may have", 46, 77, _LIMIT_HINT)),
    # 17 blocks (one a copy) cut into 65,536 groups each: checked before any is built
    ("x -> s.{a,b} | repeat(dim=0, times=17) | deinterleave(dim=0, groups=65536)", {},
     ("E209", "`deinterleave`: deinterleaving 65536 groups would describe one tensor by 1114112 blocks: more than "
      "2^20 = 1048576, the most one tensor may have", 42, 75, _LIMIT_HINT)),
])
def test_counts_of_groups_and_heads_are_bounded(text, config, diagnostic):
    """A count of groups or heads past the limits, or below 1, and a tensor of more blocks than one
    may have, each told at the op: on a headers-only inventory (x [131072], x.a to x.q [65536])."""
    inventory = remapdsl.Inventory.from_shapes({"x": ("float32", (131072,)),
                                                **{f"x.{c}": ("float32", (65536,)) for c in "abcdefghijklmnopq"}})
    assert _op_error(inventory, text, config) == diagnostic


def test_a_reshape_that_drops_trailing_unit_dims_drops_their_columns_of_the_map(tmp_path):
    """w [4, 1] -> [4] and v [2, 3, 1, 1] -> [6]: w's block keeps one column per runtime dim
    (`explain` reads them), the dropped unit dim's source index staying 0; v's rows follow each other
    in its bytes, so its one block indexes v's flat view (not a block per row), which `explain`
    shows as the box of v it reads."""
    from remapdsl.indexmap import Block

    source = _write(tmp_path / "src", {"w": torch.zeros(4, 1), "v": torch.zeros(2, 3, 1, 1)})
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\nw -> s | reshape([4])\nv -> t | reshape([6])\n",
                                                      "t.remap"), source, {})
    blocks = {d.runtime_key: d.blocks for d in compiled.runtime_tensors}
    assert blocks == {"s": (Block((0,), (4,), "w", (0, 0), ((1,), (0,)), view=(4, 1)),),
                      "t": (Block((0,), (6,), "v", (0,), ((1,),), view=(6,)),)}
    assert "[0:4] <- w [0:4, 0]" in remapdsl.explain(compiled, "s")
    assert "[0:6] <- v [0:2, 0:3, 0, 0] flattened" in remapdsl.explain(compiled, "t")


def test_a_pad_s_fill_block_has_an_empty_map(tmp_path):
    """w [4, 2] padded to 6 rows: the fill block reads no source, so its base and map are empty
    (as `remapdsl explain --json` prints them), and it is made in the tensor's dtype."""
    import json

    from remapdsl.indexmap import Block

    source = _write(tmp_path / "src", {"w": torch.zeros(4, 2)})
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\nw -> s | pad(dim=0, to=6, value=1.5)\n", "t.remap"),
                                      source, {})
    (s,) = compiled.runtime_tensors
    assert s.blocks[1] == Block((4, 0), (2, 2), None, (), (), (("cast", "float32"),), 1.5)
    assert json.loads(compiled.model_dump_json())["runtime_tensors"][0]["blocks"][1] == [
        [4, 0], [2, 2], None, [], [], [["cast", "float32"]], 1.5, []]


def test_merging_dims_a_split_made_keeps_one_block():
    """x [24] seen as [2, 3, 4], then as [2, 12]: dims 1 and 2 step x by 4 and 1, so merged they
    step it by 1, one affine block (not one a row)."""
    from remapdsl.indexmap import Block

    inventory = remapdsl.Inventory.from_shapes({"x": ("float32", (24,))})
    rules = rules_from_text("remap 1\nx -> s | reshape([2, 3, 4]) | reshape([2, 12])\n", "t.remap")
    (s,) = remapdsl.compile_rules(rules, inventory, {}).runtime_tensors
    assert s.blocks == (Block((0, 0), (2, 12), "x", (0,), ((12, 1),), view=(24,)),)


def test_a_repeat_past_the_largest_size_is_e209():
    """y [2^33, 2] repeated 65,536 times on dim 0 would be [2^49, 2]: refused before any block is made."""
    inventory = remapdsl.Inventory.from_shapes({"y": ("float32", (2**33, 2))})
    assert _op_error(inventory, "y -> s | repeat(dim=0, times=65536)") == (
        "E209", f"`repeat`: repeat 65536 times makes a tensor of shape [{2**49}, 2], {2**50} elements: more than "
        f"2^48 = {2**48}, the largest size", 10, 36, _LIMIT_HINT)


def test_a_repeat_one_block_past_the_limit_is_refused_before_it_is_built():
    """17 blocks repeated 61,681 times would be 1,048,577 blocks, one more than a tensor may have."""
    from remapdsl.compile import symbolic as sym

    t = sym.repeat(sym.source("w", (4, 2), "float32"), 0, 17)
    assert len(t.blocks) == 17
    with pytest.raises(sym.LimitError) as info:
        sym.repeat(t, 1, 61681)
    assert str(info.value) == ("repeat 61681 times would describe one tensor by 1048577 blocks: more than "
                               "2^20 = 1048576, the most one tensor may have")


def test_unstacking_up_to_the_limit_makes_that_many_tensors_and_one_more_is_e209():
    from remapdsl.compile import symbolic as sym
    from remapdsl.language.limits import MAX_PIECES

    pieces = sym.unstack(sym.source("w", (MAX_PIECES, 1), "int8"), 0)
    assert len(pieces) == MAX_PIECES and pieces[-1].shape == (1,)
    with pytest.raises(sym.LimitError) as info:
        sym.unstack(sym.source("w", (MAX_PIECES + 1, 1), "int8"), 0)
    assert str(info.value) == ("unstacking dim 0 of size 65537 makes more than 2^16 = 65536 tensors, "
                               "the most pieces one op makes")


def _shapes(folder: Path, text: str, config: dict | None = None) -> dict:
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\n" + text, "t.remap"), folder, config or {},
                                      strict=False)
    return {d.runtime_key: d.shape for d in compiled.runtime_tensors}


def test_dims_down_to_minus_the_rank_count_from_the_end(shapes):
    text = "w -> a | transpose(-2, -1)\nw, v -> b | stack(dim=-3)\nw, v -> c | concat(dim=-2)\n"
    assert _shapes(shapes, text) == {"a": (2, 4), "b": (2, 4, 2), "c": (8, 2)}


def test_counts_of_one_and_of_the_limit_are_allowed(shapes):
    """`times=1`, `n=1` keep the tensor; 2^16 is the most pieces one op makes, not one too many."""
    assert _shapes(shapes, "w -> a | repeat(dim=0, times=1)\nv -> b | chunk(dim=0, n=1)\n"
                   "x -> c | repeat(dim=0, times=65536)\n") == {"a": (4, 2), "b": (4, 2), "c": (4 * 65536,)}


def test_a_pad_to_the_size_a_dim_has_keeps_the_tensor_as_it_is(shapes):
    """No error and no empty fill region: the same blocks as the rule without the pad."""
    rules = rules_from_text("remap 1\nw -> a | pad(dim=0, to=4)\nw -> b\n", "t.remap")
    compiled = remapdsl.compile_rules(rules, shapes, {}, strict=False)
    a, b = (d for d in sorted(compiled.runtime_tensors, key=lambda d: d.runtime_key))
    assert a.shape == (4, 2) and a.blocks == b.blocks and len(a.blocks) == 1


def test_a_pad_up_to_the_largest_size_is_allowed_and_one_element_more_is_e209(shapes):
    """2^48 elements, or a dim of 2^48, are within the limit; a tensor of more elements is E209 even
    where each of its dims is within it."""
    assert _shapes(shapes, "x -> a | pad(dim=0, to=config.d)\nw -> b | pad(dim=1, to=config.e)\n",
                   {"d": 2**48, "e": 2**46}) == {"a": (2**48,), "b": (4, 2**46)}
    half = 2**47 + 1
    message = (f"`pad`: pad to {half} makes a tensor of shape [{half}, 2], {2 * half} elements: more than "
               f"2^48 = {2**48}, the largest size")
    assert _op_error(shapes, "w -> s | pad(dim=0, to=config.half)", {"half": half}) == (
        "E209", message, 10, 36, _LIMIT_HINT)


def test_a_tensor_of_nine_dims_loads_as_torch_reads_it(tmp_path):
    """Ranks up to 8 take a prepared identity map; a 9-d tensor builds its own, to the same effect."""
    w = torch.arange(2**9, dtype=torch.float32).reshape((2,) * 9)
    state, _ = _load("w -> a\nw -> b | transpose(0, 8)\n", _write(tmp_path / "src", {"w": w}))
    assert torch.equal(state["a"], w) and torch.equal(state["b"], w.transpose(0, 8))


def test_a_tensor_may_have_up_to_the_limit_of_blocks():
    from remapdsl.compile import symbolic as sym
    from remapdsl.language.limits import MAX_BLOCKS

    assert sym._blocks_within(MAX_BLOCKS, "x") is None
    with pytest.raises(sym.LimitError) as info:
        sym._blocks_within(MAX_BLOCKS + 1, "repeat 2 times")
    assert str(info.value) == ("repeat 2 times would describe one tensor by 1048577 blocks: more than 2^20 = "
                               "1048576, the most one tensor may have")


def test_an_empty_tensor_compiles_to_no_blocks_and_loads(tmp_path):
    """e [0, 2] as read (a) and transposed (b): their shapes, described by no block at all."""
    source = _write(tmp_path / "src", {"e": torch.zeros(0, 2)})
    state, rules = _load("e -> a\ne -> b | transpose(0, 1)\n", source)
    compiled = remapdsl.compile_rules(rules, source, {})
    assert {d.runtime_key: (d.shape, d.dtype, d.blocks) for d in compiled.runtime_tensors} == {
        "a": ((0, 2), "float32", ()), "b": ((2, 0), "float32", ())}
    assert state["a"].shape == (0, 2) and state["b"].shape == (2, 0)


def test_reshapes_that_add_and_remove_dims_of_one_load_as_torch_reshapes(tmp_path):
    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    state, _ = _load("w -> a | reshape([1, 8, 1])\nw -> b | reshape([4, 2, 1]) | reshape([8])\n"
                     "w -> c | reshape([8, 1])\nw -> d | reshape([1, 4, 1, 2])\n"
                     "w -> e | reshape([2, 1, 4]) | reshape([2, 4])\n", _write(tmp_path / "src", {"w": w}))
    want = {"a": (1, 8, 1), "b": (8,), "c": (8, 1), "d": (1, 4, 1, 2), "e": (2, 4)}
    assert {k: v.shape for k, v in state.items()} == want
    assert all(torch.equal(state[k], w.reshape(shape)) for k, shape in want.items())


def test_rows_cut_and_padded_back_to_their_width_load_flattened_as_torch_does(tmp_path):
    """Columns 0:2 of w [4, 4] padded back to 4 columns, then flattened: each row's two elements
    are not whole rows of w, so each is a block of w's own dims (not of its flat view)."""
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    state, _ = _load("w -> s | slice(dim=1, start=0, stop=2) | pad(dim=1, to=4) | reshape([16])\n",
                     _write(tmp_path / "src", {"w": w}))
    want = torch.nn.functional.pad(w[:, :2], (0, 2)).reshape(16)
    assert torch.equal(state["s"], want)


def test_a_reshape_undone_by_a_reshape_is_one_block_however_many_rows(tmp_path):
    """[2.2 M] split into 1.1 M rows of 2 and merged back is one block again (not a piece per row,
    which would pass the 2^20 blocks of E209)."""
    source = _write(tmp_path / "src", {"x": torch.zeros(2_200_000, dtype=torch.int8)})
    rules = rules_from_text("remap 1\nx -> s | reshape([1100000, 2]) | reshape([2200000])\n", "t.remap")
    (d,) = remapdsl.compile_rules(rules, source, {}).runtime_tensors
    assert d.shape == (2_200_000,) and len(d.blocks) == 1


def test_a_reshape_to_a_size_of_zero_from_the_config_is_e207(shapes):
    """Nothing to infer -1 from: the op's error, not a division by zero."""
    assert _op_error(shapes, "w -> s | reshape([config.z, -1])", {"z": 0}) == (
        "E207", "`reshape`: cannot reshape [4, 2] into [0, -1]", 10, 33, "while binding `w`")


# -- inverse.py: a runtime tensor's blocks made first writers at once, or one by one --


def test_blocks_of_two_step_chains_are_each_undone_with_their_own(tmp_path):
    """s concatenates a bfloat16 and a float16 tensor, both cast to float32: each writer casts back
    to its own checkpoint dtype (two chains in one tensor are never given one inverse)."""
    from remapdsl.compile.inverse import writers

    source = _write(tmp_path / "src", {"a": torch.tensor([[1.5, -2.25, 3.0]], dtype=torch.bfloat16),
                                       "b": torch.tensor([[0.1, 65504.0, -7.0]], dtype=torch.float16)})
    state, rules = _load("a, b -> s | cast(float32) | concat(dim=0)\n", source)
    compiled = remapdsl.compile_rules(rules, source, {})
    assert [(w.block.source_key, w.steps) for w in writers(compiled)] == [
        ("a", (("cast", "bfloat16"),)), ("b", (("cast", "float16"),))]
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_tensor_of_a_dequantized_and_a_plain_source_saves_back(tmp_path, fp8_tensor_checkpoint):
    """q (fp8_tensor, dequantized) and k (float32) concatenated into one runtime tensor: each block
    writes its own tensor back, the values encoded with the stored scale."""
    k = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    source = _write(tmp_path / "src", {**load_file(str(fp8_tensor_checkpoint / "model.safetensors")), "k": k})
    state, rules = _load(_FP8_TENSOR.replace("q.weight -> q\n", "q.weight, k -> s | concat(dim=0)\n"), source)
    assert torch.equal(state["s"][4:], k)
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == {"q.weight", "q.weight_scale", "k"}
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_format_that_cannot_encode_is_e503_beside_a_plain_source(tmp_path, int8_row_readonly):
    """a.weight (a format that cannot write back) and b (float32, exact) in one runtime tensor: E503
    for a.weight, whatever shares its tensor."""
    source = _write(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8), "a.scales": torch.ones(2),
                                       "b": torch.ones(2, 3)})
    state, rules = _load("dequantize {P:path}.qweight, {P}.scales -> {P}.weight | int8_row_readonly(to=float32)\n"
                         "a.weight, b -> s | concat(dim=0)\n", source)
    assert [(code, message) for code, message, _, _ in _save_error(state, tmp_path / "out", rules, source)] == [
        ("E503", "`s` holds `a.weight` dequantized (int8_row_readonly); writing it back in that format is not "
         "supported yet")]


@pytest.mark.parametrize("requantize", [False, True])
def test_a_padded_dequantized_tensor_is_written_back_as_its_format_allows(tmp_path, fp8_tensor_checkpoint, requantize):
    """q padded to 6 rows (a fill block beside its block): a plain save writes the stored bytes back;
    asking fp8_tensor for new scales is E503, as for the tensor alone."""
    state, rules = _load(_FP8_TENSOR.replace("q.weight -> q\n", "q.weight -> q | pad(dim=0, to=6)\n"),
                         fp8_tensor_checkpoint)
    if requantize:
        assert [code for code, *_ in _save_error(state, tmp_path / "out", rules, fp8_tensor_checkpoint,
                                                 requantize=True)] == ["E503"]
        return
    remapdsl.save(state, tmp_path / "out", rules, like=fp8_tensor_checkpoint)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (fp8_tensor_checkpoint / "model.safetensors").read_bytes()


def test_the_first_copy_of_a_repeat_is_the_one_written_back(tmp_path):
    """w repeated twice along dim 0: both copies read all of w, and the first writes it; a change to
    the second copy alone is not saved."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    source = _write(tmp_path / "src", {"w": w})
    state, rules = _load("w -> s | repeat(dim=0, times=2)\n", source)
    assert torch.equal(state["s"], torch.cat([w, w]))
    state["s"][2:] = -1.0
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], w)
