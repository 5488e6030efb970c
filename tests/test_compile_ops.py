"""What each op makes of its sources' shapes (remapdsl/compile/symbolic.py): its errors as the user
reads them (E207, E209: message, columns, hint), the limits on counts, sizes and blocks on both
sides, the tiling check, and the blocks reshapes, pads and repeats describe, loaded and compared with
what torch gives. Real checkpoints and headers-only inventories."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from checkpoints import loaded_through as _load
from checkpoints import tiny_checkpoint
from depth import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.language import rules_from_text


# -- symbolic.py: each op's error, as the user reads it (E207, E209) --

@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """w and v float32 [4, 2], h float32 [4, 3], i bfloat16 [4, 2], x float32 [4]."""
    return tiny_checkpoint(tmp_path_factory.mktemp("shapes"), {"w": torch.zeros(4, 2), "v": torch.zeros(4, 2),
                                                               "h": torch.zeros(4, 3), "x": torch.zeros(4),
                                                               "i": torch.zeros(4, 2, dtype=torch.bfloat16)}, {})


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

    source = tiny_checkpoint(tmp_path / "src", {"w": torch.zeros(4, 1), "v": torch.zeros(2, 3, 1, 1)}, {})
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

    source = tiny_checkpoint(tmp_path / "src", {"w": torch.zeros(4, 2)}, {})
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
    state, _ = _load("w -> a\nw -> b | transpose(0, 8)\n", tiny_checkpoint(tmp_path / "src", {"w": w}, {}))
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
    source = tiny_checkpoint(tmp_path / "src", {"e": torch.zeros(0, 2)}, {})
    state, rules = _load("e -> a\ne -> b | transpose(0, 1)\n", source)
    compiled = remapdsl.compile_rules(rules, source, {})
    assert {d.runtime_key: (d.shape, d.dtype, d.blocks) for d in compiled.runtime_tensors} == {
        "a": ((0, 2), "float32", ()), "b": ((2, 0), "float32", ())}
    assert state["a"].shape == (0, 2) and state["b"].shape == (2, 0)


def test_reshapes_that_add_and_remove_dims_of_one_load_as_torch_reshapes(tmp_path):
    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    state, _ = _load("w -> a | reshape([1, 8, 1])\nw -> b | reshape([4, 2, 1]) | reshape([8])\n"
                     "w -> c | reshape([8, 1])\nw -> d | reshape([1, 4, 1, 2])\n"
                     "w -> e | reshape([2, 1, 4]) | reshape([2, 4])\n", tiny_checkpoint(tmp_path / "src", {"w": w}, {}))
    want = {"a": (1, 8, 1), "b": (8,), "c": (8, 1), "d": (1, 4, 1, 2), "e": (2, 4)}
    assert {k: v.shape for k, v in state.items()} == want
    assert all(torch.equal(state[k], w.reshape(shape)) for k, shape in want.items())


def test_rows_cut_and_padded_back_to_their_width_load_flattened_as_torch_does(tmp_path):
    """Columns 0:2 of w [4, 4] padded back to 4 columns, then flattened: each row's two elements
    are not whole rows of w, so each is a block of w's own dims (not of its flat view)."""
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    state, _ = _load("w -> s | slice(dim=1, start=0, stop=2) | pad(dim=1, to=4) | reshape([16])\n",
                     tiny_checkpoint(tmp_path / "src", {"w": w}, {}))
    want = torch.nn.functional.pad(w[:, :2], (0, 2)).reshape(16)
    assert torch.equal(state["s"], want)


def test_a_reshape_undone_by_a_reshape_is_one_block_however_many_rows(tmp_path):
    """[2.2 M] split into 1.1 M rows of 2 and merged back is one block again (not a piece per row,
    which would pass the 2^20 blocks of E209)."""
    source = tiny_checkpoint(tmp_path / "src", {"x": torch.zeros(2_200_000, dtype=torch.int8)}, {})
    rules = rules_from_text("remap 1\nx -> s | reshape([1100000, 2]) | reshape([2200000])\n", "t.remap")
    (d,) = remapdsl.compile_rules(rules, source, {}).runtime_tensors
    assert d.shape == (2_200_000,) and len(d.blocks) == 1


