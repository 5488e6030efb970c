"""Saving from real gloo process groups (2 and 4 ranks): every rank writes only the bytes it is the
lowest holder of, straight into the output files, and syncs them itself; the result is
byte-identical to the checkpoint the shards were loaded from, for TP, EP, FSDP and FSDP x TP
layouts, as plain tensors with a layout and as DTensors. A rank that fails mid-save fails every
rank and leaves nothing behind. Each world size is one spawn, whose results both tests read."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import BACKENDS, CHECK_FAILURES, distributed_like, each_backend

import remapdsl
from remapdsl.sharding import LayoutPlan, Mesh, Replicate, Shard, layout_for, local_shard
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "examples" / "tiny-qwen3-moe"
RULES = str(ROOT / "rules" / "qwen3_moe.remap")
CASES = {  # the layouts of tests/test_distributed.py
    2: ["tp", "ep", "fsdp"],
    4: ["tp", "fsdp_tp"],
}


def _layout(name: str, world: int):
    from test_distributed import CASES as LOAD_CASES

    for case, dims, plan_map, mesh_dim in LOAD_CASES[world]:
        if case == name:
            return Mesh.of(dims), LayoutPlan.from_mapping(plan_map, mesh_dim=mesh_dim)
    raise KeyError(name)


def _on_ranks(rank: int, world: int, out: str, hf_folders: dict) -> dict:
    """Both tests' saves on one group of `world` ranks: the transformers checkpoints (plain gloo),
    then every case of the bundled checkpoint under each default group in turn (plain gloo, then
    `cuda:gloo`: NCCL's device contract), each writing into a folder of its own; the failures."""
    hf = _hf_cases(rank, world, hf_folders, out)

    def bundled(backend: str) -> list[str]:
        folder = Path(out, _folder(backend))
        folder.mkdir(exist_ok=True)
        return _cases(rank, world, folder)

    return {"hf": hf, "bundled": each_backend(rank, world, out, bundled)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(world) -> (each rank's failures, folder, transformers checkpoints)`: the one spawn of
    `world` ranks that makes this file's saves (on first use), the folder they went to, and the
    checkpoints (name -> folder, rules) the transformers saves start from, built once."""
    runs: dict[int, tuple[list[dict], Path, dict]] = {}
    hf_folders: dict[str, tuple[str, str]] = {}

    def run(world: int) -> tuple[list[dict], Path, dict]:
        if world not in runs:
            if not hf_folders:
                hf_folders.update(_hf_checkpoints(tmp_path_factory.mktemp("hf")))
            out = tmp_path_factory.mktemp(f"saves{world}")
            runs[world] = run_ranks(_on_ranks, world, str(out), hf_folders, timeout=240), out, hf_folders
        return runs[world]

    return run


def _folder(backend: str) -> str:
    return backend.replace(":", "-")


def _cases(rank: int, world: int, out: Path) -> list[str]:
    failures: list[str] = []
    inventory = remapdsl.open_checkpoint(CHECKPOINT)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), inventory)
    full = compiled.empty_state_dict()
    remapdsl.load(full, str(CHECKPOINT), RULES)
    for name in CASES[world]:
        mesh, plan = _layout(name, world)
        try:
            local = {}
            for key, tensor in full.items():
                shard = local_shard(tensor.shape, mesh.sizes, layout_for(key, tensor.shape, plan, mesh),
                                    mesh.coordinate(rank))
                local[key] = torch.full(shard.shape, float("nan"), dtype=tensor.dtype)
            remapdsl.load(local, str(CHECKPOINT), RULES, layout=plan, mesh=mesh)
            synced: list[str] = []
            with _fsyncs_counted(synced):
                report = remapdsl.save(local, Path(out) / f"{name}-plain", RULES, like=str(CHECKPOINT),
                                       layout=plan, mesh=mesh)
            Path(out, f"{name}-plain-rank{rank}.bytes").write_text(str(report.bytes_written))
            Path(out, f"{name}-plain-rank{rank}.synced").write_text(json.dumps([report.files, synced]))
            targets, _ = distributed_like(full, mesh, plan)
            remapdsl.load(targets, str(CHECKPOINT), RULES)
            remapdsl.save(targets, Path(out) / f"{name}-dtensor", RULES, like=str(CHECKPOINT))
        except CHECK_FAILURES:  # reported by the parent
            failures.append(f"{name}: {traceback.format_exc()}")
    try:
        _failing_rank_fails_everyone(rank, full, Path(out))
    except CHECK_FAILURES:
        failures.append(f"failing rank: {traceback.format_exc()}")
    return failures


@contextlib.contextmanager
def _fsyncs_counted(synced: list[str]):
    """Record the name of every file this process syncs (os.fsync) meanwhile."""
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    os.fsync = counting
    try:
        yield
    finally:
        os.fsync = real


def _failing_rank_fails_everyone(rank: int, full, out: Path) -> None:
    from remapdsl.checkpoint import writer

    real = writer.FileWriter.write_at

    def failing(self, file, offset, data):
        if rank == 1:
            raise OSError(5, "Input/output error")
        return real(self, file, offset, data)

    writer.FileWriter.write_at = failing
    mesh, plan = Mesh.of({"dp": dist.get_world_size()}), LayoutPlan.from_mapping({"*": [Shard(dim=0)]}, mesh_dim="dp")
    local = {}
    for key, tensor in full.items():
        (box,) = local_shard(tensor.shape, mesh.sizes, layout_for(key, tensor.shape, plan, mesh),
                             mesh.coordinate(rank)).boxes
        local[key] = tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].clone()
    try:
        with pytest.raises(remapdsl.RemapError) as info:
            remapdsl.save(local, out / "failed", RULES, like=str(CHECKPOINT), layout=plan, mesh=mesh)
    finally:
        writer.FileWriter.write_at = real
    assert "rank 1" in str(info.value) and "Input/output error" in str(info.value), str(info.value)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_saves_reproduce_the_checkpoint(world, saved):
    results, out, _ = saved(world)
    failures = [f for r in results for f in r["bundled"]]
    assert not failures, "\n\n".join(failures)
    for backend in BACKENDS:
        _saved_whole(out / _folder(backend), world)


def _saved_whole(folder: Path, world: int) -> None:
    """What the ranks saved under one default group: the checkpoint, byte for byte, every byte
    written once and synced by the rank that wrote it; nothing of the failed save left."""
    total = sum(t.nbytes for t in remapdsl.open_checkpoint(CHECKPOINT).tensors.values())
    for name in CASES[world]:
        for kind in ("plain", "dtensor"):
            out = folder / f"{name}-{kind}"
            for file in ("model.safetensors", "config.json"):
                assert filecmp.cmp(CHECKPOINT / file, out / file, shallow=False), (name, kind, file)
        written = sum(int(Path(folder, f"{name}-plain-rank{r}.bytes").read_text()) for r in range(world))
        assert written == total, (name, written, total)  # every byte written once, by one rank
        for r in range(world):  # durable on every rank, not only where the commit runs (other hosts)
            files, synced = json.loads(Path(folder, f"{name}-plain-rank{r}.synced").read_text())
            assert files and set(files) <= set(synced), (name, r, files, synced)  # every rank writes here
    assert not (folder / "failed").exists()
    assert not [p for p in folder.iterdir() if ".remapdsl-" in p.name]


# -- the shipped rule files on transformers-saved checkpoints ------------------------------------------

HF_CASES = ("llama", "mixtral", "deepseek_v3")
# Every 2-D and 3-D weight sharded on its dim 1 (TP-like: columns), 1-D tensors replicated; rows over
# the ranks (FSDP); and both on a 2x2 mesh. Norms, biases and routers' score biases are 1-D.
HF_LAYOUTS = {
    2: [("tp", {"tp": 2}, {"*norm.weight": "replicate", "*bias": "replicate", "*": [Shard(dim=1)]}, "tp"),
        ("fsdp", {"dp": 2}, {"*": [Shard(dim=0)]}, "dp")],
    4: [("fsdp_tp", {"dp": 2, "tp": 2},
         {"*norm.weight": [Shard(dim=0), Replicate()], "*bias": [Shard(dim=0), Replicate()],
          "*": [Shard(dim=0), Shard(dim=1)]}, "tp")],
}


def _hf_checkpoints(root: Path) -> dict[str, tuple[str, str]]:
    """Llama (tied), Mixtral and DeepSeek-V3 as transformers' `save_pretrained` writes them, with
    their shipped rule files (none without transformers)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return {}
    from hf_models import CASES as HF_MODELS
    from hf_models import build

    folders = {}
    for name in HF_CASES:
        built = build(HF_MODELS[name if name != "llama" else "llama_tied"], root / f"hf-{name}")
        folders[name] = (str(built.folder), str(ROOT / built.case.rules))
    return folders


def _hf_cases(rank: int, world: int, folders: dict, out: str) -> list[str]:
    failures: list[str] = []
    for name, (folder, rules) in folders.items():
        inventory = remapdsl.open_checkpoint(folder)
        compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), inventory)
        for case, dims, plan_map, mesh_dim in HF_LAYOUTS[world]:
            try:
                mesh, plan = Mesh.of(dims), LayoutPlan.from_mapping(plan_map, mesh_dim=mesh_dim)
                local = {}
                for d in compiled.runtime_tensors:
                    shard = local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, plan, mesh),
                                        mesh.coordinate(rank))
                    local[d.runtime_key] = torch.full(shard.shape, float("nan"), dtype=getattr(torch, d.dtype))
                remapdsl.load(local, folder, rules, layout=plan, mesh=mesh)
                remapdsl.save(local, Path(out) / f"{name}-{case}", rules, like=folder, layout=plan, mesh=mesh)
            except CHECK_FAILURES:  # reported by the parent
                failures.append(f"{name} {case}: {traceback.format_exc()}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_checkpoints_round_trip_on_every_mesh(world, saved):
    """Llama (tied), Mixtral and DeepSeek-V3 saved by transformers' `save_pretrained`, loaded in
    shards through the shipped rule files and saved back from the shards: the files transformers
    wrote, byte for byte, under every layout."""
    pytest.importorskip("transformers")
    results, out, folders = saved(world)
    failures = [f for r in results for f in r["hf"]]
    assert not failures, "\n\n".join(failures)
    for name, (folder, _) in folders.items():
        for case, *_ in HF_LAYOUTS[world]:
            for file in Path(folder).iterdir():
                if file.suffix in (".safetensors", ".json"):
                    assert filecmp.cmp(file, out / f"{name}-{case}" / file.name, shallow=False), (name, case, file.name)
