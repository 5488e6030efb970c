"""What a save does with the checkpoint tensors the rules drop: `dropped="error"` (the default)
refuses (E501, its hint naming the other two), `"copy"` copies them unchanged from `like` (the
output byte-identical to `like` for an unchanged model), `"omit"` leaves them out (headers and
index lack them, a file left empty is not written). Real safetensors files, a transformers
DeepSeek-V3 checkpoint with an MTP layer, torchtitan's MTP case, 2 gloo ranks, the CLI.
"""

from __future__ import annotations

import filecmp
import json
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from depth import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl import RemapError
from remapdsl.language import rules_from_text
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = "remap 1\na.weight -> x.weight\ndrop b.weight\n"


def _minimal(folder: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    return tiny_checkpoint(folder, {"a.weight": torch.randn(4, 3, generator=gen), "b.weight": torch.randn(
        5, generator=gen, dtype=torch.float64).to(torch.bfloat16)}, metadata={"format": "pt"})


def _indexed(folder: Path) -> Path:
    """Three files with an index; the middle one holds only dropped tensors."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(1)
    groups = {"model-00001-of-00003.safetensors": ["a.weight", "c.weight"],
              "model-00002-of-00003.safetensors": ["b.weight", "b.bias"],
              "model-00003-of-00003.safetensors": ["d.weight", "e.bias"]}
    weight_map = {}
    for name, keys in groups.items():
        tiny_checkpoint(folder, {k: torch.randn(3, 2, generator=gen) for k in keys}, file=name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 24 * 6}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    return folder


def _loaded(checkpoint, rules) -> dict[str, torch.Tensor]:
    state = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(checkpoint)).empty_state_dict()
    remapdsl.load(state, checkpoint, rules)
    return state


def _differing(a: Path, b: Path) -> list[str]:
    """Files that differ between folders `a` and `b`, or are in only one."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}
    return sorted(n for n in names if not ((a / n).is_file() and (b / n).is_file()
                                           and filecmp.cmp(a / n, b / n, shallow=False)))


def _header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])


# -- the minimal case ------------------------------------------------------------------------------


def test_the_default_refuses_with_a_hint_naming_both_choices(tmp_path):
    source, rules = _minimal(tmp_path / "src"), rules_from_text(MINIMAL, "t.remap")
    with pytest.raises(RemapError) as info:
        remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source)
    d = info.value.diagnostics[0]
    assert d.code == "E501" and "`b.weight` is dropped" in d.message
    assert 'dropped="copy"' in d.hint and 'dropped="omit"' in d.hint
    assert not (tmp_path / "out").exists()


def test_copy_writes_files_byte_identical_to_like(tmp_path):
    source, rules = _minimal(tmp_path / "src"), rules_from_text(MINIMAL, "t.remap")
    report = remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source, dropped="copy")
    assert _differing(source, tmp_path / "out") == []
    assert report.bytes_copied == 5 * 2 and report.bytes_written == 4 * 3 * 4 + 5 * 2


def test_copy_keeps_the_new_values_of_what_the_rules_read(tmp_path):
    source, rules = _minimal(tmp_path / "src"), rules_from_text(MINIMAL, "t.remap")
    state = _loaded(source, rules)
    state["x.weight"].fill_(2.5)
    remapdsl.save(state, tmp_path / "out", rules, like=source, dropped="copy")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(source / "model.safetensors"))
    assert torch.equal(saved["a.weight"], torch.full((4, 3), 2.5))
    assert torch.equal(saved["b.weight"], original["b.weight"])


