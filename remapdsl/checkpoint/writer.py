"""Writing a checkpoint in place from many ranks: a staging folder, files created at full size,
positioned writes, then the index and one rename.

The output copies the layout of the checkpoint it is `like`: the same files, each with the same
header bytes, each tensor at the same offset, and the same index, so an unchanged model saves to
byte-identical files (or that layout less the tensors a save omits, `without`). Rank 0 creates
the staging folder (a hidden sibling of the destination) and its files; every rank writes its own
byte ranges with `os.pwrite`; rank 0 then writes the index, syncs, and renames the folder into
place. Until that rename nothing at the destination changes: a crash leaves the old checkpoint (or
none) and a hidden staging folder, never a half-written folder that looks complete; the next save
to the same destination removes such a folder once it can prove its process dead
(`remove_stale_staging`).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

import json
from collections.abc import Mapping
from typing import NamedTuple

from ..dtypes import BY_NAME
from ..indexmap import Runs, nbytes
from ..errors import CheckpointError, Diagnostic
from .chunks import SHARDING_INFO
from .header import FileInfo, TensorInfo, check_tensor_info
from .inventory import Inventory
from .reader import os_error

COPIED = ("config.json", "generation_config.json")  # small files a loadable checkpoint carries


OWNER = ".remapdsl-owner.json"  # in a staging folder: the process that made it, until the commit


def staging_path(folder: Path, token: str) -> Path:
    return folder.parent / f".{folder.name}.remapdsl-partial-{token}"


def _process(pid: int) -> dict | None:
    """What tells process `pid` apart from every other, on Linux: host, boot, pid namespace, pid
    and start time (a pid reused later starts at another time); None where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    except (OSError, IndexError):
        return None
    return {"host": socket.gethostname(), "boot_id": boot, "pid_namespace": namespace, "pid": pid, "start": start}


def remove_stale_staging(folder: Path) -> list[Path]:
    """Remove the staging folders of earlier saves to `folder` whose process is proven dead; returns
    them (rank 0, before its own save).

    Proven dead: the folder's owner record names this host, this boot and this pid namespace, and
    its pid is gone or started at another time. Anything else (no record, another host or boot, a
    live owner: a save under way) is left alone."""
    removed = []
    me = _process(os.getpid())
    if me is None:
        return removed
    for staging in folder.parent.glob(f".{folder.name}.remapdsl-partial-*"):
        try:
            owner = json.loads((staging / OWNER).read_text())
            same_place = all(owner[k] == me[k] for k in ("host", "boot_id", "pid_namespace"))
            pid, start = int(owner["pid"]), owner["start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not same_place or pid == os.getpid():
            continue
        now = _process(pid)
        if now is None or now["start"] != start:
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def check_destination(folder: Path, overwrite: bool) -> None:
    if folder.exists() and not folder.is_dir():  # overwrite replaces a checkpoint folder, never a file
        raise CheckpointError(Diagnostic(code="E510", message="the destination exists and is not a folder",
                                         path=str(folder), hint="save to a new folder; a checkpoint is a folder"))
    if folder.exists() and not overwrite:
        raise CheckpointError(Diagnostic(code="E510", message="the destination exists", path=str(folder),
                                         hint="save to a new folder, or pass overwrite=True to replace it "
                                              "(the old one stays until the new one is complete)"))
    if not folder.parent.is_dir():
        raise CheckpointError(Diagnostic(code="E510", message="the destination's parent folder does not exist",
                                         path=str(folder.parent)))


# safetensors orders a file's tensors by dtype (this enum order, last first), then by name
_SAFETENSORS_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E5M2FNUZ", "F8_E4M3",
                      "F8_E4M3FNUZ", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64",
                      "U64", "C64")


class NewCheckpoint(NamedTuple):
    """A checkpoint layout made here (no `like`): the inventory of the files to write, each file's
    header bytes, and the index (None for a single file)."""

    inventory: Inventory
    headers: dict[str, bytes]
    index: dict | None


def new_checkpoint(root: str, tensors: Mapping[str, tuple[str, tuple[int, ...]]], max_shard_bytes: int,
               metadata: Mapping[str, str] | None = None) -> NewCheckpoint:
    """Files for `tensors` (key -> (dtype name, shape)) as Hugging Face shards them: keys in order,
    a new file when the next tensor would pass `max_shard_bytes`, named `model-0000i-of-0000N`
    (`model.safetensors` alone when one file does), each laid out as `safetensors` lays out a file."""
    groups: list[list[str]] = [[]]
    size = 0
    for key in sorted(tensors):
        n = nbytes(*tensors[key])
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    infos, files, headers = {}, {}, {}
    meta = dict(metadata or {"format": "pt"})
    for name, keys in zip(names, groups):
        headers[name], files[name] = _lay_out_file(name, keys, tensors, meta, infos)
    index = None if len(names) == 1 else {
        "metadata": {"total_size": sum(i.nbytes for i in infos.values())},
        "weight_map": {k: infos[k].file for k in sorted(infos)}}
    inventory = Inventory(root=root, tensors=infos, files=files,
                          index_file=None if index is None else "model.safetensors.index.json")
    return NewCheckpoint(inventory, headers, index)