def test_a_reshape_to_a_size_of_zero_from_the_config_is_e207(shapes):
    """Nothing to infer -1 from: the op's error, not a division by zero."""
    assert _op_error(shapes, "w -> s | reshape([config.z, -1])", {"z": 0}) == (
        "E207", "`reshape`: cannot reshape [4, 2] into [0, -1]", 10, 33, "while binding `w`")


def _mapped(base, rows, sizes) -> set[tuple[int, ...]]:
    """Every `base + rows . x` for x in the box of `sizes`: one coordinate per row."""
    return {tuple(b + sum(c * i for c, i in zip(row, x)) for b, row in zip(base, rows))
            for x in itertools.product(*map(range, sizes))}


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), shape))


def _stated(text: str, shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The elements of checkpoint tensor `w` (of `shape`) that one of `explain`'s block lines says its
    block reads: a region (`n`, `a:b`, `a:b reversed`, or on a flat view `a:b:s` per dim) or a map from a
    base by steps, over the flat view where it says `flattened`."""
    import re

    source = text.split(" <- ", 1)[1].split(" | ")[0]
    sizes = tuple(1 if ":" not in n else int(n.split(":")[1]) - int(n.split(":")[0])
                  for n in text.split("]", 1)[0].strip(" [").split(", "))  # the runtime box
    mapped = re.fullmatch(r"w (?:flattened, )?from (.+), steps (.+)", source)
    if mapped:  # a base and a step per runtime dim (a row of them per checkpoint dim, or one on the flat view)
        base, steps = (json.loads(part) for part in mapped.groups())
        if isinstance(base, int):
            return {_unravel(f, shape) for (f,) in _mapped([base], [steps], sizes)}
        return _mapped(base, steps, sizes)
    region = re.fullmatch(r"w \[(.+)\]( flattened| \(dims .+\))?", source).group(1).split(", ")

    def axis(entry: str) -> range:
        numbers = [int(n) for n in entry.removesuffix(" reversed").split(":")]
        return range(numbers[0], numbers[0] + 1) if len(numbers) == 1 else range(*numbers)

    return set(itertools.product(*map(axis, region)))


def _read(block, shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The elements of `w` a block reads, from its map (over the view it indexes, where it has one)."""
    view = block.view or shape
    return {_unravel(sum(a * math.prod(view[k + 1:]) for k, a in enumerate(at)), shape)
            for at in _mapped(block.base, block.coeff, block.sizes)}


@settings(max_examples=scaled(100), deadline=None)
@given(st.data())
def test_each_line_of_explain_names_exactly_the_elements_its_block_reads(data):
    """A checkpoint tensor of 1 to 3 dims through up to three drawn ops (transpose, slice, a reshape
    merging, flattening or splitting dims, rotary order): every block line `explain` prints names a region
    or map of `w` holding exactly the elements its block reads (`_read`, from the block's own map)."""
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), label="shape"))
    now, ops = list(shape), []
    for _ in range(data.draw(st.integers(1, 3), label="ops")):
        choices = ["flat", "slice"] + (["transpose", "merge"] if len(now) > 1 else []) + \
            (["split"] if now[0] % 2 == 0 and now[0] > 2 else []) + (["rope"] if now[0] % 2 == 0 else [])
        op = data.draw(st.sampled_from(choices), label="op")
        if op == "transpose":
            ops.append("transpose(0, 1)")
            now[0], now[1] = now[1], now[0]
        elif op == "slice":
            d = data.draw(st.integers(0, len(now) - 1), label="slice dim")
            start = data.draw(st.integers(0, now[d] - 1), label="start")
            stop = data.draw(st.integers(start + 1, now[d]), label="stop")
            ops.append(f"slice(dim={d}, start={start}, stop={stop})")
            now[d] = stop - start
        elif op == "rope":
            ops.append("rope_permute(heads=1)")
        else:
            now = [math.prod(now)] if op == "flat" else [now[0] * now[1], *now[2:]] if op == "merge" else \
                [2, now[0] // 2, *now[1:]]
            ops.append(f"reshape({now})")
    try:
        _explained_as_read(shape, ops)
    except remapdsl.RemapError as exc:  # a reshape of a cut tensor no map can express: refused, named
        assert exc.diagnostic.code.startswith("E2"), str(exc)


@pytest.mark.parametrize("shape, ops", [
    ((2, 4), ["reshape([4, 2])", "slice(dim=1, start=0, stop=1)"]),  # a box of w with a step: [0:2, 0:3:2]
    ((2, 3), ["reshape([3, 2])", "slice(dim=1, start=0, stop=1)"]),  # no box: a map of w's flat view
    ((4, 3), ["reshape([2, 2, 3])", "transpose(0, 1)"]),  # w's dim 0 walked by two runtime dims
])
def test_explain_names_what_strided_and_split_maps_read(shape, ops):
    """The maps the drawn ops above reach only now and then, each time."""
    _explained_as_read(shape, ops)


def _explained_as_read(shape: tuple[int, ...], ops: list[str]) -> None:
    """`w` of `shape` through `ops` into `s`: every block line `explain` prints names what its block reads."""
    inventory = remapdsl.Inventory.from_shapes({"w": ("float32", shape)})
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\nw -> s | " + " | ".join(ops) + "\n", "t.remap"),
                                      inventory, {})
    (s,) = compiled.runtime_tensors
    lines = remapdsl.explain(compiled, max_blocks=len(s.blocks)).splitlines()[1:1 + len(s.blocks)]
    for line, block in zip(lines, s.blocks, strict=True):
        assert _stated(line, shape) == _read(block, shape), (ops, line, block)