def test_omit_leaves_the_dropped_tensor_out_of_a_valid_file(tmp_path):
    source, rules = _minimal(tmp_path / "src"), rules_from_text(MINIMAL, "t.remap")
    state = _loaded(source, rules)
    remapdsl.save(state, tmp_path / "out", rules, like=source, dropped="omit")
    out = tmp_path / "out" / "model.safetensors"
    assert set(_header(out)) == {"__metadata__", "a.weight"} and _header(out)["__metadata__"] == {"format": "pt"}
    with safe_open(str(out), framework="pt") as f:
        assert list(f.keys()) == ["a.weight"] and torch.equal(f.get_tensor("a.weight"), state["x.weight"])
    # laid out as safetensors lays out the file it would write
    save_file({"a.weight": state["x.weight"]}, str(tmp_path / "expected.safetensors"), metadata={"format": "pt"})
    assert out.read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_an_unknown_choice_is_refused(tmp_path):
    source, rules = _minimal(tmp_path / "src"), rules_from_text(MINIMAL, "t.remap")
    with pytest.raises(RemapError) as info:
        remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source, dropped="skip")
    d = info.value.diagnostic
    assert (d.code, d.message) == ("E523", ("dropped='skip': what a save does with the checkpoint tensors the "
                                           "rules drop is one of 'error', 'copy', 'omit'"))
    assert d.hint == ('"copy" copies them unchanged from `like`, "omit" leaves them out, "error" (the default) '
                      'refuses the save')
    assert not (tmp_path / "out").exists()


# -- an index checkpoint ---------------------------------------------------------------------------


def test_omit_does_not_write_a_file_left_empty_nor_name_it_in_the_index(tmp_path):
    source = _indexed(tmp_path / "src")
    rules = rules_from_text("remap 1\n{a,c,d}.weight -> {a,c,d}_w\ne.bias -> e_b\ndrop b.{weight,bias}\n", "t.remap")
    state = _loaded(source, rules)
    remapdsl.save(state, tmp_path / "out", rules, like=source, dropped="omit")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 24 * 4}, "weight_map": {
        "a.weight": "model-00001-of-00003.safetensors", "c.weight": "model-00001-of-00003.safetensors",
        "d.weight": "model-00003-of-00003.safetensors", "e.bias": "model-00003-of-00003.safetensors"}}
    for name in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):  # unchanged files
        assert (out / name).read_bytes() == (source / name).read_bytes()
    remapdsl.save(state, tmp_path / "copy", rules, like=source, dropped="copy")
    assert _differing(source, tmp_path / "copy") == []


# -- DeepSeek-V3 with its MTP layer (transformers, the shipped rules) -------------------------------


def _add_mtp_layer(tensors: dict, n: int, dim: int, vocab: int) -> dict:
    """The release's multi-token-prediction layer `model.layers.{n}`: norms, projection, and its own
    copies of the embedding and head (a few of its tensors: the rules drop the whole layer)."""
    gen = torch.Generator().manual_seed(7)
    dtype = tensors["model.norm.weight"].dtype
    extra = {"enorm.weight": (dim,), "hnorm.weight": (dim,), "eh_proj.weight": (dim, 2 * dim),
             "shared_head.norm.weight": (dim,), "embed_tokens.weight": (vocab, dim),
             "shared_head.head.weight": (vocab, dim)}
    return dict(tensors, **{f"model.layers.{n}.{k}": torch.randn(s, generator=gen).to(dtype) for k, s in extra.items()})


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_omit_keeps_an_index_s_metadata_as_it_is_when_it_has_no_total_size(tmp_path, metadata):
    """An index may come without `metadata`, or with one that holds no `total_size`: the written
    index keeps it as it was (none is added) and names only the tensors written."""
    source = _indexed(tmp_path / "src")
    index_file = source / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    if metadata is None:
        del index["metadata"]
    else:
        index["metadata"] = metadata
    index_file.write_text(json.dumps(index))
    rules = rules_from_text("remap 1\n{a,c,d}.weight -> {a,c,d}_w\ne.bias -> e_b\ndrop b.{weight,bias}\n", "t.remap")
    remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source, dropped="omit")
    written = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert written.get("metadata") == metadata
    assert sorted(written["weight_map"]) == ["a.weight", "c.weight", "d.weight", "e.bias"]

