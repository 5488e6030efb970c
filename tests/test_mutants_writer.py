"""What remapdsl/checkpoint/writer.py does that the rest of the suite left unchecked (issue #18's
mutation run): the errors a writer raises for real operating-system failures in this process
(a full device, a file it cannot open, a sync that fails; E511 and E512 whole: code, message,
path, hint), the bytes still to write and the space free that E511 names, and a failed save
whose staging folder was never made raising its own error, not the clean-up's.

The full device is /dev/full (every write ENOSPC, every fsync EINVAL) linked in as an output
file; a disk quota cannot be exceeded on a test machine, so EDQUOT is given to `_write_error`.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch
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
    save_file({"a.w": torch.zeros(2, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    rules = rules_from_text("remap 1\na.w -> b\n", "t.remap")
    with pytest.raises(CheckpointError) as caught:
        remapdsl.save({"b": torch.ones(2, 4)}, "/sys/remapdsl-mutants-out", rules, like=str(tmp_path))
    d = caught.value.diagnostic
    assert d.code == "E512" and d.path == "/sys", d
    assert re.fullmatch(r"creating the staging folder in \.remapdsl-mutants-out\.remapdsl-partial-[0-9a-f]+ "
                        r"failed: E[A-Z]+ \(.*\)", d.message), d.message
    discard(tmp_path / "never-made")  # quiet
    (tmp_path / "made" / "sub").mkdir(parents=True)
    discard(tmp_path / "made")
    assert not (tmp_path / "made").exists()


def test_a_new_layout_starts_a_file_only_when_the_next_tensor_would_pass_the_limit():
    """As Hugging Face shards: keys in order, a file of exactly the limit is full but not passed, the
    files are named 1-based `model-0000i-of-0000N`, and the index totals every tensor's bytes."""
    from remapdsl.checkpoint.writer import new_layout

    tensors = {k: ("float32", (25,)) for k in "abcde"}  # 100 bytes each
    layout = new_layout("/out", tensors, max_shard_bytes=200)
    first, second, third = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert layout.index == {"metadata": {"total_size": 500}, "weight_map": {
        "a": first, "b": first, "c": second, "d": second, "e": third}}
    assert sorted(layout.inventory.files) == [first, second, third]
    whole = new_layout("/out", tensors, max_shard_bytes=500)
    assert (whole.index, list(whole.inventory.files)) == (None, ["model.safetensors"])  # one file, no index
