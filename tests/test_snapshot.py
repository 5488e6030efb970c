"""Snapshots: a checkpoint's headers, index and config without its data, written deterministically,
read back as untrusted input, and accepted wherever headers suffice (and refused where data is needed)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import remapdsl
from remapdsl.checkpoint.snapshot import SnapshotInventory, open_snapshot, snapshot_of
from remapdsl.cli import main
from remapdsl.errors import CheckpointError, RemapError

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "examples" / "tiny-qwen3-moe"
RULES = str(ROOT / "rules" / "qwen3_moe.remap")


@pytest.fixture
def snapshot(tmp_path) -> Path:
    path = tmp_path / "model.headers.json"
    assert main(["snapshot", str(CHECKPOINT), "-o", str(path)]) == 0
    return path


def test_a_snapshot_is_the_inventory_and_config_without_data(snapshot):
    inventory = remapdsl.open_checkpoint(CHECKPOINT)
    restored = remapdsl.open_checkpoint(snapshot)
    assert isinstance(restored, SnapshotInventory)
    assert restored.tensors == inventory.tensors and restored.files == inventory.files
    assert restored.index_file is None and restored.ignored_files == ()
    assert restored.config == json.loads((CHECKPOINT / "config.json").read_text())
    assert snapshot.stat().st_size < 10_000
    text = snapshot.read_text()
    assert json.loads(text)["format"] == "remapdsl-snapshot" and json.loads(text)["version"] == 1
    assert sum("data_offsets" in line for line in text.splitlines()) == len(inventory.tensors)  # one a line


def test_snapshots_are_deterministic_and_idempotent(snapshot, tmp_path):
    again = tmp_path / "again.json"
    remapdsl.write_snapshot(CHECKPOINT, again)
    assert again.read_bytes() == snapshot.read_bytes()
    of_snapshot = tmp_path / "of_snapshot.json"
    remapdsl.write_snapshot(snapshot, of_snapshot)
    assert of_snapshot.read_bytes() == snapshot.read_bytes()


def test_a_snapshot_pickles_with_its_config(snapshot):
    restored = remapdsl.open_checkpoint(snapshot)
    copy = pickle.loads(pickle.dumps(restored))
    assert isinstance(copy, SnapshotInventory) and copy == restored and copy.config == restored.config


def test_indexed_checkpoints_keep_their_grouping(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.zeros(2), "b": torch.ones(3, dtype=torch.bfloat16)}, str(folder / "m-1.safetensors"))
    save_file({"c": torch.zeros(4, dtype=torch.int8)}, str(folder / "m-2.safetensors"))
    save_file({"z": torch.zeros(1)}, str(folder / "stray.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}))
    path = tmp_path / "s.headers.json"
    remapdsl.write_snapshot(folder, path)
    restored = remapdsl.open_checkpoint(path)
    original = remapdsl.open_checkpoint(folder)
    assert restored.tensors == original.tensors
    assert restored.index_file == "model.safetensors.index.json"
    assert restored.ignored_files == ("stray.safetensors",)
    assert {t.file for t in restored.tensors.values()} == {"m-1.safetensors", "m-2.safetensors"}


def test_check_explain_and_plan_take_a_snapshot(snapshot, capsys):
    assert main(["check", RULES, "--checkpoint", str(snapshot)]) == 0
    assert "25 runtime tensors from 45 checkpoint tensors" in capsys.readouterr().out
    assert main(["explain", RULES, "--checkpoint", str(snapshot), "--key", "*layers.0.mlp.*"]) == 0
    from_snapshot = capsys.readouterr().out
    assert main(["explain", RULES, "--checkpoint", str(CHECKPOINT), "--key", "*layers.0.mlp.*"]) == 0
    assert capsys.readouterr().out == from_snapshot
    layout = str(ROOT / "examples" / "tp2_layout.json")
    assert main(["plan", RULES, "--checkpoint", str(snapshot), "--mesh", "tp=2", "--layout", layout]) == 0
    assert "1.00x owned" in capsys.readouterr().out


def test_the_compile_uses_the_snapshots_config(snapshot, tmp_path):
    data = json.loads(snapshot.read_text())
    data["config"]["tie_word_embeddings"] = True  # the rules then drop lm_head.weight
    changed = tmp_path / "tied.headers.json"
    changed.write_text(json.dumps(data))
    compiled = remapdsl.compile_rules(RULES, changed)
    assert compiled == remapdsl.compile_rules(RULES, CHECKPOINT, config=data["config"])
    assert compiled != remapdsl.compile_rules(RULES, snapshot)


def test_what_needs_data_refuses_a_snapshot_with_one_error(snapshot, tmp_path, capsys):
    state = remapdsl.compile_rules(RULES, snapshot).empty_state_dict()
    calls = [lambda: remapdsl.load(state, snapshot, RULES),
             lambda: remapdsl.load(state, remapdsl.open_checkpoint(snapshot), RULES),
             lambda: remapdsl.save(state, tmp_path / "out", RULES, like=snapshot),
             lambda: remapdsl.convert(snapshot, tmp_path / "out", RULES),
             lambda: remapdsl.convert(CHECKPOINT, tmp_path / "out", RULES, reverse=True, like=snapshot)]
    for call in calls:
        with pytest.raises(RemapError) as info:
            call()
        (diag,) = info.value.diagnostics
        assert diag.code == "E331" and "needs tensor data" in diag.message and diag.path == str(snapshot)
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(snapshot), str(tmp_path / "out"), "--rules", RULES]) == 2
    assert "error[E331]: a conversion needs tensor data" in capsys.readouterr().err


# -- untrusted input -----------------------------------------------------------------------------


def _edited(snapshot: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(snapshot.read_text())
    edit(data)
    out = tmp_path / "edited.headers.json"
    out.write_text(json.dumps(data))
    return out


def _header(data) -> dict:
    return data["files"]["model.safetensors"]["header"]


WHERE = 'snapshot files["model.safetensors"]'


@pytest.mark.parametrize("edit, code, words", [
    (lambda d: _header(d)["lm_head.weight"].update(dtype="F33"), "E306",
     f'{WHERE}.header: tensor `lm_head.weight`: dtype "F33" is not a safetensors dtype'),
    (lambda d: _header(d)["lm_head.weight"].update(shape=[64, -16]), "E307", "tensor `lm_head.weight`: shape"),
    (lambda d: _header(d)["lm_head.weight"].update(shape=[64, 17]), "E309", "needs 4352 bytes"),
    (lambda d: _header(d)["lm_head.weight"].update(data_offsets=[8, 4104]), "E311", "overlaps"),
    (lambda d: _header(d)["lm_head.weight"].update(data_offsets=[0, True]), "E308", "data_offsets"),
    (lambda d: _header(d)["lm_head.weight"].update(extra=1), "E305", "exactly dtype, shape, data_offsets"),
    (lambda d: d["files"]["model.safetensors"].update(nbytes=10**20), "E330", f"{WHERE}.nbytes: must be"),
    (lambda d: d["files"]["model.safetensors"].update(nbytes=9000), "E310", "run past"),
    (lambda d: d["files"]["model.safetensors"].update(data_offset=4), "E330", f"{WHERE}.data_offset"),
    (lambda d: d["files"]["model.safetensors"].update(header=[]), "E330", f"{WHERE}.header: must be an object"),
    (lambda d: _header(d).update({"__metadata__": {"a": 1}}), "E313", "`__metadata__` must map strings"),
    (lambda d: d["files"].update({"../x.safetensors": d["files"]["model.safetensors"]}), "E322", "`..`"),
    (lambda d: d.update(version=2), "E330", 'expected `"format": "remapdsl-snapshot"` and `"version": 1`'),
    (lambda d: d.update(config=[1]), "E330", "snapshot config: must be an object"),
    (lambda d: d.update(index_file="../index.json"), "E330", "snapshot index_file"),
    (lambda d: d.update(surprise=1), "E330", "unknown surprise"),
    (lambda d: d.update(files={}), "E330", "snapshot files: must be a non-empty object"),
])
def test_a_bad_snapshot_is_a_located_error(snapshot, tmp_path, edit, code, words):
    path = _edited(snapshot, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        remapdsl.open_checkpoint(path)
    diags = info.value.diagnostics
    assert [d.code for d in diags if d.code == code], [d.code for d in diags]
    assert any(words in d.message and d.path == str(path) for d in diags), [d.message for d in diags]


def test_a_snapshot_that_is_not_json_or_too_large(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": NaN}')
    with pytest.raises(CheckpointError) as info:
        open_snapshot(bad)
    assert info.value.diagnostics[0].code == "E330"
    from remapdsl.checkpoint import snapshot as module

    monkeypatch.setattr(module, "MAX_SNAPSHOT_NBYTES", 4)
    with pytest.raises(CheckpointError, match="larger than 4 bytes"):
        open_snapshot(bad)
    with pytest.raises(CheckpointError) as info:
        open_snapshot(tmp_path / "missing.json")
    assert info.value.diagnostics[0].code == "E301"


def test_every_problem_is_reported_at_once(snapshot, tmp_path):
    def edit(d):
        _header(d)["lm_head.weight"]["dtype"] = "X"
        _header(d)["model.norm.weight"]["shape"] = "16"
        d["config"] = None

    with pytest.raises(CheckpointError) as info:
        remapdsl.open_checkpoint(_edited(snapshot, tmp_path, edit))
    assert {"E306", "E307", "E330"} <= {d.code for d in info.value.diagnostics}


def test_snapshot_of_an_inventory_needs_no_files():
    inventory = remapdsl.checkpoint.Inventory.from_shapes({"a": ("bfloat16", (2, 3)), "b": ("F8_E4M3", (4,))})
    data = snapshot_of(inventory, config={"hidden_size": 2})
    assert data["files"]["model.safetensors"]["header"]["b"] == {"dtype": "F8_E4M3", "shape": [4],
                                                                 "data_offsets": [12, 16]}


def test_the_command_reports_a_missing_checkpoint(tmp_path, capsys):
    assert main(["snapshot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "s.json")]) == 2
    assert "error[E301]" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()