def test_deepseek_v3_with_an_mtp_layer_saves_back_byte_identical_with_copy(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import CASES, build, copy_checkpoint

    case = CASES["deepseek_v3"]
    built = build(case, tmp_path / "hf")
    c = case.config
    source = copy_checkpoint(built.folder, tmp_path / "release",
                             lambda t: _add_mtp_layer(t, c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]))
    rules = str(ROOT / case.rules)
    state = {k: torch.empty_like(v) for k, v in built.state_dict.items()}
    remapdsl.load(state, source, rules)
    assert all(torch.equal(state[k], v) for k, v in built.state_dict.items())
    with pytest.raises(RemapError):
        remapdsl.save(state, tmp_path / "refused", rules, like=source)
    report = remapdsl.save(state, tmp_path / "out", rules, like=source, dropped="copy")
    assert _differing(source, tmp_path / "out") == []
    assert report.bytes_copied == sum(t.nbytes for k, t in load_file(str(source / "model.safetensors")).items()
                                      if k.startswith(f"model.layers.{c['num_hidden_layers']}."))


def test_torchtitans_mtp_case_saves_back_with_copy(tmp_path):
    """tests/test_torchtitan.py's case whose MTP copies of the embedding and head cannot be saved
    back by default: with dropped="copy" they come from `like` and the files are byte-identical."""
    titan = pytest.importorskip("test_torchtitan")
    built = titan.Checkpoints(tmp_path / "titan")("deepseek_v3_mtp")
    expected, _ = titan.torchtitan_load(built)
    remapdsl.save(expected, tmp_path / "out", ROOT / built.case.hf.rules, like=built.folder, dropped="copy")
    assert _differing(built.folder, tmp_path / "out") == []


# -- 2 gloo ranks ----------------------------------------------------------------------------------


def _save_on_ranks(rank: int, world: int, source: str, out: str) -> tuple[int, int]:
    rules = rules_from_text(MINIMAL.replace("drop b.weight", "drop {b,c,d}.weight"), "t.remap")
    report = remapdsl.save(_loaded(source, rules), out, rules, like=source, dropped="copy")
    return report.bytes_copied, report.bytes_written


@pytest.mark.distributed
def test_two_ranks_share_the_copies_by_bytes(tmp_path):
    """Three dropped tensors copied by two ranks: half the bytes each, the line between them inside the
    first, so the second rank's share spans the rest of it and both others."""
    gen = torch.Generator().manual_seed(3)
    source = tiny_checkpoint(tmp_path / "src", {"a.weight": torch.randn(4, 3, generator=gen),
                                                "b.weight": torch.randn(1000, generator=gen),
                                                "c.weight": torch.randn(10, generator=gen),
                                                "d.weight": torch.randn(500, generator=gen)}, metadata={"format": "pt"})
    results = run_ranks(_save_on_ranks, 2, str(source), str(tmp_path / "out"), timeout=60, backend="cuda:gloo")
    copied = [r[0] for r in results]
    assert copied == [3020, 3020]  # 4000 + 40 + 2000 bytes of dropped tensors, half each: b.weight split
    assert _differing(source, tmp_path / "out") == []


# -- the CLI ---------------------------------------------------------------------------------------


def test_the_cli_reverse_conversion_takes_dropped(tmp_path, capsys):
    from remapdsl.cli import main

    source = _minimal(tmp_path / "src")
    (tmp_path / "t.remap").write_text(MINIMAL)
    rules = str(tmp_path / "t.remap")
    assert main(["convert", str(source), str(tmp_path / "runtime"), "--rules", rules]) == 0
    args = ["convert", str(tmp_path / "runtime"), str(tmp_path / "back"), "--rules", rules, "--reverse",
            "--like", str(source)]
    assert main(args) != 0 and "E501" in capsys.readouterr().err
    assert main([*args, "--dropped", "copy"]) == 0
    assert _differing(source, tmp_path / "back") == []
    assert main([*args[:2], str(tmp_path / "omitted"), *args[3:], "--dropped", "omit"]) == 0
    assert set(_header(tmp_path / "omitted" / "model.safetensors")) == {"__metadata__", "a.weight"}


# -- a quantized checkpoint ------------------------------------------------------------------------

FP8 = """remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[4, 4], to=bfloat16)
a.weight -> a
drop b.weight
"""


def _fp8(folder: Path) -> Path:
    gen = torch.Generator().manual_seed(5)
    return tiny_checkpoint(folder, {"a.weight": torch.randn(8, 8, generator=gen).to(torch.float8_e4m3fn),
                                    "a.weight_scale_inv": torch.rand(2, 2, generator=gen) + 0.5,
                                    "b.weight": torch.randn(6, generator=gen)}, metadata={"format": "pt"})


