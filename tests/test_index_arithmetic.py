"""Targets whose indices are affine in a capture (`layers.{2 * L + 1}`, `{L - 3}`, `{7 - 2 * L}`), and an
`unstack` whose index is (`experts.{3 * E + 1}`, from `start=`): the checkpoint layout a save without
`like` derives from the runtime keys alone.

`remapdsl.testing.strategies.affine_indices` draws each map (slope and offset of either sign) and the
checkpoint's indices; the runtime state dict is made from a checkpoint of random values in plain torch
(each map applied by hand, experts stacked by `torch.stack`, the unstacked tensor cut by indexing).
Every derived entry point must give back exactly that checkpoint: the keys and values a save without
`like` writes, the pairs an export without `like` yields, and a reverse conversion; and the forward
direction (a load of what the save wrote, an ingest of the exported pairs) the state dict.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from hypothesis import assume, given, note
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_compile_properties import examples

import remapdsl
from remapdsl.language import rules_from_text
from remapdsl.testing.strategies import Affine, affine_indices


def _rules(layer: Affine, expert: Affine) -> str:
    return ("remap 1\n"
            f"model.layers.{{L}}.mlp.experts.{{E}}.w -> layers.{layer.text}.experts\n    | stack(E, dim=0)\n"
            f"model.layers.{{L}}.norm.weight -> layers.{layer.text}.norm\n"
            f"model.layers.{{L}}.up -> layers.{layer.text}.split.{expert.text}.up\n"
            f"    | unstack(E, dim=0, start={expert.indices[0]})\n")


@st.composite
def models(draw) -> tuple[str, dict, dict, Affine]:
    """Rules with a drawn layer map and unstack map, the checkpoint they read (random values) and the
    runtime state dict they make, both in plain torch, and the layer map."""
    layer = draw(affine_indices(st.integers(1, 3)))
    expert = draw(affine_indices(st.integers(1, 3), name="E"))
    experts = draw(st.integers(1, 3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    checkpoint, runtime = {}, {}
    for L in layer.indices:
        at = f"layers.{layer(L)}"
        stacked = [torch.randn(2, 3, generator=generator) for _ in range(experts)]
        for e, t in enumerate(stacked):
            checkpoint[f"model.layers.{L}.mlp.experts.{e}.w"] = t
        runtime[f"{at}.experts"] = torch.stack(stacked)
        checkpoint[f"model.layers.{L}.norm.weight"] = runtime[f"{at}.norm"] = torch.randn(3, generator=generator)
        up = checkpoint[f"model.layers.{L}.up"] = torch.randn(len(expert.indices), 4, generator=generator)
        for i, E in enumerate(expert.indices):
            runtime[f"{at}.split.{expert(E)}.up"] = up[i]
    text = _rules(layer, expert)
    note(text)
    return text, checkpoint, runtime, layer


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


@examples(12)
@given(models())
def test_affine_targets_derive_the_checkpoint_and_load_back(model):
    text, checkpoint, runtime, _ = model
    rules = rules_from_text(text, "affine.remap")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "saved"
        remapdsl.save({k: v.clone() for k, v in runtime.items()}, out, rules, max_shard_size=200)
        _same(_tensors(out), checkpoint)  # the derived keys, and each tensor cut back apart
        loaded = {k: torch.full_like(v, float("nan")) for k, v in runtime.items()}
        remapdsl.load(loaded, out, rules, config={})
        _same(loaded, runtime)

        pairs = dict(remapdsl.export(runtime, rules, bucket_bytes=64))
        _same(pairs, checkpoint)
        ingested = {k: torch.full_like(v, float("nan")) for k, v in runtime.items()}
        remapdsl.ingest(ingested, iter(pairs.items()), rules)
        _same(ingested, runtime)

        source = tiny_checkpoint(Path(tmp) / "runtime", {k: v.contiguous() for k, v in runtime.items()})
        remapdsl.convert(source, Path(tmp) / "back", rules, reverse=True)
        _same(_tensors(Path(tmp) / "back"), checkpoint)


@examples(15)
@given(st.integers(2, 3).flatmap(lambda k: st.tuples(st.just(k), st.permutations(range(k)))),
       st.integers(1, 3), st.integers(0, 2**16))
def test_affine_maps_that_interleave_two_sources_derive_each_from_its_own(maps, count, seed):
    """`a.{L}.w -> layers.{k * L + r}.w` and `b.{L}.w -> layers.{k * L + s}.w` share the runtime keys
    between them (even and odd layers): each runtime key is derived from the one rule whose map reaches
    it, and a key neither reaches (an index below the offsets, or between them past the last rule) is
    E520 naming it."""
    k, residues = maps
    r, s = residues[:2]
    rules = rules_from_text(f"remap 1\na.{{L}}.w -> layers.{{{k} * L + {r}}}.w\nb.{{L}}.w -> layers.{{{k} * L + {s}}}.w\n")
    generator = torch.Generator().manual_seed(seed)
    checkpoint = {f"{name}.{L}.w": torch.randn(2, generator=generator) for name in "ab" for L in range(count)}
    runtime = {f"layers.{k * L + (r if name == 'a' else s)}.w": checkpoint[f"{name}.{L}.w"]
               for name in "ab" for L in range(count)}
    with tempfile.TemporaryDirectory() as tmp:
        remapdsl.save(runtime, Path(tmp) / "out", rules)
        _same(_tensors(Path(tmp) / "out"), checkpoint)
        unreached = [i for i in range(k * count + k) if i % k not in (r, s)]
        if unreached:  # a third residue: no rule's map reaches it
            key = f"layers.{unreached[0]}.w"
            with pytest.raises(remapdsl.RemapError) as info:
                remapdsl.save(runtime | {key: torch.zeros(2)}, Path(tmp) / "bad", rules)
            d = info.value.diagnostics[0]
            assert d.code == "E520" and d.message.startswith(f"model tensor `{key}` is made by no rule"), d


@examples(15)
@given(models(), st.data())
def test_a_runtime_index_outside_the_maps_image_is_made_by_no_rule(model, data):
    """A layer index no non-negative source index reaches (below the map's least image, above the
    greatest of a falling map, between two images of a steep one): the save without `like` names that
    key (E520), never deriving a checkpoint key of a negative or fractional index."""
    text, _, runtime, layer = model
    top = max(layer(L) for L in layer.indices) + 4
    outside = [i for i in range(top) if not any(layer(L) == i for L in range(top + abs(layer.offset) + 1))]
    assume(outside)
    key = f"layers.{data.draw(st.sampled_from(outside))}.norm"
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(remapdsl.RemapError) as info:
        remapdsl.save(runtime | {key: torch.zeros(3)}, Path(tmp) / "out", rules_from_text(text, "affine.remap"))
    d = info.value.diagnostics[0]
    assert d.code == "E520" and d.message.startswith(f"model tensor `{key}` is made by no rule"), d
