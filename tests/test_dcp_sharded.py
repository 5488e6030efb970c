"""DCP-sharded safetensors (torch's HuggingFaceStorageWriter with save_distributed=True) read as one
checkpoint: chunks that tile each tensor, plans that split pieces per chunk, consolidation by
`remapdsl convert` with identity rules against torch's own consolidation.

One group of 2 gloo ranks writes every folder with the real writer (DTensors sharded on dim 0, on
dim 1), then loads, saves and converts on those same ranks; 4 ranks on a 2x2 mesh write a folder
whose matrices are sharded on both dims. The rest runs in this process.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl.checkpoint import open_inventory
from remapdsl.checkpoint.inventory import Inventory
from remapdsl.checkpoint.snapshot import open_snapshot, write_snapshot
from remapdsl.errors import CheckpointError, RemapError
from remapdsl.language import rules_from_text
from remapdsl.runtime.read import run_load_plan
from remapdsl.sharding import Shard, local_shard
from remapdsl.sharding.plans import make_load_plan
from remapdsl.testing.ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent
IDENTITY = REPO / "rules" / "identity.remap"
FUSED = REPO / "rules" / "llama_fused.remap"
INFO = "DCP_SHARDING_INFO"


def _placement(key: str, shape, how: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as TorchShard

    if how == "dim1" and len(shape) == 2:
        return [TorchShard(1)]
    if key.endswith("norm.weight") and how == "dim0":
        return [Replicate()]  # held whole by every rank: DCP writes it once, in one file
    return [TorchShard(0)]


def _write_rank(rank: int, world: int, original: str, out: str) -> dict:
    """On each rank: write the original through DCP's distributed writer, sharded two ways; then
    load, save and convert those folders on this group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    full = load_file(str(Path(original) / "model.safetensors"))
    mesh = init_device_mesh("cpu", (world,))
    keys = sorted(full)
    mapping = {k: 1 + (i * 2 // len(keys)) for i, k in enumerate(keys)}  # two output files
    for how in ("dim0", "dim1"):
        state = {k: distribute_tensor(t, mesh, _placement(k, t.shape, how)) for k, t in full.items()}
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(f"{out}/{how}", save_distributed=True,
                                                                fqn_to_index_mapping=mapping))
    if rank == 0:  # what a trainer keeps next to its weights
        for how in ("dim0", "dim1"):
            shutil.copyfile(Path(original) / "config.json", Path(out) / how / "config.json")
    torch.distributed.barrier()
    # Sharded loads on a mesh other than the writer's: dim0's tensors read sharded on dim 1, through
    # identity rules and through fusing ones (each against the original loaded whole).
    figures = {}
    for name, rules in (("identity", IDENTITY), ("fused", FUSED)):
        expected = remapdsl.compile_rules(rules, original).empty_state_dict()
        remapdsl.load(expected, original, rules)
        target = {k: distribute_tensor(torch.zeros_like(t), mesh, [TorchShard(1 if t.dim() == 2 else 0)])
                  for k, t in expected.items()}
        report = remapdsl.load(target, f"{out}/dim0", rules)
        same = all(torch.equal(target[k].to_local(),
                               distribute_tensor(expected[k], mesh, target[k].placements).to_local())
                   for k in expected)
        figures[name] = {"same": same, "bytes_read": report.bytes_read, "bytes_owned": report.bytes_owned}
        if name == "identity":
            kept = target
    target = kept
    # The same DTensors saved back into dim0's chunked layout (like=), and a 2-rank consolidation.
    remapdsl.save(target, f"{out}/saved", IDENTITY, like=f"{out}/dim0")
    remapdsl.convert(f"{out}/dim1", f"{out}/converted2", IDENTITY, max_shard_bytes=40_000, budget_bytes=20_000)
    return figures


def _write_grid(rank: int, world: int, original: str, out: str) -> None:
    """On 4 ranks, a 2x2 mesh: every matrix sharded on both dims (Shard(0), Shard(1)), each vector
    on dim 0 over the first mesh dim and replicated over the second."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as TorchShard

    full = load_file(str(Path(original) / "model.safetensors"))
    mesh = init_device_mesh("cpu", (2, 2))
    state = {k: distribute_tensor(t, mesh, [TorchShard(0), TorchShard(1) if t.dim() == 2 else Replicate()])
             for k, t in full.items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(f"{out}/grid", save_distributed=True))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hf_models import CASES, build

    root = tmp_path_factory.mktemp("dcp")
    build(CASES["llama"], root / "original")
    results = run_ranks(_write_rank, 2, str(root / "original"), str(root), timeout=120)
    run_ranks(_write_grid, 4, str(root / "original"), str(root), timeout=120)
    for how in ("grid",):  # what a trainer keeps next to its weights
        shutil.copyfile(root / "original" / "config.json", root / how / "config.json")
    return root, results


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no iteration
    return out


# -- the inventory -------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_dcp_sharded_folder_is_one_tensor_per_key_made_of_chunks(folders):
    root, _ = folders
    original = open_inventory(root / "original")
    for how in ("dim0", "dim1"):
        inv = open_inventory(root / how)
        assert sorted(inv.tensors) == sorted(original.tensors)
        assert all(inv.tensors[k].shape == t.shape and inv.tensors[k].dtype == t.dtype
                   for k, t in original.tensors.items())
        assert len(inv.files) == 4 and all(n.startswith("shard-0000") for n in inv.files)
        sharded = {k for k, t in original.tensors.items() if not k.endswith("norm.weight") or how == "dim1"}
        assert set(inv.chunks) == sharded  # a replicated tensor is an ordinary one, in one file
        for k, chunks in inv.chunks.items():
            assert len(chunks) == 2 and len({c.file for c in chunks}) == 2
        back = pickle.loads(pickle.dumps(inv))
        assert back == inv and back.chunks == inv.chunks
        assert type(inv).model_validate_json(inv.model_dump_json()) == inv  # validated, chunks checked
    grid = open_inventory(root / "grid")  # 4 ranks, a 2x2 mesh: matrices in 4 chunks, vectors in 2
    assert len(grid.files) == 4 and set(grid.chunks) == set(original.tensors)
    for k, chunks in grid.chunks.items():
        shape = original.tensors[k].shape
        assert len(chunks) == (4 if len(shape) == 2 else 2)
        assert {c.offsets for c in chunks} == ({(0, 0), (shape[0] // 2, 0), (0, shape[1] // 2),
                                                (shape[0] // 2, shape[1] // 2)} if len(shape) == 2 else
                                               {(0,), (shape[0] // 2,)})


@pytest.mark.distributed
def test_a_chunked_tensor_has_no_single_byte_range_to_read(folders):
    """`CheckpointReader.read_tensor` reads one byte range: a DCP-chunked key names its chunks'
    files instead of reading the first chunk's range at the whole tensor's length (E357)."""
    from remapdsl.checkpoint import CheckpointReader

    root, _ = folders
    inv = open_inventory(root / "dim0")
    key = next(k for k in sorted(inv.chunks) if k.endswith("q_proj.weight"))
    with CheckpointReader(inv) as reader, pytest.raises(CheckpointError) as info:
        reader.read_tensor(key)
    (d,) = info.value.diagnostics
    assert d.code == "E357" and f"`{key}` is stored in 2 DCP chunks" in d.message
    assert d.path == inv.path(inv.tensors[key].file) and "--rules identity" in d.hint


@pytest.mark.distributed
def test_a_snapshot_carries_the_chunks(folders, tmp_path):
    root, _ = folders
    inv = open_inventory(root / "dim1")
    write_snapshot(inv, tmp_path / "s.json")
    snap = open_snapshot(tmp_path / "s.json")
    assert snap.chunks == inv.chunks and snap.tensors == inv.tensors


# -- loads through the rules ----------------------------------------------------------------------


def _whole(compiled, inventory):
    from remapdsl.sharding.holdings import whole_shard

    return {d.runtime_key: whole_shard(d.shape) for d in compiled.runtime_tensors}


@pytest.mark.distributed
@pytest.mark.parametrize("rules", [IDENTITY, FUSED], ids=["identity", "llama_fused"])
def test_identity_load_across_chunks_equals_the_original(folders, rules):
    """Loaded whole and on meshes other than the writer's (tp=2 on each dim, and tp=4 on dim 0):
    bit for bit the original's load, each rank reading exactly its bytes."""
    root, _ = folders
    original = open_inventory(root / "original")
    want = remapdsl.compile_rules(rules, original)
    expected = want.empty_state_dict()
    run_load_plan(make_load_plan(want, original, _whole(want, original)), original, expected)
    for how in ("dim0", "dim1", "grid"):
        inv = open_inventory(root / how)
        compiled = remapdsl.compile_rules(rules, inv)
        got = compiled.empty_state_dict()
        plan = make_load_plan(compiled, inv, _whole(compiled, inv))
        assert plan.bytes_read == plan.bytes_owned
        run_load_plan(plan, inv, got)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        for world, dim in ((2, 0), (2, 1), (4, 0)):
            for rank in range(world):
                held, local = {}, {}
                for d in compiled.runtime_tensors:
                    if not d.shape:
                        continue
                    on = min(dim, len(d.shape) - 1)
                    held[d.runtime_key] = local_shard(d.shape, (world,), [Shard(dim=on)], (rank,))
                plan = make_load_plan(compiled, inv, held, rank)
                assert plan.bytes_read == plan.bytes_owned, (how, world, dim, rank)
                for key, shard in held.items():
                    local[key] = torch.zeros(shard.shape, dtype=expected[key].dtype)
                run_load_plan(plan, inv, local)
                for key, shard in held.items():
                    box = shard.boxes[0]
                    want_part = expected[key][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
                    assert torch.equal(local[key], want_part), (how, key, world, dim, rank)


@pytest.mark.distributed
def test_a_sharded_load_on_the_writers_group_reads_only_its_bytes(folders):
    """Written sharded on dim 0, loaded on the same 2 ranks sharded on dim 1 (remapdsl.load into
    DTensors), through identity and fusing rules: the original's values, each rank its own bytes."""
    _, results = folders
    for r in results:
        for name in ("identity", "fused"):
            assert r[name]["same"] and r[name]["bytes_read"] == r[name]["bytes_owned"] > 0, (name, r)


# -- saves into the chunked layout ----------------------------------------------------------------


@pytest.mark.distributed
def test_a_save_like_a_chunked_folder_writes_the_same_chunked_files(folders, tmp_path):
    """From 2 ranks holding other shards than the writer's (in `folders`), and from one process
    holding whole tensors: byte for byte the files DCP wrote."""
    root, _ = folders
    original = _tensors(root / "original")
    remapdsl.save(original, tmp_path / "whole", IDENTITY, like=root / "dim1")
    for saved, like in ((root / "saved", root / "dim0"), (tmp_path / "whole", root / "dim1")):
        names = sorted(p.name for p in like.glob("*.safetensors"))
        assert sorted(p.name for p in saved.glob("*.safetensors")) == names
        for name in names:
            assert (saved / name).read_bytes() == (like / name).read_bytes(), (saved, name)


# -- consolidation ---------------------------------------------------------------------------------


def _torch_consolidated(source: Path, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    keys = sorted(open_inventory(source).tensors)
    out.mkdir()
    consolidate_safetensors_files(str(source), str(out), {k: 1 + (i * 2 // len(keys)) for i, k in enumerate(keys)})
    return _tensors(out)


@pytest.mark.distributed
def test_convert_consolidates_as_torch_does(folders, tmp_path, capsys):
    """`remapdsl convert SRC DST --rules identity` on one process, and remapdsl.convert on 2 ranks
    (in `folders`, in batches of 20 kB): torch's consolidation tensor for tensor, in the hub layout."""
    from remapdsl.cli import main

    root, _ = folders
    assert main(["convert", str(root / "dim0"), str(tmp_path / "one"), "--rules", "identity",
                 "--max-shard-size", "40kB"]) == 0
    for source, ours in ((root / "dim0", tmp_path / "one"), (root / "dim1", root / "converted2")):
        theirs = _torch_consolidated(source, tmp_path / f"torch-{source.name}")
        got = _tensors(ours)  # read back by safetensors' own safe_open
        assert sorted(got) == sorted(theirs)
        for k, t in theirs.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        files = sorted(p.name for p in ours.glob("*.safetensors"))
        assert len(files) > 1 and all(n.startswith("model-0000") and "-of-0000" in n for n in files)
        index = json.loads((ours / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(theirs)
        assert open_inventory(ours).chunks == {}


@pytest.mark.distributed
def test_a_chunked_runtime_layout_converts_back(folders, tmp_path):
    """--reverse from a DCP-sharded runtime-layout folder (what a trainer saves): whole tensors
    assembled from their chunks, written in the layout of `like`."""
    root, _ = folders
    remapdsl.convert(root / "dim1", tmp_path / "back", IDENTITY, reverse=True, like=root / "original")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == \
        (root / "original" / "model.safetensors").read_bytes()


# -- what does not tile is refused -----------------------------------------------------------------


def _shard(path: Path, tensors: dict, offsets: dict | str) -> None:
    info = offsets if isinstance(offsets, str) else json.dumps({k: {"saved_offsets": o} for k, o in offsets.items()})
    save_file(tensors, str(path), metadata={INFO: info, "DCP_VERSION": "1.0", "format": "pt"})


def _diagnostics(folder: Path) -> list:
    """What opening `folder` refuses, every diagnostic of it."""
    with pytest.raises(RemapError) as caught:
        open_inventory(folder)
    return caught.value.diagnostics


def _codes(folder: Path) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in _diagnostics(folder)]


@pytest.mark.distributed
def test_a_missing_shard_file_is_a_gap(folders, tmp_path):
    """Rank 0's file gone: each of its tensors starts at row 32. (A missing last file cannot be told
    from smaller tensors: DCP records no whole shape; the rules' shapes catch that.)"""
    root, _ = folders
    shutil.copytree(root / "dim0", tmp_path / "c")
    (tmp_path / "c" / "shard-00001-model-00001-of-00002.safetensors").unlink()
    found = _codes(tmp_path / "c")
    assert found and {c for c, _ in found} == {"E350"}
    message = found[0][1]
    assert "shard-00002-model-00001-of-00002.safetensors" in message and "no chunk holds dim-0 index 0" in message


@pytest.mark.distributed
def test_a_shard_written_twice_overlaps(folders, tmp_path):
    root, _ = folders
    shutil.copytree(root / "dim1", tmp_path / "c")
    shutil.copyfile(tmp_path / "c" / "shard-00001-model-00002-of-00002.safetensors",
                    tmp_path / "c" / "shard-00003-model-00002-of-00002.safetensors")
    found = _codes(tmp_path / "c")
    assert found and {c for c, _ in found} == {"E351"}
    assert "shard-00003-model-00002-of-00002.safetensors" in found[0][1] and "[0:" in found[0][1]


def test_chunks_outside_the_shape_and_of_other_dtypes_and_ranks(tmp_path):
    """A chunk with dims other than its tensor's other chunks (E352), dtypes that disagree (E353),
    and a gap in two dims that no dim-0 slab shows (E350), each naming the key and files."""
    z = torch.zeros
    _shard(tmp_path / "shard-00001-model-00001-of-00001.safetensors",
           {"w": z(2, 4), "v": z(4, dtype=torch.bfloat16), "g": z(2, 2)},
           {"w": [0, 0], "v": [0], "g": [0, 0]})
    _shard(tmp_path / "shard-00002-model-00001-of-00001.safetensors",
           {"w": z(2, 4, 1), "v": z(4), "g": z(2, 2)},
           {"w": [2, 0, 0], "v": [4], "g": [2, 2]})
    found = {d.code: d for d in _diagnostics(tmp_path)}
    assert set(found) == {"E350", "E352", "E353"}
    one, two = "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"
    assert [(d.message, d.hint, d.path) for d in (found["E352"], found["E353"])] == [
        (f"tensor `w`: its chunks have different numbers of dims ({one}: [2, 4], {two}: [2, 4, 1])", None,
         str(tmp_path / one)),
        (f"tensor `v`: its chunks disagree on the dtype ({one}: bfloat16, {two}: float32)",
         "every rank must save the tensor in one dtype", str(tmp_path / one))]
    assert "`g` [4, 4]" in found["E350"].message and "cover 8 of its 16 elements" in found["E350"].message


def test_chunk_errors_show_six_files_then_an_ellipsis_and_a_tensor_starts_at_its_origin_chunk(tmp_path):
    """Seven files, one row of `w` each, the row at the origin in the file named second: the tensor opens
    at that file's bytes (and its inventory reads back from JSON as it was). One row of another dtype (E353) or rank (E352), or a row no file holds (E350):
    each message shows the first six files and then an ellipsis."""
    names = [f"shard-0000{i}-model-00001-of-00001.safetensors" for i in range(1, 8)]
    rows = [6, 0, 1, 2, 3, 4, 5]  # the file named first holds the last row

    def write(folder, change=lambda row: torch.full((1, 2), float(row))):
        folder.mkdir(exist_ok=True)
        for i, (name, row) in enumerate(zip(names, rows)):
            w = change(row)
            _shard(folder / name, {"pad": torch.zeros(3), "w": w}, {"pad": [3 * i], "w": [row] + [0] * (w.dim() - 1)})
        return folder

    inventory = open_inventory(write(tmp_path / "ok"))
    assert Inventory.model_validate_json(inventory.model_dump_json()) == inventory  # its chunks as Chunks
    info = inventory.tensors["w"]
    header = 8 + int.from_bytes((tmp_path / "ok" / names[1]).read_bytes()[:8], "little")
    assert (info.file, info.shape, info.byte_offset) == (names[1], (7, 2), header + 3 * 4)  # after `pad`

    def refused(code, change):
        (d,) = _diagnostics(write(tmp_path / code, change))
        assert d.code == code
        return d.message

    dtypes = ", ".join(f"{name}: {'float16' if row == 5 else 'float32'}" for name, row in zip(names[:6], rows))
    assert refused("E353", lambda row: torch.zeros(1, 2, dtype=torch.float16 if row == 5 else torch.float32)) == \
        f"tensor `w`: its chunks disagree on the dtype ({dtypes})"
    shapes = ", ".join(f"{name}: {[1, 2, 1] if row == 5 else [1, 2]}" for name, row in zip(names[:6], rows))
    assert refused("E352", lambda row: torch.zeros(1, 2, 1) if row == 5 else torch.zeros(1, 2)) == \
        f"tensor `w`: its chunks have different numbers of dims ({shapes})"
    rows[0] = 7  # no file holds row 6
    assert refused("E350", lambda row: torch.zeros(1, 2)) == (
        f"tensor `w` [8, 2]: its chunks in {', '.join(names[:6])} … cover 14 of its 16 elements: a gap "
        "(no chunk holds dim-0 index 6)")


_ONE = "shard-00001-model-00001-of-00001.safetensors"
_REWRITE = "the file was not written whole by torch.distributed.checkpoint's HuggingFaceStorageWriter; write the " \
           "checkpoint again"
_LONG = {"saved_offsets": [0], "note": "x" * 100}  # what is shown of an entry: its first 80 characters


@pytest.mark.parametrize("info, message, hint", [
    ("{not json", '`__metadata__["DCP_SHARDING_INFO"]` is not JSON (Expecting property name enclosed in double '
                  "quotes: line 1 column 2 (char 1))", None),
    ('["w"]', '`__metadata__["DCP_SHARDING_INFO"]` is not a JSON object of tensor key to {"saved_offsets": [...]}',
     None),
    ('{"w": {"saved_offsets": [0]}}', '`DCP_SHARDING_INFO` for tensor `w` [2, 2] must be {"saved_offsets": [2 '
                                      'non-negative ints]}, found {"saved_offsets": [0]}', _REWRITE),
    ('{"w": {"saved_offsets": [0, -1]}}', '`DCP_SHARDING_INFO` for tensor `w` [2, 2] must be {"saved_offsets": [2 '
                                          'non-negative ints]}, found {"saved_offsets": [0, -1]}', _REWRITE),
    (json.dumps({"w": _LONG}), '`DCP_SHARDING_INFO` for tensor `w` [2, 2] must be {"saved_offsets": [2 '
                               f'non-negative ints]}}, found {json.dumps(_LONG)[:80]}', _REWRITE),
    ('{"w": {"saved_offsets": [0, 0]}, "x": {"saved_offsets": [0]}}',
     "`DCP_SHARDING_INFO` names tensor `x`, which the file does not hold", None),
    ('{"w": {"saved_offsets": [0, 0]}, "x": {"saved_offsets": [0]}, "y": {"saved_offsets": [0]}}',
     "`DCP_SHARDING_INFO` names tensor `x` and 1 more, which the file does not hold", None),
    ("{}", '`DCP_SHARDING_INFO` for tensor `w` [2, 2] must be {"saved_offsets": [2 non-negative ints]}, found no entry',
     _REWRITE),
])
def test_malformed_sharding_info(tmp_path, info, message, hint):
    """Each way a file's DCP_SHARDING_INFO can be wrong is E354, naming the file (its message and path)."""
    _shard(tmp_path / _ONE, {"w": torch.zeros(2, 2)}, info)
    assert [(d.code, d.message, d.hint, d.path) for d in _diagnostics(tmp_path)] == [
        ("E354", f"{_ONE}: {message}", hint, str(tmp_path / _ONE))]


def test_every_problem_of_a_folder_is_reported_at_once_and_only_once(tmp_path):
    """Two files whose sharding info is not JSON, a bad entry for a key another file holds well (E354 only:
    no gap reported for it), a key held whole by one file at the origin and a chunked one beside it (no
    problem), and a key in three files of which one is not DCP-sharded (E324 at the last of them)."""
    z, names = torch.zeros, [f"shard-0000{i}-model-00001-of-00001.safetensors" for i in range(1, 5)]
    _shard(tmp_path / names[0], {"a": z(2)}, "{not json")
    _shard(tmp_path / names[1], {"b": z(2)}, "{not json")
    _shard(tmp_path / names[2], {"e": z(2, 2), "h": z(3), "m": z(1, 2), "p": z(2)},
           {"e": [0], "h": [0], "m": [0, 0], "p": [0]})
    _shard(tmp_path / names[3], {"e": z(2, 2), "m": z(1, 2), "p": z(2)}, {"e": [2, 0], "m": [1, 0], "p": [2]})
    save_file({"p": z(4)}, str(tmp_path / "model.safetensors"))
    not_json = '`__metadata__["DCP_SHARDING_INFO"]` is not JSON (Expecting property name enclosed in double quotes: ' \
               "line 1 column 2 (char 1))"
    assert [(d.code, d.message, d.path) for d in _diagnostics(tmp_path)] == [
        ("E354", f"{names[0]}: {not_json}", str(tmp_path / names[0])),
        ("E354", f"{names[1]}: {not_json}", str(tmp_path / names[1])),
        ("E354", (f'{names[2]}: `DCP_SHARDING_INFO` for tensor `e` [2, 2] must be {{"saved_offsets": [2 non-negative '
                  'ints]}, found {"saved_offsets": [0]}'), str(tmp_path / names[2])),
        ("E324", f"tensor `p` is in 3 files: model.safetensors, {names[2]}, {names[3]}, not all of them DCP-sharded",
         str(tmp_path / names[3]))]


def test_a_zero_dim_tensor_saved_by_two_ranks_overlaps_and_by_one_opens(tmp_path):
    """A 0-dim tensor is one element: in two files it is E351 naming both, in one it opens; a tensor of no
    elements in two files opens (it once raised an IndexError) and loads; the inventory of a chunked folder
    pickles and reads back as it was."""
    names = [f"shard-0000{i}-model-00001-of-00001.safetensors" for i in (1, 2)]
    (tmp_path / "two").mkdir()
    for name, row in zip(names, (0, 1)):
        _shard(tmp_path / "two" / name, {"s": torch.tensor(2.0), "w": torch.ones(1, 2)}, {"s": [], "w": [row, 0]})
    (d,) = _diagnostics(tmp_path / "two")
    assert (d.code, d.message) == ("E351", f"tensor `s`: chunks overlap: [] in {names[0]} and [] in {names[1]}")
    (tmp_path / "one").mkdir()
    _shard(tmp_path / "one" / names[0], {"s": torch.tensor(2.0), "w": torch.ones(1, 2)}, {"s": [], "w": [0, 0]})
    _shard(tmp_path / "one" / names[1], {"w": torch.ones(1, 2), "z": torch.zeros(0, 2)}, {"w": [1, 0], "z": [0, 0]})
    _shard(tmp_path / "one" / names[0].replace("1-model", "3-model"), {"z": torch.zeros(0, 2)}, {"z": [0, 0]})
    inventory = open_inventory(tmp_path / "one")
    assert (inventory.tensors["s"].shape, inventory.tensors["z"].shape, set(inventory.chunks)) == ((), (0, 2), {"w"})
    again = pickle.loads(pickle.dumps(inventory))
    assert again == inventory and again.chunks["w"].grid == inventory.chunks["w"].grid
    state = {"s": torch.zeros(()), "w": torch.zeros(2, 2), "z": torch.zeros(0, 2)}
    remapdsl.load(state, tmp_path / "one", rules_from_text("remap 1\n{P:path} -> {P}\n"), config={})
    assert (state["s"].item(), state["w"].sum().item(), state["z"].shape) == (2.0, 4.0, (0, 2))


def test_a_key_both_chunked_and_whole_is_in_two_files(tmp_path):
    _shard(tmp_path / _ONE, {"w": torch.zeros(2, 2)}, {"w": [2, 0]})
    save_file({"w": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    assert [(d.code, d.message, d.path) for d in _diagnostics(tmp_path)] == [
        ("E324", f"tensor `w` is in 2 files: model.safetensors, {_ONE}, not all of them DCP-sharded",
         str(tmp_path / _ONE))]


def test_whole_tensors_beside_chunked_ones_open_as_plain_tensors(tmp_path):
    """A folder with whole tensors in a file of their own beside DCP-sharded ones (each key in one kind of
    file): the whole ones are plain tensors of their file, the sharded ones chunked, and both load."""
    a, b = torch.arange(8.0).reshape(4, 2), torch.arange(6.0)
    _shard(tmp_path / _ONE, {"w": a[:2]}, {"w": [0, 0]})
    _shard(tmp_path / "shard-00002-model-00001-of-00001.safetensors", {"w": a[2:]}, {"w": [2, 0]})
    save_file({"b": b, "c": b[:2].clone()}, str(tmp_path / "model.safetensors"))
    inventory = open_inventory(tmp_path)
    assert sorted(inventory.chunks) == ["w"]
    assert [(k, inventory.tensors[k].file, inventory.tensors[k].shape) for k in ("b", "c", "w")] == [
        ("b", "model.safetensors", (6,)), ("c", "model.safetensors", (2,)), ("w", _ONE, (4, 2))]
    state = {"w": torch.empty(4, 2), "b": torch.empty(6), "c": torch.empty(2)}
    remapdsl.load(state, tmp_path, remapdsl.language.rules_from_text("remap 1\n{w,b,c} -> {w,b,c}\n"), config={})
    assert torch.equal(state["w"], a) and torch.equal(state["b"], b) and torch.equal(state["c"], b[:2])


def test_quantized_parts_in_chunks_are_refused(tmp_path):
    """A dequantize over a chunked part: refused, saying to consolidate first (E356)."""
    from remapdsl.sharding.holdings import whole_shard

    _shard(tmp_path / "shard-00001-model-00001-of-00001.safetensors",
           {"w": torch.zeros(128, 128, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.ones(2, 1)},
           {"w": [0, 0], "w_scale_inv": [0, 0]})
    _shard(tmp_path / "shard-00002-model-00001-of-00001.safetensors",
           {"w": torch.zeros(128, 128, dtype=torch.float8_e4m3fn)}, {"w": [128, 0]})
    (tmp_path / "r.remap").write_text("remap 1\n\ndequantize w, w_scale_inv -> w | fp8_block(block=[128, 128], to=bfloat16)\nw -> w\n")
    inv = open_inventory(tmp_path)
    assert set(inv.chunks) == {"w"}
    compiled = remapdsl.compile_rules(tmp_path / "r.remap", inv, config={})
    with pytest.raises(RemapError) as caught:
        make_load_plan(compiled, inv, {d.runtime_key: whole_shard(d.shape) for d in compiled.runtime_tensors})
    assert caught.value.diagnostics[0].code == "E356" and "consolidate" in caught.value.diagnostics[0].hint


def test_pieces_split_per_chunk_map_every_element_to_its_chunk():
    """Random affine pieces (transposed, strided, reversed, a source dim moved by two runtime dims,
    a constant source dim) over random chunk grids: every element read once, from the chunk that
    holds it, at its place there; as few parts as the crossings need."""
    import itertools
    import random

    from remapdsl.checkpoint.chunks import Chunk
    from remapdsl.indexmap import Block
    from remapdsl.sharding.chunked import split_by_chunks

    rng = random.Random(7)
    maps = [((1, 0), (0, 1)), ((0, 1), (1, 0)), ((2, 0), (0, 1)), ((-1, 0), (0, 3)), ((4, 1), (0, 0)),
            ((0, 0), (1, -2)), ((3, -1), (0, 1)), ((-3, -1), (0, 0)), ((1, 0), (-1, 2))]
    for _ in range(400):
        shape = (rng.randint(4, 24), rng.randint(4, 24))
        cuts = [sorted({0, shape[k], *rng.sample(range(1, shape[k]), rng.randint(0, 3))}) for k in (0, 1)]
        chunks = tuple(Chunk(f"f{a}{b}", 0, (cuts[0][a], cuts[1][b]),
                             (cuts[0][a + 1] - cuts[0][a], cuts[1][b + 1] - cuts[1][b]))
                       for a in range(len(cuts[0]) - 1) for b in range(len(cuts[1]) - 1))
        coeff = rng.choice(maps)
        sizes = [rng.randint(1, 9), rng.randint(1, 9)]
        low = [0, 0]
        for k in (0, 1):  # a base that keeps every element inside the shape
            span_lo = sum(min(0, c * (n - 1)) for c, n in zip(coeff[k], sizes))
            span_hi = sum(max(0, c * (n - 1)) for c, n in zip(coeff[k], sizes))
            if span_hi - span_lo >= shape[k]:
                break
            low[k] = rng.randint(-span_lo, shape[k] - 1 - span_hi)
        else:
            piece = Block((3, 5), tuple(sizes), "w", tuple(low), coeff)
            seen = {}
            parts = split_by_chunks(piece, chunks)
            for part, chunk in parts:
                for x in itertools.product(*(range(o, o + n) for o, n in zip(part.offsets, part.sizes))):
                    inside = tuple(b + sum(c * (xi - o) for c, xi, o in zip(row, x, part.offsets))
                                   for b, row in zip(part.base, part.coeff))
                    assert all(0 <= i < n for i, n in zip(inside, chunk.sizes))
                    assert x not in seen
                    seen[x] = tuple(i + o for i, o in zip(inside, chunk.offsets))
            for x in itertools.product(*(range(o, o + n) for o, n in zip(piece.offsets, piece.sizes))):
                want = tuple(b + sum(c * (xi - o) for c, xi, o in zip(row, x, piece.offsets))
                             for b, row in zip(piece.base, piece.coeff))
                assert seen.pop(x) == want
            assert not seen
            assert len(parts) == _fewest_parts(piece, cuts), (piece, cuts)


def _fewest_parts(piece, cuts) -> int:
    """The parts a piece over the grid `cuts` needs, counted element by element: where its source crosses a
    grid line along source dim k, its rows along the runtime dim moving k most are grouped, a run of rows
    inside one cell of k apart from each row that straddles a line, and each group counted the same way."""
    import itertools
    from bisect import bisect_right

    def cells(p, k):  # the grid cells along source dim k that the elements of p = (sizes, base, coeff) lie in
        return {bisect_right(cuts[k], p[1][k] + sum(c * xi for c, xi in zip(p[2][k], x))) - 1
                for x in itertools.product(*(range(n) for n in p[0]))}

    def count(sizes, base, coeff):
        crossing = [k for k in range(len(base)) if len(cells((sizes, base, coeff), k)) > 1]
        if not crossing:
            return 1
        k = crossing[0]
        j = max((m for m, n in enumerate(sizes) if coeff[k][m] and n > 1), key=lambda m: abs(coeff[k][m]))
        groups = []  # (first row, rows, the one cell of k its rows lie in, or None for a straddling row)
        for t in range(sizes[j]):
            one = (tuple(1 if m == j else n for m, n in enumerate(sizes)),
                   tuple(b + row[j] * t for b, row in zip(base, coeff)), coeff)
            cell = next(iter(cells(one, k))) if len(cells(one, k)) == 1 else None
            if cell is not None and groups and groups[-1][2] == cell:
                groups[-1][1] += 1
            else:
                groups.append([t, 1, cell])
        return sum(count(tuple(rows if m == j else n for m, n in enumerate(sizes)),
                         tuple(b + row[j] * t for b, row in zip(base, coeff)), coeff) for t, rows, _ in groups)

    return count(piece.sizes, piece.base, piece.coeff)
