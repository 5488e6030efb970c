"""Tensors held in memory layouts of their own: transposed, sliced out of a larger tensor, every k-th
element, with a storage offset, and expanded (stride 0).

The contract, from `load`'s "fill existing tensors in place": a destination view of any strides is
filled through the view (its base's other elements untouched); a destination whose elements share
memory (expanded) cannot be, and is refused before a byte moves (E234), by `load`, `ingest` and the
DCP reader alike. Sources of any strides (`save`, `export`, `ingest` pairs) are read as their values.
Each case draws its op chain (`tests/test_compile_properties.py`'s list-axis cases, pads included)
and its layouts (`remapdsl.testing.strategies.memory_layouts`), and is checked against the reference
conversion (`remapdsl.testing.reference.apply_ops`) or the checkpoint's own bytes. On gloo ranks,
`read_replicated_once=True` broadcasts into replicated tensors each rank holds in drawn layouts:
tests/test_distributed.py (its one spawn).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from hypothesis import assume, given, note
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_compile_properties import examples, list_axis_cases
from test_save_properties import _refused

import remapdsl
from remapdsl.language import ir, rules_from_text
from remapdsl.testing.reference import apply_ops
from remapdsl.testing.strategies import Held, laid_out, memory_layouts, op_chains


def _expected(case, rules) -> dict[str, torch.Tensor]:
    """Runtime key -> the reference conversion's tensor."""
    (rule,) = [s for s in rules.statements if isinstance(s, ir.Rule)]
    given_ = {v: [case.sources[k] for k in keys] for v, keys in case.ordered.items()} \
        if isinstance(case.ordered, dict) else [case.sources[k] for k in case.ordered]
    out = apply_ops(list(rule.ops), given_, targets=len(case.targets))
    if isinstance(out, dict):
        out = [t for v in sorted(out) for t in out[v]]
    return dict(zip(case.targets, out))


def _filled(held: dict[str, Held], want: dict[str, torch.Tensor]) -> None:
    for key, h in held.items():
        note(f"{key}: {h.how}")
        assert h.tensor.dtype == want[key].dtype and torch.equal(h.tensor, want[key]), f"{key} ({h.how})"
        assert h.outside().isnan().all(), f"{key} ({h.how}): written outside the view"