def test_a_quantized_checkpoint_copies_the_dropped_tensor_with_the_stored_scales(tmp_path):
    source, rules = _fp8(tmp_path / "src"), rules_from_text(FP8, "t.remap")
    report = remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source, dropped="copy")
    assert _differing(source, tmp_path / "out") == []
    assert report.bytes_copied == 2 * 2 * 4 + 6 * 4  # the scales and b.weight


def test_omit_with_stored_scales_to_read_back_is_refused(tmp_path):
    source, rules = _fp8(tmp_path / "src"), rules_from_text(FP8, "t.remap")
    with pytest.raises(RemapError) as info:
        remapdsl.save(_loaded(source, rules), tmp_path / "out", rules, like=source, dropped="omit")
    d = info.value.diagnostics[0]
    assert (d.code, d.message) == ("E524", ('dropped="omit" would leave out 1 tensor(s), starting with '
                                   "`b.weight`, and lay their files out anew, but the rules dequantize tensors whose "
                                   "stored scales are written back from `like`"))
    assert d.hint == 'pass dropped="copy" to keep them unchanged (the layout stays `like`\'s)'
    assert not (tmp_path / "out").exists()


def test_a_prepared_save_requantizes_as_the_one_shot_save_does(tmp_path):
    """`requantize=True` writes new scales (each block's largest value over the format's) where the stored
    ones are copied by default: a prepared object's save gives the same files as `remapdsl.save`, either way."""
    source, rules = _fp8(tmp_path / "src"), rules_from_text(FP8, "t.remap")
    state = _loaded(source, rules)
    state["a"] = state["a"] * 2  # new values, so new scales where they are worked out again
    prepared = remapdsl.prepare(rules, source)
    for requantize in (None, False, True):  # None: the default of each
        given = {} if requantize is None else {"requantize": requantize}
        one_shot, again = tmp_path / f"one{requantize}", tmp_path / f"prepared{requantize}"
        remapdsl.save(state, one_shot, rules, like=source, dropped="copy", allow_lossy=True, **given)
        prepared.save(state, again, dropped="copy", allow_lossy=True, **given)
        assert _differing(one_shot, again) == []
    assert _differing(tmp_path / "oneFalse", tmp_path / "oneTrue") == ["model.safetensors"]


@settings(max_examples=scaled(30), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=6), st.sampled_from([1, 5, 64]))
def test_copied_tensors_of_any_sizes_come_through_any_copy_buffer_unchanged(tensors, step):
    """Tensors the rules drop (copied with dropped="copy") between tensors they read and the save changes,
    of sizes above and below a copy buffer made small: each copied tensor comes through whole, in as
    many steps as it takes, and no copy runs into its neighbours' new values."""
    from unittest import mock

    import remapdsl.drivers.save as save_driver

    g = torch.Generator().manual_seed(len(tensors) * 100 + step)
    originals = {f"t{i}.weight": torch.randn(n, generator=g) for i, (n, _) in enumerate(tensors)}
    dropped = [f"t{i}.weight" for i, (_, drop) in enumerate(tensors) if drop]
    text = "remap 1\n" + "".join(f"drop {k}\n" if k in dropped else f"{k} -> {k[:-7]}\n" for k in originals)
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_checkpoint(Path(tmp) / "src", originals, metadata={"format": "pt"})
        rules = rules_from_text(text, "t.remap")
        state = _loaded(source, rules) if len(dropped) < len(originals) else {}
        for tensor in state.values():
            tensor.add_(100)  # new values beside every copied tensor
        with mock.patch.object(save_driver, "COPY_BYTES", step):
            report = remapdsl.save(state, Path(tmp) / "out", rules, like=source, dropped="copy")
        saved = load_file(str(Path(tmp) / "out" / "model.safetensors"))
    assert sorted(saved) == sorted(originals)
    for key, original in originals.items():
        assert torch.equal(saved[key], original if key in dropped else original + 100), key
    assert report.bytes_copied == sum(originals[k].nbytes for k in dropped)
    assert 0 <= report.sync_seconds <= report.seconds
