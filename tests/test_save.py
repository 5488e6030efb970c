"""Saving: the inverse of the load, derived from the same rules, written in place.

An unchanged model saves back to byte-identical files (same keys, dtypes, headers, offsets and
index); what cannot be written back fails before any byte is written; a failure while writing
leaves the destination as it was and no staging folder behind.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl import RemapError
from remapdsl.language import rules_from_text

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"
QWEN = str(ROOT / "rules" / "qwen3_moe.remap")


def loaded(checkpoint, rules, **kwargs) -> dict[str, torch.Tensor]:
    ruleset = rules if isinstance(rules, remapdsl.language.RuleSet) else remapdsl.load_rules(rules)
    inventory = remapdsl.open_checkpoint(checkpoint)
    compiled = remapdsl.compile_rules(ruleset, inventory, **kwargs)
    state = compiled.empty_state_dict()
    remapdsl.load(state, checkpoint, ruleset, **kwargs)
    return state


def identical(a: Path, b: Path) -> list[str]:
    """Files of folder `a` that differ from (or are missing in) folder `b`, and leftovers in `b`."""
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    problems = [n for n in names if not (b / n).is_file() or not filecmp.cmp(a / n, b / n, shallow=False)]
    return problems + sorted({p.name for p in b.iterdir()} - set(names))


def no_staging(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".remapdsl-" in p.name]


def test_an_unchanged_model_saves_to_byte_identical_files(tmp_path):
    state = loaded(EXAMPLE, QWEN)
    report = remapdsl.save(state, tmp_path / "out", QWEN, like=EXAMPLE)
    assert identical(EXAMPLE, tmp_path / "out") == []
    assert report.bytes_written == sum(t.nbytes for t in remapdsl.open_checkpoint(EXAMPLE).tensors.values())
    assert no_staging(tmp_path)


def test_a_trained_model_saves_its_values_in_the_checkpoint_layout(tmp_path):
    """Values changed after the load land in the right per-expert tensors."""
    state = loaded(EXAMPLE, QWEN)
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
    gate_up[2, gate_up.shape[1] // 2:] = 7.0  # expert 2's up_proj
    remapdsl.save(state, tmp_path / "out", QWEN, like=EXAMPLE)
    saved, original = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(EXAMPLE / "model.safetensors"))
    assert torch.equal(saved["model.layers.1.mlp.experts.2.up_proj.weight"], torch.full_like(saved[
        "model.layers.1.mlp.experts.2.up_proj.weight"], 7.0))
    changed = [k for k in original if not torch.equal(saved[k], original[k])]
    assert changed == ["model.layers.1.mlp.experts.2.up_proj.weight"]


FUSED = """remap 1
a.{q,k,v}.weight -> qkv | concat(dim=0) | transpose(0, 1)
b.weight -> b2 | scale(2.0)
c.weight -> c32 | cast(float32)
norm.weight -> norm
norm.weight -> norm_copy
"""


def small(folder: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"a.q.weight": torch.randn(6, 4, generator=g), "a.k.weight": torch.randn(2, 4, generator=g),
               "a.v.weight": torch.randn(3, 4, generator=g), "b.weight": torch.randn(5, generator=g),
               "c.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
               "norm.weight": torch.randn(4, generator=g)}
    return tiny_checkpoint(folder, tensors, {})


def test_value_steps_and_fan_out_are_undone(tmp_path):
    """concat + transpose back to q/k/v, scale(2) by 1/2, a widening cast back to bfloat16, a tensor
    read by two rules written once (the first rule's copy)."""
    source = small(tmp_path / "src")
    rules = rules_from_text(FUSED, "t.remap")
    state = loaded(source, rules)
    state["norm_copy"].fill_(123.0)  # the second reader of norm.weight: not what is written
    remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert identical(source, tmp_path / "out") == []


@pytest.mark.parametrize("text, code, words", [
    ("remap 1\na.{q,k,v}.weight -> qkv | concat(dim=0)\nb.weight -> b | slice(dim=0, start=0, stop=3)\n"
     "c.weight -> c\nnorm.weight -> norm\n", "E501", "hold 3 of its 5"),
    ("remap 1\na.{q,k,v}.weight -> qkv | concat(dim=0)\ndrop b.weight\nc.weight -> c\nnorm.weight -> norm\n",
     "E501", "`b.weight` is dropped"),
    ("remap 1\na.{q,k,v}.weight -> qkv | concat(dim=0)\nb.weight -> b | cast(bfloat16)\nc.weight -> c\n"
     "norm.weight -> norm\n", "E502", "cast(bfloat16)"),
])
def test_what_cannot_be_written_back_fails_before_writing(tmp_path, text, code, words):
    source = small(tmp_path / "src")
    rules = rules_from_text(text, "t.remap")
    state = loaded(source, rules)
    with pytest.raises(RemapError) as info:
        remapdsl.save(state, tmp_path / "out", rules, like=source)
    assert info.value.diagnostics[0].code == code and words in str(info.value)
    assert not (tmp_path / "out").exists() and no_staging(tmp_path)


def test_a_lossy_cast_saves_with_the_opt_in(tmp_path):
    source = small(tmp_path / "src")
    rules = rules_from_text("remap 1\na.{q,k,v}.weight -> qkv | concat(dim=0)\nb.weight -> b | cast(bfloat16)\n"
                            "c.weight -> c\nnorm.weight -> norm\n", "t.remap")
    state = loaded(source, rules)
    remapdsl.save(state, tmp_path / "out", rules, like=source, allow_lossy=True)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(saved["b.weight"], state["b"].float())


def test_a_save_without_like_reads_sizes_from_the_config_it_is_given(tmp_path):
    """Without `like` nothing is read from a checkpoint: the expert sizes the rule states come from
    `config` (E211 names the key when it is not given); with it, the layout is derived."""
    state = loaded(EXAMPLE, QWEN)
    with pytest.raises(RemapError) as info:
        remapdsl.save(state, tmp_path / "out", QWEN)
    d = info.value.diagnostics[0]
    assert d.code == "E211" and "config.moe_intermediate_size" in d.message and d.span.path.endswith("qwen3_moe.remap")
    assert not (tmp_path / "out").exists()
    config = json.loads((Path(EXAMPLE) / "config.json").read_text())
    remapdsl.save(state, tmp_path / "out", QWEN, config=config)
    again = loaded(tmp_path / "out", QWEN)
    assert again.keys() == state.keys() and all(torch.equal(again[k], v) for k, v in state.items())


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path):
    state = loaded(EXAMPLE, QWEN)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(RemapError) as info:
        remapdsl.save(state, out, QWEN, like=EXAMPLE)
    assert info.value.diagnostics[0].code == "E510" and (out / "keep.txt").read_text() == "old"
    remapdsl.save(state, out, QWEN, like=EXAMPLE, overwrite=True)
    assert identical(EXAMPLE, out) == [] and no_staging(tmp_path)


