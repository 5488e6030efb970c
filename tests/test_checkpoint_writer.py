"""The checkpoint writer (remapdsl/checkpoint/writer.py): the errors it raises for real operating-
system failures in this process (a full device, a file it cannot open, a sync that fails; E511 and
E512 whole: code, message, path, hint), the bytes still to write and the space free that E511 names,
a failed save whose staging folder was never made raising its own error, not the clean-up's; how a
new layout lays out its files and index; which stale staging folders are removed; the commit.

The full device is /dev/full (every write ENOSPC, every fsync EINVAL) linked in as an output
file; a disk quota cannot be exceeded on a test machine, so EDQUOT is given to `_write_error`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from safetensors.torch import save_file

import remapdsl
from remapdsl.checkpoint.writer import FileWriter, _write_error, discard
from remapdsl.errors import CheckpointError
from remapdsl.language import rules_from_text

E511_HINT = ("free space on that file system or save elsewhere; nothing at the destination was changed "
             "and the staging folder is removed")
E512_HINT = ("the operating system refused the write (a failing disk, a read-only or full file system, "
             "permissions); nothing at the destination was changed and the staging folder is removed")

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


def _staging(tmp_path: Path) -> Path:
    """A staging folder with a real output file `a` and `full`, a link to /dev/full."""
    staging = tmp_path / "out" / ".ckpt.remapdsl-partial-0123"
    staging.mkdir(parents=True)
    (staging / "a").write_bytes(bytes(64))
    (staging / "full").symlink_to("/dev/full")
    return staging


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


@needs_dev_full
def test_a_full_device_is_e511_with_the_bytes_still_to_write_and_the_space_free(tmp_path):
    """Planned 100 B, 30 written: a write of 10 B that finds the device full still has 70 to go
    (never fewer than its own 10); the free space is the folder's, in whole bytes."""
    staging = _staging(tmp_path)
    writer = FileWriter(staging, planned=100)
    writer.write_at("a", 8, memoryview(b"x" * 30))
    assert (staging / "a").read_bytes() == bytes(8) + b"x" * 30 + bytes(26) and writer.written == 30
    with pytest.raises(CheckpointError) as caught:
        writer.write_at("full", 16, memoryview(b"y" * 10))
    d = caught.value.diagnostic
    folder = staging.parent
    match = re.fullmatch(rf"no space left on the device while writing bytes \[16, 26\) of output file full in "
                         rf"{re.escape(staging.name)}: ENOSPC \(No space left on device\); 70 B still to write on "
                         rf"this rank; (\d+) B free in {re.escape(str(folder))}", d.message)
    assert match, d.message
    assert abs(int(match[1]) - _free_bytes(folder)) < 1 << 30
    assert (d.code, d.path, d.hint, d.span) == ("E511", str(folder), E511_HINT, None)
    late = FileWriter(staging, planned=100)  # 95 already started: this write's own 10 are still to go
    late.write_at("a", 0, memoryview(b"z" * 60))
    late.write_at("a", 0, memoryview(b"z" * 35))
    with pytest.raises(CheckpointError) as caught:
        late.write_at("full", 0, memoryview(b"y" * 50))
    assert "; 50 B still to write on this rank; " in caught.value.diagnostic.message
    unplanned = FileWriter(staging)
    with pytest.raises(CheckpointError) as caught:
        unplanned.write_at("full", 0, memoryview(b"y" * 12))
    assert "ENOSPC (No space left on device); 12 B still to write on this rank; " in caught.value.diagnostic.message
    for w in (writer, late, unplanned):
        w.close(sync=False)


@needs_dev_full
def test_a_full_device_whose_folder_is_gone_says_the_free_space_is_unknown(tmp_path):
    staging = _staging(tmp_path)
    writer = FileWriter(staging, planned=10)
    writer.write_at("full", 0, memoryview(b""))  # opened: the file stays writable once its folder is gone
    folder = staging.parent
    import shutil

    shutil.rmtree(folder)
    with pytest.raises(CheckpointError) as caught:
        writer.write_at("full", 0, memoryview(b"y" * 4))
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path) == (
        "E511", f"no space left on the device while writing bytes [0, 4) of output file full in {staging.name}: "
                f"ENOSPC (No space left on device); 10 B still to write on this rank; free space unknown in {folder}",
        str(folder))
    writer.close(sync=False)