EXPLAINED = """remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[128, 128], to=bfloat16)
{a,b}.weight -> q{a,b}
w -> s | transpose(0, 1) | scale(0.5) | cast(bfloat16)
{x,y} -> z | concat(dim=0) | add(1)
drop d
"""


@pytest.mark.parametrize("key, max_blocks, text", [
    (None, 1, """qa  [128, 256] bfloat16  (e.remap:3)
    [0:128, 0:256] <- a.weight [0:128, 0:256]
qb  [128, 128] bfloat16  (e.remap:3)
    [0:128, 0:128] <- b.weight [0:128, 0:128]
s  [525, 500] bfloat16  (e.remap:4)
    [0:525, 0:500] <- w [0:500, 0:525] (dims [1, 0]) | scale(0.5) | cast(bfloat16)
z  [3, 3] float32  (e.remap:5)
    [0:2, 0:3] <- x [0:2, 0:3] | add(1)
    ... and 1 more block
a.weight  [128, 256] bfloat16 = fp8_block(block=[128, 128], to=bfloat16) of `a.weight`, `a.weight_scale_inv`
... and 1 more dequantized tensor
4 runtime tensors from 7 checkpoint tensors (1.1 MB); 1 dropped"""),
    ("s", 8, """s  [525, 500] bfloat16  (e.remap:4)
    [0:525, 0:500] <- w [0:500, 0:525] (dims [1, 0]) | scale(0.5) | cast(bfloat16)
1 runtime tensor from 1 checkpoint tensor (1.1 MB)"""),
    ("z", 8, """z  [3, 3] float32  (e.remap:5)
    [0:2, 0:3] <- x [0:2, 0:3] | add(1)
    [2, 0:3] <- y [0, 0:3] | add(1)
1 runtime tensor from 2 checkpoint tensors (0.0 MB)"""),
])
def test_explain_prints_each_tensor_its_blocks_its_dequantized_sources_and_what_it_reads(key, max_blocks, text):
    """The whole text: each runtime tensor with its rule's place, its blocks up to `max_blocks` (then how
    many more), a block's source region, dim order and value steps, the dequantized tensors it uses (then
    how many more), and the tensors and bytes read (w alone: 1,050,000 bytes, 1.1 MB), the dropped only
    for the whole checkpoint."""
    inventory = remapdsl.Inventory.from_shapes({
        "a.weight": ("float8_e4m3fn", (128, 256)), "a.weight_scale_inv": ("float32", (1, 2)),
        "b.weight": ("float8_e4m3fn", (128, 128)), "b.weight_scale_inv": ("float32", (1, 1)),
        "w": ("float32", (500, 525)), "x": ("float32", (2, 3)), "y": ("float32", (1, 3)), "d": ("float32", (5,))})
    compiled = remapdsl.compile_rules(rules_from_text(EXPLAINED, "e.remap"), inventory, {})
    assert remapdsl.explain(compiled, key, max_blocks=max_blocks) == text
