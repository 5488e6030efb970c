"""Writing a checkpoint in place from many ranks: a staging folder, files created at full size,
positioned writes, then the index and one rename.

The output copies the layout of the checkpoint it is `like`: the same files, each with the same
header bytes, each tensor at the same offset, and the same index, so an unchanged model saves to
byte-identical files. Rank 0 creates the staging folder (a hidden sibling of the destination) and
its files; every rank writes its own byte ranges with `os.pwrite`; rank 0 then writes the index,
syncs, and renames the folder into place. Until that rename nothing at the destination changes: a
crash leaves the old checkpoint (or none) and a hidden staging folder, never a half-written
folder that looks complete.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from ..errors import CheckpointError, Diagnostic
from .inventory import Inventory

COPIED = ("config.json", "generation_config.json")  # small files a loadable checkpoint carries


def staging_path(folder: Path, token: str) -> Path:
    return folder.parent / f".{folder.name}.remapdsl-partial-{token}"


def check_destination(folder: Path, overwrite: bool) -> None:
    if folder.exists() and not overwrite:
        raise CheckpointError(Diagnostic(code="E510", message="the destination exists", path=str(folder),
                                         hint="save to a new folder, or pass overwrite=True to replace it "
                                              "(the old one stays until the new one is complete)"))
    if not folder.parent.is_dir():
        raise CheckpointError(Diagnostic(code="E510", message="the destination's parent folder does not exist",
                                         path=str(folder.parent)))


def create_files(staging: Path, like: Inventory) -> None:
    """The staging folder with every file of `like` at its full size, headers copied (rank 0)."""
    staging.mkdir()
    for name, info in like.files.items():
        with open(os.path.join(like.root, name), "rb") as source:
            header = source.read(info.data_offset)
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(header), 0)
            os.ftruncate(fd, info.nbytes)
        finally:
            os.close(fd)


class FileWriter:
    """Positioned writes into the staging files; shared by threads (pwrite moves no file position)."""

    def __init__(self, staging: Path):
        self.staging = staging
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def write_at(self, file: str, offset: int, data: memoryview) -> None:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(self.staging / file, os.O_WRONLY)
        _write_all(fd, data, offset)

    def close(self, sync: bool = True) -> None:
        for fd in self._fds.values():
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        self._fds.clear()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at byte {offset + done}")
        done += n


def commit(staging: Path, folder: Path, like: Inventory, token: str, overwrite: bool) -> None:
    """Rank 0, after every rank's writes: the index and small files, sync, rename into place."""
    names = ([like.index_file] if like.index_file else []) + [n for n in COPIED if (Path(like.root) / n).is_file()]
    for name in names:
        shutil.copyfile(Path(like.root) / name, staging / name)
    for path in staging.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    old = None
    if folder.exists():
        if not overwrite:
            raise CheckpointError(Diagnostic(code="E510", message="the destination appeared during the save",
                                             path=str(folder)))
        old = folder.parent / f".{folder.name}.remapdsl-old-{token}"
        folder.rename(old)
    staging.rename(folder)
    _sync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