def test_an_output_file_that_cannot_be_opened_is_e512(tmp_path):
    staging = _staging(tmp_path)
    (staging / "dir").mkdir()
    writer = FileWriter(staging, planned=10)
    with pytest.raises(CheckpointError) as caught:
        writer.write_at("dir", 0, memoryview(b"y" * 4))
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path, d.hint) == (
        "E512", f"opening output file dir in {staging.name} failed: EISDIR (Is a directory)", str(staging.parent),
        E512_HINT)


@needs_dev_full
def test_a_sync_that_fails_is_e512_and_every_file_is_closed(tmp_path):
    """The first fsync that fails is the error; the files after it are closed, not synced."""
    staging = _staging(tmp_path)
    writer = FileWriter(staging)
    writer.write_at("full", 0, memoryview(b""))
    writer.write_at("a", 0, memoryview(b"k" * 4))
    fds = dict(writer._fds)
    with pytest.raises(CheckpointError) as caught:
        writer.close(sync=True)
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path, d.hint) == (
        "E512", f"syncing output file full to disk in {staging.name} failed: EINVAL (Invalid argument)",
        str(staging.parent), E512_HINT)
    for fd in fds.values():
        with pytest.raises(OSError):
            os.fstat(fd)
    assert writer._fds == {} and (staging / "a").read_bytes()[:4] == b"kkkk"


def test_a_quota_is_e511_and_an_error_outside_the_writes_names_no_bytes(tmp_path):
    """EDQUOT is a full disk too; with no bytes still to write (a commit, a sync) none are named."""
    staging = tmp_path / ".out.remapdsl-partial-ab"
    folder = staging.parent
    quota = _write_error(staging, "committing the output into out", OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), 0)
    d = quota.diagnostic
    match = re.fullmatch(rf"no space left on the device while committing the output into out in {staging.name}: "
                         rf"EDQUOT \(Disk quota exceeded\); (\d+) B free in {re.escape(str(folder))}", d.message)
    assert match and (d.code, d.path, d.hint) == ("E511", str(folder), E511_HINT), d
    other = _write_error(staging, "committing the output into out", OSError(errno.EIO, os.strerror(errno.EIO)), 7)
    assert (other.diagnostic.code, other.diagnostic.message) == (
        "E512", f"committing the output into out in {staging.name} failed: EIO (Input/output error)")


def _sys_refuses_folders() -> bool:
    try:
        os.mkdir("/sys/.remapdsl-probe")
    except OSError:
        return os.path.isdir("/sys")
    os.rmdir("/sys/.remapdsl-probe")
    return False


@pytest.mark.skipif(not _sys_refuses_folders(), reason="needs /sys, a folder where no folder can be made")
def test_a_save_whose_staging_folder_cannot_be_made_raises_that_not_the_clean_up_s(tmp_path):
    """The destination's parent is /sys: making the staging folder fails (EPERM), the save raises
    E512 for it, and removing the staging folder that never was stays quiet."""
    tiny_checkpoint(tmp_path, {"a.w": torch.zeros(2, 4)}, {})
    rules = rules_from_text("remap 1\na.w -> b\n", "t.remap")
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save({"b": torch.ones(2, 4)}, "/sys/remapdsl-test-out", rules, like=str(tmp_path))
    d = caught.value.diagnostic
    assert d.code == "E512" and d.path == "/sys", d
    assert re.fullmatch(r"creating the staging folder in \.remapdsl-test-out\.remapdsl-partial-[0-9a-f]+ "
                        r"failed: E[A-Z]+ \(.*\)", d.message), d.message
    discard(tmp_path / "never-made")  # quiet
    (tmp_path / "made" / "sub").mkdir(parents=True)
    discard(tmp_path / "made")
    assert not (tmp_path / "made").exists()


