"""The save direction's inverse (remapdsl/compile/inverse.py): which formats write back (E503's whole
diagnostic with and without requantize, a format that writes back with its stored scales but makes
no new ones), the steps undone on save, every tensor a save cannot write named whole (E501, E502),
and a checkpoint tensor two rules read in overlapping parts (the first rule writes the overlap, the
second only what is left). Real checkpoints, loaded and saved through the public API."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import torch
from checkpoints import loaded_through as _load
from checkpoints import tiny_checkpoint
from formats import Int8Row
from safetensors.torch import load_file

import remapdsl
from remapdsl.language import rules_from_text
from remapdsl.quant import get_format, register_format, unregister_format


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
    return tiny_checkpoint(tmp_path / "src", {"q.weight": values, "q.weight_scale": torch.tensor([2.0])}, {})


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
    source = tiny_checkpoint(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8),
                                                "a.scales": torch.ones(2)}, {})
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

    source = tiny_checkpoint(tmp_path / "src", {"w": torch.arange(8, dtype=torch.float32).reshape(4, 2)}, {})
    state, rules = _load("w -> s | add(1.5) | scale(2)\n", source)
    assert torch.equal(state["s"], (torch.arange(8, dtype=torch.float32).reshape(4, 2) + 1.5) * 2)
    (w,) = writers(remapdsl.compile_rules(rules, source, {}))
    assert w.steps == (("scale", 0.5), ("add", -1.5))
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_tensor_that_cannot_be_written_back_leaves_the_rest_of_its_rule_to_be_checked(tmp_path, int8_row_readonly):
    """s concatenates a (a format that cannot write back: E503) and b (read through a lossy cast:
    E502): the save names both, each whole, not only the first block's."""
    source = tiny_checkpoint(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8),
                                                "a.scales": torch.ones(2), "b": torch.ones(2, 3)}, {})
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

    source = tiny_checkpoint(tmp_path / "src", {"a": torch.zeros(0), "b": torch.zeros(4), "c": torch.zeros(4, 2),
                                                "d": torch.zeros(3)}, {})
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
    source = tiny_checkpoint(tmp_path / "src", {"w": torch.zeros(2, rows, 3)}, {})
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
    source = tiny_checkpoint(tmp_path / "src", {"w": torch.zeros(8, 3)}, {})
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

    source = tiny_checkpoint(tmp_path / "src", {"w": torch.zeros(8, 3)}, {})
    rules = rules_from_text("remap 1\nw -> z | slice(dim=0, start=0, stop=6)\nw -> b | slice(dim=0, start=2, stop=8)\n",
                            "/rules/t.remap")
    compiled = remapdsl.compile_rules(rules, source, {})
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["b", "z"]
    rows = [(w.runtime_key, w.block.base[0], w.block.sizes[0]) for w in writers(compiled)]
    assert rows == [("z", 0, 6), ("b", 6, 2)]
    unnamed = compiled.model_copy(update={"runtime_tensors": tuple(
        dataclasses.replace(d, rule=None) if d.runtime_key == "z" else d for d in compiled.runtime_tensors)})
    assert [(w.runtime_key, w.block.base[0], w.block.sizes[0]) for w in writers(unnamed)] == rows


# -- inverse.py: a runtime tensor's blocks made first writers at once, or one by one --


def test_blocks_of_two_step_chains_are_each_undone_with_their_own(tmp_path):
    """s concatenates a bfloat16 and a float16 tensor, both cast to float32: each writer casts back
    to its own checkpoint dtype (two chains in one tensor are never given one inverse)."""
    from remapdsl.compile.inverse import writers

    source = tiny_checkpoint(tmp_path / "src", {"a": torch.tensor([[1.5, -2.25, 3.0]], dtype=torch.bfloat16),
                                                "b": torch.tensor([[0.1, 65504.0, -7.0]], dtype=torch.float16)}, {})
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
    stored = load_file(str(fp8_tensor_checkpoint / "model.safetensors"))
    source = tiny_checkpoint(tmp_path / "src", {**stored, "k": k}, {})
    state, rules = _load(_FP8_TENSOR.replace("q.weight -> q\n", "q.weight, k -> s | concat(dim=0)\n"), source)
    assert torch.equal(state["s"][4:], k)
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == {"q.weight", "q.weight_scale", "k"}
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_format_that_cannot_encode_is_e503_beside_a_plain_source(tmp_path, int8_row_readonly):
    """a.weight (a format that cannot write back) and b (float32, exact) in one runtime tensor: E503
    for a.weight, whatever shares its tensor."""
    source = tiny_checkpoint(tmp_path / "src", {"a.qweight": torch.ones(2, 3, dtype=torch.int8),
                                                "a.scales": torch.ones(2), "b": torch.ones(2, 3)}, {})
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
    source = tiny_checkpoint(tmp_path / "src", {"w": w}, {})
    state, rules = _load("w -> s | repeat(dim=0, times=2)\n", source)
    assert torch.equal(state["s"], torch.cat([w, w]))
    state["s"][2:] = -1.0
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], w)
