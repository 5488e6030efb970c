"""Meshes that do not fit the job, operating-system errors and files changed under a load, on a real
gloo group (2 processes, CPU): each ends in one clear RemapError on every rank.

Faults are injected at remapdsl's own I/O boundary (the reader's positioned reads, the writer's
positioned writes) in one rank's process, or by editing one rank's own copy of the checkpoint
between reading the headers and reading the data. Each rank returns what it raised per case; the
parent compares the ranks. The single-process tests at the end pin the recorded file times.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import pickle
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import CHECK_FAILURES, record_cases, run_with_bound

import remapdsl
from remapdsl.checkpoint import CheckpointReader, Inventory, open_inventory
from remapdsl.sharding import LayoutPlan, Mesh, layout_for, local_shard
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "examples" / "tiny-qwen3-moe"
RULES = str(ROOT / "rules" / "qwen3_moe.remap")
WORLD = 2
TP = LayoutPlan.from_mapping({"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": "rowwise"}, mesh_dim="tp")
FIRST_KEY = "model.embed_tokens.weight"


def _state() -> dict[str, torch.Tensor]:
    return remapdsl.compile_rules(remapdsl.load_rules(RULES), str(CHECKPOINT)).empty_state_dict()


def _local(mesh: Mesh, rank: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(local_shard(t.shape, mesh.sizes, layout_for(k, t.shape, TP, mesh),
                                       mesh.coordinate(rank)).shape, dtype=t.dtype) for k, t in _state().items()}


class _Patched:
    """`module.name` replaced by `value` while inside (on this rank only)."""

    def __init__(self, module, name: str, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.old = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.old)


def _raising(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def _own_copy(tmp: Path, name: str, keep_times: bool) -> str:
    """This rank's own copy of the checkpoint (as a node of a multi-node job holds one), under the
    same folder name; with `keep_times` False its files get new modification times."""
    target = tmp / name / CHECKPOINT.name
    shutil.copytree(CHECKPOINT, target, copy_function=shutil.copy2 if keep_times else shutil.copy)
    return str(target)


def _edit_before_reading(rank: int, edit):
    """`make_load_plan` (run after the headers were read and compiled, before any data read) wrapped
    to `edit()` this rank's copy first."""
    import remapdsl.drivers.load as load_module

    original = load_module.make_load_plan

    def make(*args, **kwargs):
        edit()
        return original(*args, **kwargs)

    return _Patched(load_module, "make_load_plan", make)


