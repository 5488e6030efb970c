"""open_inventory on single-file, indexed and index-less folders; cross-file and index errors; from_shapes."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from remapdsl.checkpoint.header import FileInfo, TensorInfo
from remapdsl.checkpoint.inventory import Inventory, open_inventory
from remapdsl.dtypes import BY_NAME
from remapdsl.errors import CheckpointError


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shard_tensors() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "model.embed_tokens.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
            "model.layers.0.mlp.gate_proj.weight": torch.randn(6, 4, generator=gen).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.tensor(0.5),
        },
        {
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.up_proj.weight_scale_inv": torch.tensor(0.25),
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 3),
        },
    ]


def write_sharded(
    folder,
    *,
    index: bool = True,
    names=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
) -> dict[str, str]:
    """Two shards (and an index): returns the weight_map."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, tensors in zip(names, shard_tensors(), strict=True):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / name), metadata={"format": "pt", "shard": name})
        weight_map |= dict.fromkeys(tensors, name)
    if index:
        write_index(folder, weight_map)
    return weight_map


def write_index(folder, weight_map: dict, name: str = "model.safetensors.index.json") -> None:
    (folder / name).write_text(json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map}))


def assert_matches_library(inv: Inventory) -> None:
    """Each TensorInfo agrees with safe_open, and its byte range holds exactly the tensor's bytes."""
    seen = set()
    for name, info in inv.files.items():
        path = inv.path(name)
        with open(path, "rb") as f:
            blob = f.read()
        assert info.nbytes == len(blob)
        with safe_open(path, framework="pt") as f:
            assert (f.metadata() or {}) == info.metadata
            for ckpt_key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = inv.tensors[ckpt_key]
                seen.add(ckpt_key)
                assert t.file == name and t.ckpt_key == ckpt_key
                assert BY_NAME[t.dtype].safetensors == f.get_slice(ckpt_key).get_dtype()
                assert list(t.shape) == f.get_slice(ckpt_key).get_shape()
                assert blob[t.byte_offset : t.byte_end] == tensor_bytes(f.get_tensor(ckpt_key))
    assert seen == set(inv.tensors)
    assert list(inv.tensors) == sorted(inv.tensors)


def codes(err: pytest.ExceptionInfo) -> list[str]:
    return sorted(d.code for d in err.value.diagnostics)


def test_single_file(tmp_path):
    tensors = shard_tensors()[0]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    inv = open_inventory(tmp_path)
    assert inv.root == str(tmp_path) and inv.index_file is None and inv.ignored_files == ()
    assert list(inv.files) == ["model.safetensors"] and inv.metadata == {
        "model.safetensors": {"format": "pt"}
    }
    assert inv.tensors["model.layers.0.mlp.gate_proj.weight"].dtype == "float8_e4m3fn"
    assert inv.tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == ()
    assert_matches_library(inv)
    assert open_inventory(tmp_path / "model.safetensors") == inv


def test_sharded_with_index(tmp_path):
    weight_map = write_sharded(tmp_path)
    inv = open_inventory(tmp_path)
    assert inv.index_file == "model.safetensors.index.json"
    assert {k: t.file for k, t in inv.tensors.items()} == weight_map
    assert set(inv.files) == set(weight_map.values()) and inv.ignored_files == ()
    assert inv.metadata["model-00002-of-00002.safetensors"]["shard"] == "model-00002-of-00002.safetensors"
    assert_matches_library(inv)
    assert open_inventory(tmp_path / "model.safetensors.index.json") == inv


def test_folder_of_shards_without_index(tmp_path):
    weight_map = write_sharded(tmp_path, index=False, names=("a.safetensors", "b.safetensors"))
    inv = open_inventory(tmp_path)
    assert inv.index_file is None and {k: t.file for k, t in inv.tensors.items()} == weight_map
    assert_matches_library(inv)


def test_index_is_authoritative_and_stray_files_are_listed(tmp_path):
    write_sharded(tmp_path)
    save_file({"model.norm.weight": torch.zeros(4)}, str(tmp_path / "consolidated.safetensors"))
    inv = open_inventory(tmp_path)
    assert inv.ignored_files == ("consolidated.safetensors",)
    assert inv.tensors["model.norm.weight"].file == "model-00002-of-00002.safetensors"
    assert "consolidated.safetensors" not in inv.files