def test_a_new_checkpoint_starts_a_file_only_when_the_next_tensor_would_pass_the_limit():
    """As Hugging Face shards: keys in order, a file of exactly the limit is full but not passed, the
    files are named 1-based `model-0000i-of-0000N`, and the index totals every tensor's bytes."""
    from remapdsl.checkpoint.writer import new_checkpoint

    tensors = {k: ("float32", (25,)) for k in "abcde"}  # 100 bytes each
    layout = new_checkpoint("/out", tensors, max_shard_bytes=200)
    first, second, third = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert layout.index == {"metadata": {"total_size": 500}, "weight_map": {
        "a": first, "b": first, "c": second, "d": second, "e": third}}
    assert sorted(layout.inventory.files) == [first, second, third]
    whole = new_checkpoint("/out", tensors, max_shard_bytes=500)
    assert (whole.index, list(whole.inventory.files)) == (None, ["model.safetensors"])  # one file, no index


def test_omit_lays_out_the_kept_tensors_as_safetensors_would_by_dtype_then_name_with_no_metadata_added(tmp_path):
    """A file without `__metadata__`, one tensor dropped and omitted: the file written is byte for
    byte what `save_file` writes for the rest (the largest dtype first, then by name, so neither
    name order nor the dtypes reversed; and no empty `__metadata__` added)."""
    gen = torch.Generator().manual_seed(3)
    kept = {"a.w": torch.randn(3, generator=gen).to(torch.bfloat16), "b.w": torch.randn(2, 2, generator=gen),
            "c.w": torch.randn(5, generator=gen).to(torch.float16)}
    source = tiny_checkpoint(tmp_path / "src", dict(kept, **{"d.w": torch.randn(4, generator=gen)}), {})
    rules = rules_from_text("remap 1\n{a,b,c}.w -> {a,b,c}_w\ndrop d.w\n", "t.remap")
    state = {k.replace(".", "_"): v.clone() for k, v in kept.items()}
    remapdsl.save(state, tmp_path / "out", rules, like=source, dropped="omit")
    save_file(kept, str(tmp_path / "expected.safetensors"))
    data = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert data == (tmp_path / "expected.safetensors").read_bytes(), data[:200]
    assert list(json.loads(data[8:8 + int.from_bytes(data[:8], "little")])) == ["b.w", "a.w", "c.w"]


def _written(layout) -> str:
    """The files of a new layout written out: each header, zeros for the data, the index."""
    root = Path(layout.inventory.root)
    root.mkdir()
    for name, info in layout.inventory.files.items():
        with open(root / name, "wb") as f:
            f.write(layout.headers[name])
            f.truncate(info.nbytes)
    if layout.index is not None:
        (root / layout.inventory.index_file).write_text(json.dumps(layout.index))
    return str(root)


def test_a_new_checkpoint_s_inventory_is_what_its_written_files_read_back_as(tmp_path):
    """Every file's size, data offset and `__metadata__`, every tensor's place: as `open_checkpoint`
    reads them from the files the layout's headers make (one file, and three with an index)."""
    from remapdsl.checkpoint.writer import new_checkpoint

    tensors = {"a": ("bfloat16", (3,)), "b": ("float32", (2, 2)), "c": ("float16", (5,))}
    one = new_checkpoint(str(tmp_path / "one"), tensors, max_shard_bytes=1 << 20)
    three = new_checkpoint(str(tmp_path / "three"), tensors, max_shard_bytes=16, metadata={"format": "pt", "x": "y"})
    assert (len(one.inventory.files), len(three.inventory.files)) == (1, 3)
    for layout in (one, three):
        assert remapdsl.open_checkpoint(_written(layout)) == layout.inventory
    assert three.inventory.files["model-00001-of-00003.safetensors"].metadata == {"format": "pt", "x": "y"}