def test_a_failed_write_leaves_the_old_checkpoint_and_no_staging(tmp_path, monkeypatch):
    """A disk-full error in the middle of the writes: the destination is untouched (here an older
    checkpoint that overwrite=True would replace), and the staging folder is gone."""
    from remapdsl.checkpoint import writer

    state = loaded(EXAMPLE, QWEN)
    out = tmp_path / "out"
    remapdsl.save(state, out, QWEN, like=EXAMPLE)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = {"n": 0}
    real = writer.FileWriter.write_at

    def failing(self, file, offset, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real(self, file, offset, data)

    monkeypatch.setattr(writer.FileWriter, "write_at", failing)
    state["model.norm.weight"].fill_(5.0)
    with pytest.raises(OSError, match="No space left"):
        remapdsl.save(state, out, QWEN, like=EXAMPLE, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert no_staging(tmp_path)


def test_a_sharded_index_and_its_files_are_reproduced(tmp_path):
    """Three files and an index (the bundled checkpoint re-saved in shards)."""
    source = tmp_path / "sharded"
    source.mkdir()
    tensors = load_file(str(EXAMPLE / "model.safetensors"))
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[:15], keys[15:30], keys[30:])):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in part}, str(source / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (source / "config.json").write_text((EXAMPLE / "config.json").read_text())
    state = loaded(source, QWEN)
    remapdsl.save(state, tmp_path / "out", QWEN, like=source)
    assert identical(source, tmp_path / "out") == []


def test_an_empty_tensor_a_rule_reads_saves_back(tmp_path):
    """A checkpoint tensor with no elements ([0, 2]) is read by its rule though no block holds any of
    it: the save writes it back (to `like`'s layout and to a derived one), not E501 "read by no rule"."""
    source = tiny_checkpoint(tmp_path / "src", {"e": torch.zeros(0, 2), "a.w": torch.ones(2, 2)})
    rules = rules_from_text("remap 1\ne -> a\na.w -> b\n", "t.remap")
    state = {"a": torch.zeros(0, 2), "b": torch.zeros(2, 2)}
    remapdsl.load(state, source, rules, config={})
    remapdsl.save(state, tmp_path / "like", rules, like=source, config={})
    assert (tmp_path / "like" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    state["b"] += 1
    remapdsl.save(state, tmp_path / "derived", rules, config={})
    saved = load_file(str(tmp_path / "derived" / "model.safetensors"))
    assert saved["e"].shape == (0, 2) and torch.equal(saved["a.w"], torch.full((2, 2), 2.0))
    with pytest.raises(RemapError) as info:  # an empty tensor no rule reads is still E501
        remapdsl.save(state, tmp_path / "unread", rules_from_text("remap 1\na.w -> b\n", "u.remap"),
                      like=source, config={})
    assert [d.message for d in info.value.diagnostics] == [
        "checkpoint tensor `e` is read by no rule: no runtime tensor holds it"]