def _lay_out_file(name: str, keys: list[str], tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                  meta: Mapping[str, str], infos: dict) -> tuple[bytes, FileInfo]:
    """One file of `keys` as `safetensors` lays it out (tensors by dtype, then name; the header
    padded to 8 bytes, `__metadata__` first when there is any): its header bytes and FileInfo; the
    tensors' TensorInfos are added to `infos`."""
    keys = sorted(keys, key=lambda k: (-_SAFETENSORS_ORDER.index(BY_NAME[tensors[k][0]].safetensors), k))
    entries, at = {}, 0
    for key in keys:
        dtype, shape = tensors[key]
        n = nbytes(dtype, shape)
        entries[key] = {"dtype": BY_NAME[dtype].safetensors, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps({"__metadata__": dict(meta), **entries} if meta else entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = len(text).to_bytes(8, "little") + text
    for key, entry in entries.items():
        infos[key] = check_tensor_info(TensorInfo(  # a layout of sizes it computed, checked as a header would be
            ckpt_key=key, file=name, dtype=tensors[key][0], shape=tuple(tensors[key][1]),
            byte_offset=len(header) + entry["data_offsets"][0], nbytes=entry["data_offsets"][1] - entry["data_offsets"][0]))
    return header, FileInfo(file=name, nbytes=len(header) + at, data_offset=len(header), metadata=dict(meta))


def without(like: Inventory, omitted) -> NewCheckpoint:
    """`like`'s layout less the tensors `omitted`: the same files, each holding the rest of its
    tensors laid out as `new_checkpoint` lays out a file (with its own `__metadata__`); a file left
    empty is not written and the index does not name it (a checkpoint without an index keeps its
    one file). The index is `like`'s own with its weight map and total size cut to match (None
    here: `omitted_index` reads it, on the rank that commits)."""
    omitted = set(omitted)
    kept: dict[str, list[str]] = {name: [] for name in like.files}
    for key, info in like.tensors.items():
        if key not in omitted:
            kept[info.file].append(key)
    shapes = {k: (t.dtype, t.shape) for k, t in like.tensors.items() if k not in omitted}
    infos, files, headers = {}, {}, {}
    for name, keys in kept.items():
        if keys or like.index_file is None:
            metadata = _sharding_info_without(like.files[name].metadata, omitted)
            headers[name], files[name] = _lay_out_file(name, keys, shapes, metadata, infos)
    inventory = Inventory(root=like.root, tensors=infos, files=files, index_file=like.index_file)
    return NewCheckpoint(inventory, headers, None)


def _sharding_info_without(metadata: Mapping[str, str], omitted: set[str]) -> Mapping[str, str]:
    """A file's `__metadata__` with the omitted tensors out of its DCP_SHARDING_INFO (a file torch's
    distributed writer wrote names each of its tensors there; one it does not hold is E354)."""
    text = metadata.get(SHARDING_INFO)
    if text is None:
        return metadata
    info = json.loads(text)  # it parsed when `like` was opened
    return {**metadata, SHARDING_INFO: json.dumps({k: v for k, v in info.items() if k not in omitted})}


def omitted_index(like: Inventory, out: Inventory) -> dict | None:
    """`like`'s index (None without one) naming only the tensors of `out`, its total size theirs."""
    if like.index_file is None:
        return None
    with open(os.path.join(like.root, like.index_file)) as f:
        index = json.load(f)
    index["weight_map"] = {k: name for k, name in index.get("weight_map", {}).items() if k in out.tensors}
    if isinstance(index.get("metadata"), dict) and "total_size" in index["metadata"]:
        index["metadata"]["total_size"] = sum(t.nbytes for t in out.tensors.values())
    return index


def create_files(staging: Path, like: Inventory, headers: Mapping[str, bytes] | None = None) -> None:
    """The staging folder with every file of `like` at its full size and its header: copied from
    `like`'s own files, or taken from `headers` (a new layout) (rank 0)."""
    with _os_errors(staging, "creating the staging folder"):
        staging.mkdir()
        owner = _process(os.getpid())  # so a later save can tell this one died (remove_stale_staging)
        if owner is not None:
            (staging / OWNER).write_text(json.dumps(owner))
    for name, info in like.files.items():
        if headers is not None:
            header = headers[name]
        else:
            with _os_errors(staging, f"reading the header of {name} to copy it"):
                with open(os.path.join(like.root, name), "rb") as source:
                    header = source.read(info.data_offset)
        target = staging / name
        with _os_errors(staging, f"creating output file {name} ({info.nbytes} B)", needed=len(header)):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(header), 0)
                os.ftruncate(fd, info.nbytes)
            finally:
                os.close(fd)


class FileWriter:
    """Positioned writes into the staging files; shared by threads (pwrite moves no file position).

    `planned` is the bytes this rank will write in all (0: not known): a write that finds the disk
    full says how many are still to come (E511)."""

    def __init__(self, staging: Path, planned: int = 0):
        self.staging = staging
        self.planned = planned
        self.written = 0
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def write_at(self, file: str, offset: int, data: memoryview) -> None:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                with _os_errors(self.staging, f"opening output file {file}"):
                    fd = self._fds[file] = os.open(self.staging / file, os.O_WRONLY)
            started = self.written  # the bytes of the writes started before this one
            self.written += data.nbytes
        try:
            _write_all(fd, data, offset)
        except OSError as exc:
            left = max(self.planned - started, data.nbytes) if self.planned else data.nbytes
            raise _write_error(self.staging, f"writing bytes [{offset}, {offset + data.nbytes}) of output "
                               f"file {file}", exc, left) from None

    def write_runs(self, file: str, runs: Runs, data: memoryview) -> None:
        """`data` (the concatenation of the runs) written run by run, the runs listed a bounded
        chunk at a time."""
        at = 0
        for chunk in runs.chunks(4096):
            for start in chunk.starts():
                self.write_at(file, start, data[at:at + runs.length])
                at += runs.length

    def close(self, sync: bool = True) -> None:
        fds, self._fds = self._fds, {}
        failed = None
        for file, fd in fds.items():
            try:
                if sync and failed is None:
                    os.fsync(fd)  # a disk that filled up under delayed allocation fails here
            except OSError as exc:
                failed = _write_error(self.staging, f"syncing output file {file} to disk", exc, 0)
            finally:
                os.close(fd)
        if failed is not None:
            raise failed


@contextmanager
def _os_errors(staging: Path, operation: str, needed: int = 0):
    """An OSError inside becomes E511 or E512 naming the operation, the folder and the bytes needed."""
    try:
        yield
    except OSError as exc:
        raise _write_error(staging, operation, exc, needed) from None


def _write_error(staging: Path, operation: str, exc: OSError, needed: int) -> CheckpointError:
    """E511 for a full disk or quota (ENOSPC, EDQUOT): the bytes still needed and the space free in
    the destination's folder; E512 for any other operating-system error."""
    folder = staging.parent
    what = f"{operation} in {staging.name}"
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        try:
            st = os.statvfs(folder)
            free = f"{st.f_bavail * st.f_frsize} B free"
        except OSError:
            free = "free space unknown"
        still = f"; {needed} B still to write on this rank" if needed else ""
        return CheckpointError(Diagnostic(
            code="E511", message=f"no space left on the device while {what}: {os_error(exc)}{still}; "
            f"{free} in {folder}", path=str(folder),
            hint="free space on that file system or save elsewhere; nothing at the destination was changed "
                 "and the staging folder is removed"))
    return CheckpointError(Diagnostic(
        code="E512", message=f"{what} failed: {os_error(exc)}", path=str(folder),
        hint="the operating system refused the write (a failing disk, a read-only or full file system, "
             "permissions); nothing at the destination was changed and the staging folder is removed"))


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at byte {offset + done}")
        done += n


def commit(staging: Path, folder: Path, like: Inventory, token: str, overwrite: bool,
           index: dict | None = None, copy_from: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
    """Rank 0, after every rank's writes: the index (`like`'s, or a new layout's `index`), the small
    files of `copy_from` (default `like`'s folder) or, where given, `files` (name -> bytes) instead,
    sync, rename into place."""
    with _os_errors(staging, f"committing the output into {folder.name}"):
        _commit(staging, folder, like, token, overwrite, index, copy_from, files)


def _commit(staging: Path, folder: Path, like: Inventory, token: str, overwrite: bool, index: dict | None,
            copy_from: str | None, files: Mapping[str, bytes] | None) -> None:
    if index is not None:
        (staging / like.index_file).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    elif like.index_file:
        shutil.copyfile(Path(like.root) / like.index_file, staging / like.index_file)
    (staging / OWNER).unlink(missing_ok=True)  # not part of the checkpoint
    source = Path(copy_from or like.root)
    for name in COPIED if files is None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, staging / name)
    for name, data in (files or {}).items():
        (staging / name).write_bytes(data)
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
