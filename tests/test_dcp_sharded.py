"""DCP-sharded safetensors (torch's HuggingFaceStorageWriter with save_distributed=True) read as one
checkpoint: chunks that tile each tensor, plans that split pieces per chunk, consolidation by
`remapdsl convert` with identity rules against torch's own consolidation.

One group of 2 gloo ranks writes every folder with the real writer (DTensors sharded on dim 0, on
dim 1, and one tensor on both dims of a 2-D mesh of 2x1 with its second dim split by hand as a
second save), then loads, saves and converts on those same ranks; the rest runs in this process.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl.checkpoint import open_inventory
from remapdsl.checkpoint.snapshot import open_snapshot, write_snapshot
from remapdsl.errors import RemapError
from remapdsl.runtime.read import run_load_plan
from remapdsl.sharding import Shard, local_shard
from remapdsl.sharding.plans import make_load_plan
from remapdsl.testing.ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent
IDENTITY = REPO / "rules" / "identity.remap"
FUSED = REPO / "rules" / "llama_fused.remap"
INFO = "DCP_SHARDING_INFO"


def _placement(key: str, shape, how: str):
    from torch.distributed.tensor import Replicate, Shard as TorchShard

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
    # A sharded load on a mesh other than the writer's: dim0's tensors read sharded on dim 1.
    target = {k: distribute_tensor(torch.zeros_like(t), mesh, [TorchShard(1 if t.dim() == 2 else 0)])
              for k, t in full.items()}
    report = remapdsl.load(target, f"{out}/dim0", IDENTITY)
    same = all(torch.equal(target[k].to_local(), distribute_tensor(full[k], mesh, target[k].placements).to_local())
               for k in full)
    # The same DTensors saved back into dim0's chunked layout (like=), and a 2-rank consolidation.
    remapdsl.save(target, f"{out}/saved", IDENTITY, like=f"{out}/dim0")
    remapdsl.convert(f"{out}/dim1", f"{out}/converted2", IDENTITY, max_shard_bytes=40_000, budget_bytes=20_000)
    return {"same": same, "bytes_read": report.bytes_read, "bytes_owned": report.bytes_owned}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hf_models import CASES, build

    root = tmp_path_factory.mktemp("dcp")
    build(CASES["llama"], root / "original")
    results = run_ranks(_write_rank, 2, str(root / "original"), str(root), timeout=120)
    for how in ("dim0", "dim1"):  # what a trainer keeps next to its weights
        shutil.copyfile(root / "original" / "config.json", root / how / "config.json")
    return root, results


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no iteration
    return out


# -- the inventory -------------------------------------------------------------------------------


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


@pytest.mark.parametrize("rules", [IDENTITY, FUSED], ids=["identity", "llama_fused"])
def test_identity_load_across_chunks_equals_the_original(folders, rules):
    """Loaded whole and on meshes other than the writer's (tp=2 on each dim, and tp=4 on dim 0):
    bit for bit the original's load, each rank reading exactly its bytes."""
    root, _ = folders
    original = open_inventory(root / "original")
    want = remapdsl.compile_rules(rules, original)
    expected = want.empty_state_dict()
    run_load_plan(make_load_plan(want, original, _whole(want, original)), original, expected)
    for how in ("dim0", "dim1"):
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