def test_only_staging_folders_whose_process_is_proven_dead_are_removed(tmp_path):
    """Beside the destination `out`: a folder whose owner's pid is gone, and one whose pid now runs
    a process started at another time, are removed (and returned); a live owner (this test's
    parent), this process, another host, boot or pid namespace, no record or a bad one: left."""
    from remapdsl.checkpoint.writer import OWNER, _process, remove_stale_staging

    me = _process(os.getpid())
    parent = _process(os.getppid())
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has this pid
    records = {"gone": {**me, "pid": gone}, "reused": {**parent, "start": parent["start"] + "0"},
               "live": parent, "mine": me, "host": {**me, "pid": gone, "host": me["host"] + "-other"},
               "boot": {**me, "pid": gone, "boot_id": "another"},
               "namespace": {**me, "pid": gone, "pid_namespace": "pid:[1]"}, "bad": "{", "none": None}
    for name, record in records.items():
        (tmp_path / f".out.remapdsl-partial-{name}").mkdir()
        if record is not None:
            (tmp_path / f".out.remapdsl-partial-{name}" / OWNER).write_text(
                record if isinstance(record, str) else json.dumps(record))
    removed = remove_stale_staging(tmp_path / "out")
    assert sorted(p.name for p in removed) == [".out.remapdsl-partial-gone", ".out.remapdsl-partial-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f".out.remapdsl-partial-{n}" for n in ("live", "mine", "host", "boot", "namespace", "bad", "none"))


def test_a_stale_staging_folder_that_cannot_be_removed_does_not_stop_the_clean_up(tmp_path):
    """A dead owner's staging entry that is a link (which `rmtree` refuses) stays, with what it
    points to, and raises nothing; the dead owner's real folder beside it is removed."""
    from remapdsl.checkpoint.writer import OWNER, _process, remove_stale_staging

    dead = {**_process(os.getpid()), "pid": int(Path("/proc/sys/kernel/pid_max").read_text()) + 1}
    for name in ("elsewhere", ".out.remapdsl-partial-real"):
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER).write_text(json.dumps(dead))
    (tmp_path / ".out.remapdsl-partial-link").symlink_to(tmp_path / "elsewhere")
    remove_stale_staging(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.remapdsl-partial-link", "elsewhere"]
    assert (tmp_path / "elsewhere" / OWNER).is_file()


# -- the commit: the index, the small files, the rename --------------------------------------------

INDEXED_RULES = "remap 1\n{a,b,c}.w -> {a,b,c}_w\ndrop d.w\n"


def _indexed_like(folder: Path) -> Path:
    """Two files and an index written unsorted (weight map last key first, `weight_map` before
    `metadata`), with a config.json and a generation_config.json."""
    gen = torch.Generator().manual_seed(5)
    groups = {"model-00001-of-00002.safetensors": ["a.w", "d.w"], "model-00002-of-00002.safetensors": ["b.w", "c.w"]}
    weight_map = {}
    for name, keys in groups.items():
        tiny_checkpoint(folder, {k: torch.randn(2, 3, generator=gen) for k in keys}, file=name,
                        metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict(sorted(weight_map.items(), reverse=True)), "metadata": {"total_size": 96}}))
    (folder / "config.json").write_text('{"model_type": "toy"}')
    (folder / "generation_config.json").write_text("{}")
    return folder


def _indexed_state(like: Path) -> dict[str, torch.Tensor]:
    rules = rules_from_text(INDEXED_RULES, "t.remap")
    state = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(like)).empty_state_dict()
    remapdsl.load(state, like, rules)
    return state


def test_an_index_laid_out_anew_is_written_as_hugging_face_writes_one(tmp_path):
    """Omitting a dropped tensor rewrites `like`'s index: indented by 2, keys sorted, one newline
    at the end, whatever order `like`'s own index had."""
    like = _indexed_like(tmp_path / "like")
    remapdsl.save(_indexed_state(like), tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like,
                  dropped="omit")
    expected = {"metadata": {"total_size": 72}, "weight_map": {
        "a.w": "model-00001-of-00002.safetensors", "b.w": "model-00002-of-00002.safetensors",
        "c.w": "model-00002-of-00002.safetensors"}}
    assert (tmp_path / "out" / "model.safetensors.index.json").read_text() == \
        json.dumps(expected, indent=2, sort_keys=True) + "\n"
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "toy"}'