def test_index_may_name_files_in_subfolders(tmp_path):
    write_sharded(tmp_path, names=("shards/one.safetensors", "shards/two.safetensors"))
    inv = open_inventory(tmp_path)
    assert inv.tensors["model.norm.weight"].file == "shards/two.safetensors"
    assert inv.path("shards/two.safetensors") == str(tmp_path / "shards" / "two.safetensors")
    assert_matches_library(inv)


def test_hub_cache_symlinks_are_followed(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    write_sharded(blobs)
    snap.mkdir(parents=True)
    for name in os.listdir(blobs):
        os.symlink(os.path.join("..", "..", "blobs", name), snap / name)
    inv = open_inventory(snap)
    assert inv.root == str(snap) and len(inv.tensors) == 7
    assert_matches_library(inv)


def test_symlink_to_a_directory_or_nowhere_is_an_error(tmp_path):
    weight_map = write_sharded(tmp_path)
    first = "model-00001-of-00002.safetensors"
    os.remove(tmp_path / first)
    os.symlink(tmp_path / "nowhere", tmp_path / first)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E301"] and first in err.value.diagnostic.message
    os.remove(tmp_path / first)
    (tmp_path / "adir").mkdir()
    os.symlink(tmp_path / "adir", tmp_path / first)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E301"]
    assert weight_map  # the index is unchanged; only the file broke


def test_duplicate_key_without_index_is_an_error(tmp_path):
    write_sharded(tmp_path, index=False, names=("a.safetensors", "b.safetensors"))
    save_file({"model.norm.weight": torch.zeros(4)}, str(tmp_path / "consolidated.safetensors"))
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    diag = err.value.diagnostic
    assert codes(err) == ["E324"] and "`model.norm.weight`" in diag.message
    assert "b.safetensors" in diag.message and "consolidated.safetensors" in diag.message


def test_index_names_a_key_missing_from_its_file(tmp_path):
    weight_map = write_sharded(tmp_path, index=False)
    weight_map["model.layers.0.mlp.down_proj.weight"] = "model-00001-of-00002.safetensors"
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E325"]
    msg = err.value.diagnostic.message
    assert "`model.layers.0.mlp.down_proj.weight`" in msg and "model-00001-of-00002.safetensors" in msg


def test_key_in_a_file_the_index_does_not_assign_it_to(tmp_path):
    weight_map = write_sharded(tmp_path, index=False)
    weight_map["model.norm.weight"] = "model-00001-of-00002.safetensors"  # wrong file
    del weight_map["empty"]  # not listed at all
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E326", "E326"]  # a key in the wrong file is one error, not also "missing" (E325)
    text = str(err.value)
    assert "`empty`" in text and "does not list it" in text
    assert "`model.norm.weight` is in model-00002-of-00002.safetensors" in text


def test_index_names_a_missing_file(tmp_path):
    weight_map = write_sharded(tmp_path, index=False)
    weight_map["extra.weight"] = "model-00003-of-00003.safetensors"
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    msg = err.value.diagnostic.message
    assert codes(err) == ["E301"] and "model-00003-of-00003.safetensors" in msg and "`extra.weight`" in msg


@pytest.mark.parametrize(
    "name",
    [
        "../outside.safetensors",
        "/etc/model.safetensors",
        "a/../../x.safetensors",
        "sub//x.safetensors",
        "./x.safetensors",
        "sub\\x.safetensors",
        "C:x.safetensors",
        "",
        "model.bin",
    ],
)
def test_index_file_names_cannot_escape_the_folder(tmp_path, name):
    folder = tmp_path / "ckpt"
    weight_map = write_sharded(folder, index=False)
    weight_map["model.norm.weight"] = name
    write_index(folder, weight_map)
    with pytest.raises(CheckpointError) as err:
        open_inventory(folder)
    assert codes(err) == ["E322"]
    assert "`model.norm.weight`" in err.value.diagnostic.message


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"metadata": {}}',
        '{"weight_map": {}}',
        '{"weight_map": {"a": 3}}',
        '{"weight_map": {"a": ["model.safetensors"]}}',  # not hashable: once a bare TypeError
        '{"weight_map": {"a": {"file": "model.safetensors"}}}',
        '{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}',
    ],
)
def test_malformed_index(tmp_path, text):
    write_sharded(tmp_path, index=False)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E321"] and "model.safetensors.index.json" in err.value.diagnostic.message


