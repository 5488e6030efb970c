"""transformers as the oracle: a shipped rule file must load a save_pretrained checkpoint into exactly
the model's state_dict(), bit for bit, reading every stored byte once.

The checkpoints are tiny random models built by tests/hf_models.py (once per session). Skipped where
transformers is not installed.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_models import CASES, ModelFactory, checkpoint_tensor_bytes, copy_checkpoint  # noqa: E402

import remapdsl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> ModelFactory:
    """Builds and saves each tiny model on first use; later uses get the same folder and state dict."""
    return ModelFactory(tmp_path_factory.mktemp("hf_models"))


def _load(built, folder: Path | None = None):
    """remapdsl.load into fresh NaN-filled destinations shaped like the state dict."""
    target = {k: torch.empty_like(v).fill_(float("nan")) for k, v in built.state_dict.items()}
    dest = dict(target)
    report = remapdsl.load(target, str(folder or built.folder), str(REPO / built.case.rules))
    return target, dest, report


# -- the oracle itself is meaningful --------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_fixture_has_no_degenerate_tensors(hf_models, name):
    """from_config leaves norms at 1 and biases at 0; the fixture must have randomized them."""
    built = hf_models(name)
    constant = [k for k, v in built.state_dict.items() if v.numel() > 1 and bool((v == v.flatten()[0]).all())]
    assert constant == []
    assert {v.dtype for v in built.state_dict.values()} >= {built.case.dtype}


def test_sharded_fixture_spreads_experts_over_files(hf_models):
    built = hf_models("qwen3_moe_12e_sharded")
    index = json.loads((built.folder / "model.safetensors.index.json").read_text())
    files_per_layer = defaultdict(set)
    for key, file in index["weight_map"].items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.", key)
        if m:
            files_per_layer[m.group(1)].add(file)
    assert len(set(index["weight_map"].values())) > 1
    assert max(len(files) for files in files_per_layer.values()) > 1
    assert set(index["weight_map"]) == set(checkpoint_tensor_bytes(built.folder))


# -- loads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_load_matches_transformers_state_dict(hf_models, name):
    built = hf_models(name)
    expected = built.state_dict
    target, dest, report = _load(built)

    assert set(target) == set(expected), "load must not add or remove destination keys"
    replaced = [k for k in expected if target[k] is not dest[k]]
    assert replaced == [], f"load must fill the given tensors in place, not replace them: {replaced[:5]}"
    wrong = []
    for key, want in expected.items():
        got = target[key]
        if got.dtype != want.dtype or got.shape != want.shape:
            wrong.append(f"{key}: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}")
        elif not torch.equal(got, want):
            wrong.append(f"{key}: values differ")
    assert wrong == [], "\n".join(wrong)

    loaded = list(report.loaded)
    assert len(loaded) == len(set(loaded)), "report.loaded lists a key twice"
    assert set(loaded) == set(expected)

    stored = checkpoint_tensor_bytes(built.folder)
    total = sum(stored.values())
    if built.case.tied:
        # lm_head.weight is not stored; it comes from the embedding, which may be read once or twice.
        assert "lm_head.weight" not in stored
        assert total <= report.bytes_read <= total + stored["model.embed_tokens.weight"]
    else:
        assert report.bytes_read == total, "every stored byte must be read exactly once"


# -- checkpoints that must be refused ------------------------------------------------------------


def test_expert_gap_is_an_error_not_a_reslot(hf_models, tmp_path):
    """Experts {0, 1, 2, 5} with four slots: expert 5 must not silently land in slot 3."""
    built = hf_models("qwen3_moe")

    def rename_3_to_5(tensors):
        return {k.replace(".mlp.experts.3.", ".mlp.experts.5."): v for k, v in tensors.items()}

    folder = copy_checkpoint(built.folder, tmp_path / "gap", rename_3_to_5)
    with pytest.raises(remapdsl.RemapError):
        _load(built, folder)


def test_missing_expert_tensor_is_named(hf_models, tmp_path):
    built = hf_models("qwen3_moe")
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"

    def drop_one(tensors):
        assert missing in tensors
        return {k: v for k, v in tensors.items() if k != missing}

    folder = copy_checkpoint(built.folder, tmp_path / "missing", drop_one)
    with pytest.raises(remapdsl.RemapError) as excinfo:
        _load(built, folder)
    assert missing in str(excinfo.value)


# -- the save direction ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_check_command_passes_on_the_cases_checkpoint(hf_models, capsys, name):
    """`remapdsl check RULES --checkpoint DIR`, as a model author runs it, on the checkpoint the
    oracle verifies the file against."""
    from remapdsl.cli import main

    built = hf_models(name)
    assert main(["check", str(REPO / built.case.rules), "--checkpoint", str(built.folder)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", list(CASES))
def test_save_reproduces_the_save_pretrained_checkpoint(hf_models, tmp_path, name):
    """load -> save through the same rule file writes transformers' own files back, byte for byte:
    keys, dtypes, headers, offsets, the index of a sharded save (a tied lm_head is read from the
    embedding and, not being in the checkpoint, not written)."""
    import filecmp

    built = hf_models(name)
    target, _, _ = _load(built)
    out = tmp_path / "saved"
    remapdsl.save(target, out, str(REPO / built.case.rules), like=str(built.folder))
    tensors_and_index = [p.name for p in built.folder.iterdir() if p.suffix in (".safetensors", ".json")]
    assert tensors_and_index
    for file in tensors_and_index:  # the weights, the index of a sharded save, config.json
        assert filecmp.cmp(built.folder / file, out / file, shallow=False), file
