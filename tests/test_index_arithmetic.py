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

import torch
from checkpoints import tiny_checkpoint
from hypothesis import given, note
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
def models(draw) -> tuple[str, dict, dict]:
    """Rules with a drawn layer map and unstack map, the checkpoint they read (random values) and the
    runtime state dict they make, both in plain torch."""
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
    return text, checkpoint, runtime


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


@examples(20)
@given(models())
def test_affine_targets_derive_the_checkpoint_and_load_back(model):
    text, checkpoint, runtime = model
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