def test_no_checkpoint_and_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E320"]
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path / "config.json")
    assert codes(err) == ["E320"]
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path / "nope")
    assert codes(err) == ["E301"]


def test_several_index_files_without_the_default_are_ambiguous(tmp_path):
    weight_map = write_sharded(tmp_path, index=False)
    write_index(tmp_path, weight_map, "a.safetensors.index.json")
    write_index(tmp_path, weight_map, "b.safetensors.index.json")
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E327"]
    assert open_inventory(tmp_path / "b.safetensors.index.json").index_file == "b.safetensors.index.json"
    (tmp_path / "a.safetensors.index.json").unlink()
    assert open_inventory(tmp_path).index_file == "b.safetensors.index.json"


def test_problems_of_all_files_are_raised_together(tmp_path):
    write_sharded(tmp_path)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(tmp_path / name, "ab") as f:
            f.write(b"\0")  # trailing bytes no tensor covers
    with pytest.raises(CheckpointError) as err:
        open_inventory(tmp_path)
    assert codes(err) == ["E312", "E312"]
    assert {d.path for d in err.value.diagnostics} == {
        str(tmp_path / "model-00001-of-00002.safetensors"),
        str(tmp_path / "model-00002-of-00002.safetensors"),
    }


def test_inventory_is_frozen_and_round_trips(tmp_path):
    write_sharded(tmp_path)
    inv = open_inventory(tmp_path)
    with pytest.raises(TypeError):
        inv.tensors["x"] = inv.tensors["empty"]
    with pytest.raises(TypeError):
        inv.files.pop("model-00001-of-00002.safetensors")
    with pytest.raises(ValidationError):
        inv.root = "/elsewhere"
    assert pickle.loads(pickle.dumps(inv)) == inv
    assert Inventory.model_validate_json(inv.model_dump_json()) == inv
    assert hash(inv) == hash(pickle.loads(pickle.dumps(inv)))


def test_inventory_checks_its_own_invariants():
    info = FileInfo(file="f.safetensors", nbytes=16, data_offset=8)
    t = TensorInfo(ckpt_key="a", file="f.safetensors", dtype="float32", shape=(2,), byte_offset=8, nbytes=8)
    Inventory(root="/r", tensors={"a": t}, files={"f.safetensors": info})
    for tensors, files in [
        ({"b": t}, {"f.safetensors": info}),
        ({"a": t}, {"g.safetensors": info}),
        ({"a": t._replace(byte_offset=12)}, {"f.safetensors": info}),
    ]:
        with pytest.raises(ValueError):
            Inventory(root="/r", tensors=tensors, files=files)


def test_from_shapes_builds_a_large_synthetic_inventory():
    entries = {
        f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w": ("bfloat16", (16, 8)) for i in range(91_000)
    }
    entries["scale"] = ("F32", ())
    entries["packed"] = ("F4", (4, 6))
    inv = Inventory.from_shapes(entries)
    assert len(inv.tensors) == 91_002 and list(inv.tensors) == sorted(entries)
    assert inv.tensors["scale"].dtype == "float32" and inv.tensors["packed"].nbytes == 12
    ends = [t.byte_end for t in inv.tensors.values()]
    starts = [t.byte_offset for t in inv.tensors.values()]
    assert starts[0] == 8 and starts[1:] == ends[:-1]
    assert inv.files["model.safetensors"].nbytes == ends[-1]
    small = Inventory.from_shapes({"w": ("float8_e4m3fn", (2, 3))})
    assert hash(small) == hash(Inventory.from_shapes({"w": ("F8_E4M3", [2, 3])}))
    with pytest.raises(TypeError):
        small.files["model.safetensors"].metadata["k"] = "v"


def test_from_shapes_reports_every_bad_entry():
    with pytest.raises(CheckpointError) as err:
        Inventory.from_shapes(
            {"a": ("bfloat17", (1,)), "b": ("F32", (-1,)), "c": ("F4", (3,)), "d": ("U8", (2,))}
        )
    assert codes(err) == ["E306", "E307", "E309"]
    assert err.value.diagnostics[0].hint == "did you mean `bfloat16`?"