def _rewrite_in_place(path: str) -> None:
    """Same size, other bytes: the data section reversed, written over the file."""
    data = bytearray(Path(path).read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = data[start:][::-1]
    with open(path, "r+b") as f:
        f.write(data)


def _swap_in_header(path: str, a: bytes, b: bytes) -> None:
    """Same name, same size, other header: the names `a` and `b` (of two tensors of one shape and
    dtype, names of one length) swapped in the header JSON, so each name points at the other's bytes."""
    data = bytearray(Path(path).read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    header = bytes(data[8:start])
    assert header.count(a) == header.count(b) == 1 and len(a) == len(b)
    data[8:start] = header.replace(a, b"\0" * len(a)).replace(b, a).replace(b"\0" * len(a), b)
    Path(path).write_bytes(data)


def _cases(rank: int, tmp: Path) -> dict:
    import remapdsl.checkpoint.reader as reader_module
    import remapdsl.checkpoint.writer as writer_module

    four, two = Mesh.of({"tp": 4}), Mesh.of({"tp": 2})
    other = Mesh.of({"dp": 1, "tp": 2}) if rank == 1 else two
    own = {name: _own_copy(tmp, name, keep_times) for name, keep_times in
           (("rewritten", True), ("truncated", True), ("other_times", False), ("swapped", True))}
    if rank == 1:  # a stale copy: two q_proj of one shape swapped in its header, before the call
        _swap_in_header(os.path.join(own["swapped"], "model.safetensors"), b"layers.0.self_attn.q_proj",
                        b"layers.1.self_attn.q_proj")

    def patched_on(which: int, *patches):
        class Both:
            def __enter__(self):
                for p in patches if rank == which else ():
                    p.__enter__()

            def __exit__(self, *exc):
                for p in patches if rank == which else ():
                    p.__exit__(*exc)
        return Both()

    def eio_on_read():
        with patched_on(1, _Patched(reader_module, "_preadv_many", _raising(errno.EIO))):
            remapdsl.load(_state(), str(CHECKPOINT), RULES)

    def full_disk_on_save(folder, overwrite=False):
        with patched_on(1, _Patched(writer_module, "_write_all", _raising(errno.ENOSPC))):
            remapdsl.save(_local(two, rank), folder, RULES, like=str(CHECKPOINT), layout=TP, mesh=two,
                          overwrite=overwrite)

    def eio_creating_files():
        with patched_on(0, _Patched(writer_module, "_write_all", _raising(errno.EIO))):
            remapdsl.save(_local(two, rank), tmp.parent / "created", RULES, like=str(CHECKPOINT), layout=TP,
                          mesh=two)

    previous = tmp.parent / "previous"

    def rewritten():
        path = os.path.join(own["rewritten"], "model.safetensors")
        with _edit_before_reading(rank, lambda: _rewrite_in_place(path) if rank == 1 else None):
            remapdsl.load(_state(), own["rewritten"], RULES)

    def truncated():
        path = os.path.join(own["truncated"], "model.safetensors")
        with _edit_before_reading(rank, lambda: os.truncate(path, os.path.getsize(path) - 8) if rank == 0 else None):
            remapdsl.load(_state(), own["truncated"], RULES)

    return {
        "mesh_larger_than_the_job_on_load": lambda: remapdsl.load(_local(four, rank), str(CHECKPOINT), RULES,
                                                                  layout=TP, mesh=four),
        "mesh_larger_than_the_job_on_save": lambda: remapdsl.save(_local(four, rank), tmp.parent / "four", RULES,
                                                                  like=str(CHECKPOINT), layout=TP, mesh=four),
        "meshes_differ": lambda: remapdsl.load(_local(other, rank), str(CHECKPOINT), RULES, layout=TP, mesh=other),
        "eio_on_one_ranks_read": eio_on_read,
        "disk_full_on_one_ranks_write": lambda: full_disk_on_save(tmp.parent / "full"),
        "disk_full_overwriting_a_checkpoint": lambda: full_disk_on_save(previous, overwrite=True),
        "eio_creating_the_files": eio_creating_files,
        "file_rewritten_on_rank_1_before_the_data_reads": rewritten,
        "file_truncated_on_rank_0_before_the_data_reads": truncated,
        "header_of_one_ranks_copy_differs": lambda: remapdsl.load(_state(), own["swapped"], RULES),
        "copies_with_other_times_load": lambda: remapdsl.load(_state(), own["other_times"], RULES),
        "the_group_still_works": lambda: remapdsl.load(_local(two, rank), str(CHECKPOINT), RULES, layout=TP,
                                                       mesh=two),
    }


@pytest.mark.distributed
def test_os_faults_and_meshes_raise_one_clear_error_on_every_rank(tmp_path):
    shutil.copytree(CHECKPOINT, tmp_path / "previous")  # the checkpoint a failed overwrite must leave alone
    before = {p.name: p.read_bytes() for p in (tmp_path / "previous").iterdir()}
    seen = run_ranks(record_cases, WORLD, str(tmp_path), _cases)
    for name, s in seen[0].items():
        print(f"--- {name}\n{s and s['text']}")
    size = (CHECKPOINT / "model.safetensors").stat().st_size
    for name in seen[0]:
        first = seen[0][name]
        assert len({json.dumps(s[name]) for s in seen}) == 1, (name, [s[name] for s in seen])
        if name in ("copies_with_other_times_load", "the_group_still_works"):
            assert first is None, (name, first)
            continue
        assert first is not None and first["type"] != "escaped", (name, first)
        text = first["text"]
        if name.startswith("mesh_larger"):
            assert first["codes"] == ["E414"] and first["failed_ranks"] == [0, 1], first
            assert "the mesh `tp=4` has 4 ranks; this job has 2" in text and "(on rank" not in text, text
        elif name == "meshes_differ":
            assert first["codes"] == ["E410"], first
            assert "rank 0 vs rank 1: mesh `tp=2` vs `dp=1, tp=2`" in text, text
            # the first tensor that differs, with both placements
            assert "rank 0 vs rank 1: tensor `lm_head.weight`: `mesh [2] Replicate()` vs " \
                   "`mesh [1, 2] Replicate(), Replicate()`" in text, text
        elif name == "eio_on_one_ranks_read":
            assert first["type"] == "CheckpointError" and first["codes"] == ["E343"], first
            assert first["failed_ranks"] == [1] and "(on rank 1)" in text, text
            assert "model.safetensors: reading bytes [" in text and ") of tensor" in text, text  # or tensors
            assert "failed: EIO (Input/output error)" in text, text
        elif name.startswith("disk_full"):
            assert first["codes"] == ["E511"] and first["failed_ranks"] == [1] and "(on rank 1)" in text, first
            assert "no space left on the device while writing bytes [" in text, text
            assert "of output file model.safetensors in ." in text and "ENOSPC" in text, text
            assert "B still to write on this rank" in text and f"B free in {tmp_path}" in text, text
        elif name == "eio_creating_the_files":
            assert first["codes"] == ["E512"] and first["failed_ranks"] == [0], first
            assert f"creating output file model.safetensors ({size} B) in ." in text, text
            assert "failed: EIO (Input/output error)" in text, text
        elif name == "file_rewritten_on_rank_1_before_the_data_reads":
            assert first["codes"] == ["E342"] and first["failed_ranks"] == [1] and "(on rank 1)" in text, first
            assert "model.safetensors: file was modified after its header was read" in text, text
        elif name == "file_truncated_on_rank_0_before_the_data_reads":
            assert first["codes"] == ["E342"] and first["failed_ranks"] == [0] and "(on rank 0)" in text, first
            assert f"model.safetensors: file has {size - 8} bytes, its header said {size}" in text, text
        elif name == "header_of_one_ranks_copy_differs":
            # refused in the compile exchange, before any data read: the file and both ranks named
            assert first["codes"] == ["E410"] and first["failed_ranks"] == [], first
            assert "ranks disagree on the compiled rules and checkpoint:\nfile headers: rank 0 has " in text, text
            assert "rank 0 vs rank 1: file `model.safetensors`: header bytes sha256 " in text, text
            assert "\ncheckpoint:" not in text, text  # same names and sizes: only the headers differ
    # no failed save left a folder, staged or final; the overwritten checkpoint is as it was
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["previous", "rank0", "rank1"], left
    assert {p.name: p.read_bytes() for p in (tmp_path / "previous").iterdir()} == before


def test_an_inventory_records_each_files_size_and_time(tmp_path):
    shutil.copytree(CHECKPOINT, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    inventory = open_inventory(tmp_path / "ckpt")
    info = inventory.files["model.safetensors"]
    assert info.mtime_ns == path.stat().st_mtime_ns and info.nbytes == path.stat().st_size
    assert pickle.loads(pickle.dumps(inventory)).files == inventory.files  # travels with the columns
    assert pickle.loads(pickle.dumps(inventory)).files["model.safetensors"].mtime_ns == info.mtime_ns
    # synthetic inventories have no file behind them: no time, and nothing to check
    assert Inventory.from_shapes({"w": ("float32", (2, 2))}).files["model.safetensors"].mtime_ns is None
    with CheckpointReader(inventory) as reader:
        assert len(reader.read_tensor(FIRST_KEY)) == inventory.tensors[FIRST_KEY].nbytes
    os.utime(path, ns=(info.mtime_ns, info.mtime_ns + 1_000_000))  # touched: the same bytes, another time
    with CheckpointReader(inventory) as reader, pytest.raises(remapdsl.RemapError) as caught:
        reader.read_tensor(FIRST_KEY)
    assert caught.value.diagnostics[0].code == "E342"
    assert "model.safetensors: file was modified after its header was read" in str(caught.value)
    restamped = inventory.restamped()  # a rank's own view of its own copy
    assert restamped.files["model.safetensors"].mtime_ns == info.mtime_ns + 1_000_000
    assert restamped == inventory  # the same layout
    with CheckpointReader(restamped) as reader:
        assert len(reader.read_tensor(FIRST_KEY)) == inventory.tensors[FIRST_KEY].nbytes


def test_an_os_error_on_a_read_names_the_file_and_tensor(monkeypatch):
    import remapdsl.checkpoint.reader as reader_module

    inventory = open_inventory(CHECKPOINT)
    monkeypatch.setattr(reader_module, "_preadv_many", _raising(errno.EIO))
    with CheckpointReader(inventory) as reader, pytest.raises(remapdsl.RemapError) as caught:
        reader.read_tensor(FIRST_KEY)
    info = inventory.tensors[FIRST_KEY]
    assert caught.value.diagnostics[0].code == "E343"
    assert str(caught.value).startswith(
        f"{inventory.path('model.safetensors')}: error[E343]: model.safetensors: reading bytes "
        f"[{info.byte_offset}, {info.byte_end}) of tensor `{FIRST_KEY}` failed: EIO (Input/output error)")


KILLED_TIMEOUT = 30  # the group's timeout in the killed-save test: the bound on any wait


def _killed_mid_save(rank: int, rendezvous: str, out: str) -> None:
    """Rank 0 (which made the staging folder) dies (SIGKILL) at its first write into it; rank 1
    must fail, not hang. Then each exits as a job's rank does on an uncaught error."""
    import signal

    from remapdsl.checkpoint.writer import FileWriter

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=KILLED_TIMEOUT))
    two = Mesh.of({"tp": 2})
    state = _local(two, rank)
    remapdsl.load(state, str(CHECKPOINT), RULES, layout=TP, mesh=two)
    if rank == 0:
        FileWriter.write_at = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    try:
        remapdsl.save(state, Path(out) / "previous", RULES, like=str(CHECKPOINT), layout=TP, mesh=two,
                      overwrite=True)
        seen = {"type": None}
    except remapdsl.RemapError as exc:
        seen = {"type": type(exc).__name__, "codes": [d.code for d in exc.diagnostics], "text": str(exc)}
    except CHECK_FAILURES:
        seen = {"type": "escaped", "text": traceback.format_exc()}
    Path(out, f"killed{rank}.json").write_text(json.dumps(seen))
    os._exit(1)


@pytest.mark.distributed
def test_a_save_whose_rank_0_is_killed_leaves_the_old_checkpoint_and_is_cleaned_up_next_time(tmp_path, caplog):

    from remapdsl.checkpoint.writer import OWNER

    shutil.copytree(CHECKPOINT, tmp_path / "previous")
    (tmp_path / "previous" / "model.safetensors").write_bytes(b"\0" * 8)  # an old checkpoint, unlike the new
    before = {p.name: p.read_bytes() for p in (tmp_path / "previous").iterdir()}
    alive = run_with_bound(_killed_mid_save, WORLD, (str(tmp_path / "rendezvous"), str(tmp_path)),
                           3 * KILLED_TIMEOUT)
    assert not alive, f"ranks {alive} hung after rank 0 was killed"
    assert not (tmp_path / "killed0.json").exists()
    seen = json.loads((tmp_path / "killed1.json").read_text())
    assert seen["codes"] == ["E413"] and "rank 1 lost the group while writing" in seen["text"], seen
    assert "rank 0 did not answer a roll call" in seen["text"], seen
    # the old checkpoint untouched, and only a hidden staging folder of the dead save beside it
    assert {p.name: p.read_bytes() for p in (tmp_path / "previous").iterdir()} == before
    stale = list(tmp_path.glob(".previous.remapdsl-partial-*"))
    assert len(stale) == 1 and (stale[0] / OWNER).is_file(), list(tmp_path.iterdir())
    # staging folders it cannot prove dead stay: one of this (live) process, one without a record
    live = tmp_path / ".previous.remapdsl-partial-live"
    shutil.copytree(stale[0], live)
    owner = json.loads((live / OWNER).read_text())
    (live / OWNER).write_text(json.dumps({**owner, "pid": os.getppid(), "start": Path(
        f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19]}))
    unknown = tmp_path / ".previous.remapdsl-partial-unknown"
    unknown.mkdir()
    # the next save (one process) removes the dead one's folder and replaces the old checkpoint
    state = _state()
    remapdsl.load(state, str(CHECKPOINT), RULES)
    with caplog.at_level(logging.INFO, logger="remapdsl"):
        remapdsl.save(state, tmp_path / "previous", RULES, like=str(CHECKPOINT), overwrite=True)
    assert sorted(p.name for p in tmp_path.glob(".previous.*")) == [live.name, unknown.name]
    assert [r.getMessage() for r in caplog.records if "staging" in r.getMessage()] == [
        f"removed {stale[0]}: the staging folder of an earlier save to {tmp_path / 'previous'}, whose process died"]
    assert (tmp_path / "previous" / "model.safetensors").read_bytes() == (CHECKPOINT / "model.safetensors").read_bytes()
    assert not (tmp_path / "previous" / OWNER).exists()