def test_a_destination_that_appears_while_the_ranks_write_is_e510_and_left_as_it_is(tmp_path):
    """Checked free at the start, made by someone else during the writes: the commit refuses (E510,
    its path the destination), the staging folder is removed and the newcomer untouched."""
    from remapdsl.drivers.save import write_output

    like = _indexed_like(tmp_path / "like")
    out = tmp_path / "out"

    def someone_else(writer):
        out.mkdir()
        (out / "theirs").write_text("x")

    with pytest.raises(CheckpointError) as caught:
        write_output(out, remapdsl.open_checkpoint(like), overwrite=False, write=someone_else)
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path, d.hint, d.span) == (
        "E510", "the destination appeared during the save", str(out), None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["like", "out"] and \
        [p.name for p in out.iterdir()] == ["theirs"]


def test_an_os_error_in_the_commit_is_e512_naming_the_commit_and_the_staging_folder(tmp_path):
    """`like`'s generation_config.json cannot be read (EIO: a link to /proc/self/mem, whose first
    page is never mapped): the commit's copy fails, E512 whole; nothing at the destination."""
    like = _indexed_like(tmp_path / "like")
    (like / "generation_config.json").unlink()
    (like / "generation_config.json").symlink_to("/proc/self/mem")
    rules = rules_from_text(INDEXED_RULES, "t.remap")
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save(_indexed_state(like), tmp_path / "out", rules, like=like, dropped="omit")
    d = caught.value.diagnostic
    match = re.fullmatch(r"committing the output into out in (\.out\.remapdsl-partial-[0-9a-f]+) failed: "
                         r"EIO \(Input/output error\)", d.message)
    assert match and (d.code, d.path, d.hint) == ("E512", str(tmp_path), E512_HINT), d
    assert sorted(p.name for p in tmp_path.iterdir()) == ["like"]


def test_a_save_where_proc_cannot_name_the_process_writes_no_owner_record_and_commits(tmp_path, monkeypatch):
    """Without /proc (`_process` None: no host, boot and start time to record) the staging folder
    has no owner record; the commit, which removes that record, does not need one."""
    from remapdsl.checkpoint import writer

    monkeypatch.setattr(writer, "_process", lambda pid: None)
    like = _indexed_like(tmp_path / "like")
    state = _indexed_state(like)
    remapdsl.save(state, tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like, dropped="omit")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["like", "out"]


def test_an_old_checkpoint_left_by_a_commit_killed_midway_does_not_block_the_next_save(tmp_path, monkeypatch):
    """A save over an old checkpoint is killed after moving the old one aside, before removing it:
    the new checkpoint is in place and the old one hidden beside it under this save's own name; a
    later save over it moves the checkpoint aside under another name and succeeds."""
    from remapdsl.checkpoint import writer

    like = _indexed_like(tmp_path / "like")
    state, rules = _indexed_state(like), rules_from_text(INDEXED_RULES, "t.remap")
    remapdsl.save(state, tmp_path / "out", rules, like=like, dropped="omit")
    rmtree = writer.shutil.rmtree

    def killed(path, *args, **kwargs):
        if ".out.remapdsl-old-" in str(path):
            raise KeyboardInterrupt
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(writer.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remapdsl.save(state, tmp_path / "out", rules, like=like, dropped="omit", overwrite=True)
    monkeypatch.setattr(writer.shutil, "rmtree", rmtree)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.remapdsl-old-"))
    assert len(left) == 1 and (tmp_path / left[0] / "model.safetensors.index.json").is_file()
    remapdsl.save(state, tmp_path / "out", rules, like=like, dropped="omit", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["like", "out", *left])


def test_a_save_to_an_existing_folder_is_e510_whose_hint_names_both_ways_out(tmp_path):
    """E510 whole: the hint says to save elsewhere or to pass overwrite=True, and that the old
    checkpoint stays until the new one is complete."""
    like = _indexed_like(tmp_path / "like")
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save(_indexed_state(like), tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like,
                      dropped="omit")
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path, d.hint) == (
        "E510", "the destination exists", str(tmp_path / "out"),
        "save to a new folder, or pass overwrite=True to replace it (the old one stays until the new one is complete)")


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_onto_a_file_is_e510_and_leaves_the_file_as_it_was(tmp_path, overwrite):
    """`overwrite` replaces a checkpoint folder; a file at the destination is refused either way,
    before anything is written, and stays as it was."""
    like = _indexed_like(tmp_path / "like")
    (tmp_path / "out").write_text("notes")
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save(_indexed_state(like), tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like,
                      dropped="omit", overwrite=overwrite)
    d = caught.value.diagnostic
    assert (d.code, d.message, d.path, d.hint) == (
        "E510", "the destination exists and is not a folder", str(tmp_path / "out"),
        "save to a new folder; a checkpoint is a folder")
    assert (tmp_path / "out").read_text() == "notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["like", "out"]  # no staging folder, no old copy


def test_a_short_positioned_write_is_continued_where_it_stopped(tmp_path, monkeypatch):
    """`pwrite` may write fewer bytes than asked (on Linux, over ~2 GiB in one call, or when a
    signal interrupts it); the writer goes on from the byte it stopped at until all are written."""
    from remapdsl.checkpoint import writer

    real, calls = os.pwrite, []

    def three_bytes(fd, data, offset):  # at most 3 bytes a call; a writer that never ends fails
        calls.append(offset)
        assert len(calls) <= 4, f"still writing after {calls}"
        return real(fd, bytes(data[:3]), offset)

    monkeypatch.setattr(writer.os, "pwrite", three_bytes)
    path = tmp_path / "f"
    path.write_bytes(bytes(16))
    fd = os.open(path, os.O_RDWR)
    try:
        writer._write_all(fd, memoryview(bytes(range(1, 11))), 4)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(4) + bytes(range(1, 11)) + bytes(2) and calls == [4, 7, 10, 13]

def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (the start time), counted after the command name's last `)`."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 1:].split()[19]


def test_a_save_s_staging_folder_records_this_host_boot_pid_namespace_pid_and_start_time(tmp_path):
    """The owner record, read while the ranks write: what tells this process apart from every
    other (the kernel's boot id, the pid namespace's link, the start time of /proc/PID/stat)."""
    from remapdsl.checkpoint.writer import OWNER
    from remapdsl.drivers.save import write_output

    like = _indexed_like(tmp_path / "like")
    seen = []
    write_output(tmp_path / "out", remapdsl.open_checkpoint(like), overwrite=False,
                 write=lambda writer: seen.append(json.loads((writer.staging / OWNER).read_text())))
    assert seen == [{"host": socket.gethostname(),
                     "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                     "pid_namespace": os.readlink("/proc/self/ns/pid"), "pid": os.getpid(),
                     "start": _start_time(os.getpid())}]
    assert not (tmp_path / "out" / OWNER).exists()


def test_a_process_s_start_time_stays_while_it_grows_and_renames_itself(tmp_path):
    """The start time that tells a live process from a reused pid does not change when the process
    takes more memory, nor when its name holds parentheses (the command name is cut at its last `)`)."""
    from remapdsl.checkpoint.writer import _process

    comm = Path("/proc/self/comm")
    name, before = comm.read_text().strip(), _process(os.getpid())
    grown = bytearray(64 << 20)
    try:
        comm.write_text("a) (b) c")
        assert _process(os.getpid()) == before and before["start"] == _start_time(os.getpid())
    finally:
        comm.write_text(name)
        del grown


def test_a_full_device_while_creating_the_files_is_e511_naming_the_file_and_its_header_s_bytes(tmp_path, monkeypatch):
    """The header's write finds the device full (ENOSPC injected at the writer's write): E511 names
    the file, its size, and the header's bytes still to write."""
    from remapdsl.checkpoint import writer

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    like = _indexed_like(tmp_path / "like")
    state = _indexed_state(like)
    monkeypatch.setattr(writer, "_write_all", full)
    inventory = remapdsl.open_checkpoint(like)
    first = inventory.files["model-00001-of-00002.safetensors"]
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save(state, tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like, dropped="copy")
    d = caught.value.diagnostic
    match = re.fullmatch(rf"no space left on the device while creating output file model-00001-of-00002\.safetensors "
                         rf"\({first.nbytes} B\) in \.out\.remapdsl-partial-[0-9a-f]+: ENOSPC \(No space left on "
                         rf"device\); {first.data_offset} B still to write on this rank; \d+ B free in "
                         rf"{re.escape(str(tmp_path))}", d.message)
    assert match and (d.code, d.path, d.hint) == ("E511", str(tmp_path), E511_HINT), d


def test_a_full_device_at_the_first_tensor_write_names_all_the_bytes_this_rank_still_writes(tmp_path, monkeypatch):
    """The first write past the headers finds the device full: E511 says how many bytes this rank still
    had to write, the save's plan in all (its tensors' bytes and the dropped tensor it copies)."""
    from remapdsl.checkpoint import writer

    real = writer._write_all

    def full_past_the_headers(fd, data, offset):
        if offset:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    like = _indexed_like(tmp_path / "like")
    state = _indexed_state(like)
    monkeypatch.setattr(writer, "_write_all", full_past_the_headers)
    planned = sum(t.nbytes for t in remapdsl.open_checkpoint(like).tensors.values())
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save(state, tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like, dropped="copy")
    d = caught.value.diagnostic
    assert d.code == "E511" and f"ENOSPC (No space left on device); {planned} B still to write on this rank; " \
        in d.message, d


def test_output_files_are_made_readable_by_all_writable_by_their_owner(tmp_path):
    """Mode 0o644 (less the umask): as a file any tool writes, not executable."""
    like = _indexed_like(tmp_path / "like")
    old = os.umask(0o022)
    try:
        remapdsl.save(_indexed_state(like), tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like,
                      dropped="copy")
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "model-00001-of-00002.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_checkpoint_whose_index_names_files_in_nested_folders_saves_back_byte_identical(tmp_path):
    """Files under `shards/deep/`: their folders are made in the staging folder, the files copied."""
    like = _indexed_like(tmp_path / "like")
    index = json.loads((like / "model.safetensors.index.json").read_text())
    (like / "shards" / "deep").mkdir(parents=True)
    for name in set(index["weight_map"].values()):
        (like / name).rename(like / "shards" / "deep" / name)
    index["weight_map"] = {k: f"shards/deep/{v}" for k, v in index["weight_map"].items()}
    (like / "model.safetensors.index.json").write_text(json.dumps(index))
    remapdsl.save(_indexed_state(like), tmp_path / "out", rules_from_text(INDEXED_RULES, "t.remap"), like=like,
                  dropped="copy")
    for name in index["weight_map"].values():
        assert (tmp_path / "out" / name).read_bytes() == (like / name).read_bytes()


def test_a_sync_that_finds_the_device_full_is_e511_with_no_bytes_still_to_write(tmp_path, monkeypatch):
    """ENOSPC from fsync (delayed allocation; injected): E511, its message naming no bytes to write."""
    staging = _staging(tmp_path)
    writer = FileWriter(staging, planned=4)
    writer.write_at("a", 0, memoryview(b"k" * 4))

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError) as caught:
        writer.close(sync=True)
    d = caught.value.diagnostic
    assert re.fullmatch(rf"no space left on the device while syncing output file a to disk in {staging.name}: "
                        rf"ENOSPC \(No space left on device\); \d+ B free in {re.escape(str(staging.parent))}",
                        d.message) and d.code == "E511", d