@examples(30)
@given(list_axis_cases(), st.data())
def test_load_fills_destination_views_of_any_strides_in_place(case, data):
    rules = rules_from_text(case.text)
    want = _expected(case, rules)
    held = {k: data.draw(memory_layouts(t.shape, t.dtype), label=k) for k, t in want.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(case.sources, str(Path(tmp) / "model.safetensors"))
        remapdsl.load({k: h.tensor for k, h in held.items()}, tmp, rules, config={})
    _filled(held, want)


@examples(25)
@given(list_axis_cases(), st.data())
def test_ingest_takes_pairs_of_any_strides_into_views_of_any_strides(case, data):
    """The pairs are the checkpoint's tensors copied into drawn layouts (the chains pad, slice, cast...)."""
    rules = rules_from_text(case.text)
    want = _expected(case, rules)
    held = {k: data.draw(memory_layouts(t.shape, t.dtype), label=k) for k, t in want.items()}
    pairs = {k: data.draw(laid_out(t), label=f"pair {k}") for k, t in case.sources.items()}
    with tempfile.TemporaryDirectory() as tmp:
        like = tiny_checkpoint(tmp, case.sources)
        report = remapdsl.ingest({k: h.tensor for k, h in held.items()}, iter(pairs.items()), rules, like=like,
                                 config={})
    assert report.pairs == len(pairs)
    _filled(held, want)


@st.composite
def padding_rules(draw) -> tuple[str, torch.Tensor, bool]:
    """A rule that pads, last or after other ops (op_chains: transposes, casts, value ops, more pads),
    its source, and whether it states `size=` (then a save without `like` can undo it)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    chain = draw(op_chains([shape], max_ops=3, cuts=False)) if draw(st.booleans()) else None
    ops, (last,) = (chain.ops, chain.shapes) if chain is not None else ([], [shape])
    d = draw(st.integers(0, len(last) - 1))
    to = last[d] + draw(st.integers(1, 3))
    value = draw(st.sampled_from(["", ", value=-1.5", ", value=3"]))
    sized = chain is None and draw(st.booleans())
    ops = [*ops, f"pad(dim={d}, to={to}{value}" + (f", size={last[d]})" if sized else ")")]
    source = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    return "remap 1\na -> b\n" + "".join(f"    | {op}\n" for op in ops), source, sized


@examples(25)
@given(padding_rules(), st.data())
def test_ingest_fills_what_the_rules_pad(drawn, data):
    """The padded region, which no pair holds, is filled with the pad's value, in the layout of
    `like`, and, where `size=` says what was padded, in the one derived from the state dict."""
    text, source, sized = drawn
    note(text)
    rules = rules_from_text(text)
    (rule,) = [s for s in rules.statements if isinstance(s, ir.Rule)]
    (want,) = apply_ops(list(rule.ops), [source])
    with tempfile.TemporaryDirectory() as tmp:
        like = tiny_checkpoint(tmp, {"a": source})
        for given_like in (like, None) if sized else (like,):
            h = data.draw(memory_layouts(want.shape, want.dtype))
            remapdsl.ingest({"b": h.tensor}, {"a": source}, rules, like=given_like, config={})
            _filled({"b": h}, {"b": want})


@examples(15)
@given(list_axis_cases(), st.data())
def test_save_and_export_read_sources_of_any_strides(case, data):
    """A loaded state dict copied into drawn layouts: the save writes the checkpoint's own bytes, the
    export yields its tensors, and its regions tile them."""
    rules = rules_from_text(case.text)
    assume(not _refused(case, rules) and "scale(" not in case.text and "add(" not in case.text)
    with tempfile.TemporaryDirectory() as tmp:
        like = tiny_checkpoint(Path(tmp) / "in", case.sources)
        compiled = remapdsl.compile_rules(rules, like, {})
        loaded = compiled.empty_state_dict()
        remapdsl.load(loaded, like, rules, config={})
        state = {k: data.draw(laid_out(t), label=k) for k, t in loaded.items()}
        note({k: (tuple(t.stride()), t.storage_offset()) for k, t in state.items()})
        remapdsl.save(state, Path(tmp) / "out", rules, like=like, config={})
        assert (Path(tmp) / "out" / "model.safetensors").read_bytes() == (like / "model.safetensors").read_bytes()
        pairs = dict(remapdsl.export(state, rules, like=like, config={}, bucket_bytes=64))
        want = load_file(str(like / "model.safetensors"))
        assert pairs.keys() == want.keys() and all(torch.equal(pairs[k], want[k]) for k in want)
        whole = {k: torch.full_like(t, float("nan")) for k, t in want.items()}
        for key, offsets, piece in remapdsl.export(state, rules, like=like, config={}, regions=True, bucket_bytes=64):
            whole[key][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
        assert all(torch.equal(whole[k], want[k]) for k in want)


@examples(15)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(lambda s: [max(2, s[0]), *s[1:]]).flatmap(
    lambda shape: memory_layouts(shape, expanded=True)), st.integers(0, 2**16))
def test_expanded_sources_are_read_as_their_values(held, seed):
    """A source whose elements share memory holds values all the same: a save and an export read
    them (the checkpoint's bytes, its tensors), and an ingest takes such a pair."""
    note(held.how)
    held.base.copy_(torch.randn(held.base.shape, generator=torch.Generator().manual_seed(seed)))
    values = held.tensor.contiguous()
    rules = rules_from_text("remap 1\na -> b\n    | transpose(0, -1)\n", "x.remap")
    with tempfile.TemporaryDirectory() as tmp:
        like = tiny_checkpoint(Path(tmp) / "in", {"a": values.transpose(0, -1).contiguous()})
        remapdsl.save({"b": held.tensor}, Path(tmp) / "out", rules, like=like, config={})
        assert (Path(tmp) / "out" / "model.safetensors").read_bytes() == (like / "model.safetensors").read_bytes()
        (key, tensor), = remapdsl.export({"b": held.tensor}, rules, like=like, config={})
        assert key == "a" and torch.equal(tensor, values.transpose(0, -1))
        filled = {"b": torch.full(values.shape, float("nan"))}
        remapdsl.ingest(filled, {"a": held.tensor.transpose(0, -1)}, rules, like=like, config={})
        assert torch.equal(filled["b"], values)


@examples(15)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(lambda s: [max(2, s[0]), *s[1:]]).flatmap(
    lambda shape: memory_layouts(shape, expanded=True)))
def test_a_destination_whose_elements_share_memory_is_refused_before_a_byte_moves(held):
    """An expanded view (stride 0 on a dim of several elements) cannot hold a tensor's values: `load`,
    `ingest` and `dcp.load` through the rule reader each refuse it with E234 naming the tensor, its
    memory untouched."""
    import torch.distributed.checkpoint as dcp

    from remapdsl.dcp import RuleStorageReader, remap_errors

    note(held.how)
    shape = tuple(held.tensor.shape)
    source = torch.randn(shape)
    rules = rules_from_text("remap 1\na -> b\n", "e.remap")
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_checkpoint(tmp, {"a": source})
        calls = [lambda: remapdsl.load({"b": held.tensor}, folder, rules, config={}),
                 lambda: remapdsl.ingest({"b": held.tensor}, {"a": source}, rules, like=folder, config={})]

        def through_dcp():
            with warnings.catch_warnings(), remap_errors():
                warnings.simplefilter("ignore")
                dcp.load({"b": held.tensor}, storage_reader=RuleStorageReader(folder, rules, config={}))

        for call in (*calls, through_dcp):
            with pytest.raises(remapdsl.RemapError) as info:
                call()
            d = info.value.diagnostics[0]
            assert d.code == "E234" and d.message.startswith(f"`b` {list(shape)} holds dim "), d
            assert "stride 0" in d.message and ".clone()" in d.hint
            assert held.base.isnan().all()