def test_a_one_byte_tensor_is_written(tmp_path):
    """A write of a single byte is whole, not short."""
    source = tiny_checkpoint(tmp_path / "src", {"a.w": torch.zeros(1, dtype=torch.uint8)})
    rules = rules_from_text("remap 1\na.w -> b\n", "t.remap")
    remapdsl.save({"b": torch.full((1,), 7, dtype=torch.uint8)}, tmp_path / "out", rules, like=source)
    save_file({"a.w": torch.full((1,), 7, dtype=torch.uint8)}, str(tmp_path / "expected.safetensors"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_a_like_file_gone_before_its_header_is_copied_is_e512_naming_the_file_and_the_staging_folder(tmp_path):
    """`like` opened, then its file removed (another job cleaning up) before the staging files are
    made: E512 saying which header could not be read, in which staging folder."""
    from remapdsl.checkpoint.writer import create_files

    source = tiny_checkpoint(tmp_path / "src", {"a": torch.ones(2)})
    like = remapdsl.open_checkpoint(source)
    (source / "model.safetensors").unlink()
    staging = tmp_path / "out" / ".ckpt.remapdsl-partial-0123"
    staging.parent.mkdir()
    with pytest.raises(CheckpointError) as caught:
        create_files(staging, like)
    d = caught.value.diagnostic
    assert d.code == "E512" and d.path == str(tmp_path / "out"), d
    assert d.message.startswith("reading the header of model.safetensors to copy it in "
                                ".ckpt.remapdsl-partial-0123 failed: "), d
