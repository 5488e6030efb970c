"""A checkpoint without its data: an Inventory plus config.json <-> a small, deterministic JSON file, so
CI checks rules without a release's weights. Each file's entry is its safetensors header, validated as one."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remapdsl.checkpoint.chunks import assemble_chunked, has_sharding_info
from remapdsl.checkpoint.header import (
    MAX_HEADER_NBYTES,
    METADATA_KEY,
    PREFIX_NBYTES,
    FileInfo,
    load_json_object,
    parse_header_object,
)
from remapdsl.checkpoint.inventory import (
    INDEX_SUFFIX,
    SUFFIX,
    Inventory,
    _unsafe_name,
    open_inventory,
    read_config,
    read_config_file,
)
from remapdsl.dtypes import BY_NAME
from remapdsl.errors import CheckpointError, Diagnostic, RemapError

FORMAT = "remapdsl-snapshot"
VERSION = 1
MAX_SNAPSHOT_NBYTES = 1 << 30  # a DeepSeek-V3 release (163 files, 138k tensors) is ~15 MB
MAX_FILE_NBYTES = 1 << 50  # one safetensors file of a snapshot: at most 1 PiB
_FIELDS = ("config", "files", "format", "ignored_files", "index_file", "version")
_FILE_FIELDS = ("data_offset", "header", "nbytes")


class SnapshotInventory(Inventory):
    """The inventory a snapshot file describes: `root` is the snapshot file, `config` config.json as it was."""

    config: dict[str, Any]


def is_snapshot(checkpoint: object) -> bool:
    """Whether `checkpoint` is a SnapshotInventory or the path of a `.json` file but a safetensors index."""
    if isinstance(checkpoint, SnapshotInventory):
        return True
    if not isinstance(checkpoint, (str, os.PathLike)):
        return False
    path = os.fspath(checkpoint)
    return path.endswith(".json") and not path.endswith(INDEX_SUFFIX) and not os.path.isdir(path)


def checkpoint_config(inventory: Inventory) -> dict[str, Any]:
    """The model config of a checkpoint: its config.json, or the one its snapshot carries."""
    if isinstance(inventory, SnapshotInventory):
        return copy.deepcopy(inventory.config)
    return read_config(inventory)


def config_of(checkpoint) -> dict[str, Any]:
    """The model config of a checkpoint, snapshot or Inventory, without reading safetensors headers."""
    if isinstance(checkpoint, Inventory) or is_snapshot(checkpoint):
        inventory = checkpoint if isinstance(checkpoint, Inventory) else open_snapshot(checkpoint)
        return checkpoint_config(inventory)
    folder = Path(checkpoint)
    return read_config_file((folder if folder.is_dir() else folder.parent) / "config.json")


def require_data(checkpoint: object, what: str) -> None:
    """Refuse a snapshot where tensor data is needed (E331); anything else passes."""
    if not is_snapshot(checkpoint):
        return
    path = checkpoint.root if isinstance(checkpoint, SnapshotInventory) else os.fspath(checkpoint)
    raise RemapError(Diagnostic(
        code="E331", path=path,
        message=f"{what} needs tensor data, and a snapshot holds headers only",
        hint="give the checkpoint folder itself; a snapshot serves `check --checkpoint`, `explain` and "
             "`plan`, or write random data in its layout with remapdsl.testing.write_checkpoint"))


def snapshot_of(checkpoint: str | os.PathLike | Inventory, config: Mapping[str, Any] | None = None) -> dict:
    """The snapshot of a checkpoint as a JSON-ready dict; `config` by default its config.json."""
    if isinstance(checkpoint, Inventory):
        inventory = checkpoint
    else:
        inventory = open_snapshot(checkpoint) if is_snapshot(checkpoint) else open_inventory(checkpoint)
    files: dict[str, dict] = {}
    for name, info in inventory.files.items():
        header: dict[str, Any] = {METADATA_KEY: dict(info.metadata)} if info.metadata else {}
        files[name] = {"nbytes": info.nbytes, "data_offset": info.data_offset, "header": header}
    for ckpt_key, t in inventory.tensors.items():
        code = BY_NAME[t.dtype].safetensors
        for c in inventory.stored(ckpt_key):  # a chunked tensor: each chunk in its file
            begin = c.byte_offset - inventory.files[c.file].data_offset
            files[c.file]["header"][ckpt_key] = {"dtype": code, "shape": list(c.sizes),
                                                 "data_offsets": [begin, begin + c.nbytes(t.dtype)]}
    return {"format": FORMAT, "version": VERSION, "index_file": inventory.index_file,
            "ignored_files": list(inventory.ignored_files), "files": files,
            "config": dict(checkpoint_config(inventory) if config is None else config)}


def snapshot_text(snapshot: Mapping[str, Any]) -> str:
    """A snapshot as text: keys sorted, one tensor a line, so equal checkpoints give equal bytes."""
    def dump(value) -> str:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)

    top = {k: dump(value) for k, value in snapshot.items() if k != "files"}
    files = []
    for name in sorted(snapshot["files"]):
        entry = snapshot["files"][name]
        header = entry["header"]
        rows = [f"    {dump(k)}: {dump(header[k])}" for k in sorted(header)]
        body = "{\n" + ",\n".join(rows) + "\n   }" if rows else "{}"
        files.append(f'  {dump(name)}: {{\n   "data_offset": {entry["data_offset"]},\n   "header": {body},\n'
                     f'   "nbytes": {entry["nbytes"]}\n  }}')
    top["files"] = "{\n" + ",\n".join(files) + "\n }" if files else "{}"
    return "{\n" + ",\n".join(f' "{k}": {top[k]}' for k in sorted(top)) + "\n}\n"


def write_snapshot(checkpoint: str | os.PathLike | Inventory, path: str | os.PathLike,
                   config: Mapping[str, Any] | None = None) -> str:
    """Write the snapshot of `checkpoint` to `path` (replaced atomically); returns the text written."""
    text = snapshot_text(snapshot_of(checkpoint, config))
    path = os.fspath(path)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)
    return text


def open_snapshot(path: str | os.PathLike) -> SnapshotInventory:
    """Read and validate a snapshot file (untrusted input) into the inventory it describes.

    Raises:
        CheckpointError: E330 for what is not a snapshot of this version (named by its path in the JSON),
            and the header codes E305-E313 and E322 for the files it describes, all problems at once.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SNAPSHOT_NBYTES + 1)
    except OSError as exc:
        raise CheckpointError(Diagnostic(code="E301", path=path,
                                         message=f"cannot read the snapshot ({exc.strerror})")) from None
    if len(raw) > MAX_SNAPSHOT_NBYTES:
        raise CheckpointError(_diag(path, "", f"the file is larger than {MAX_SNAPSHOT_NBYTES} bytes"))
    try:
        obj = load_json_object(raw, "the snapshot")
    except ValueError as exc:
        raise CheckpointError(_diag(path, "", str(exc))) from None
    return parse_snapshot(obj, path)


def parse_snapshot(obj: dict, path: str) -> SnapshotInventory:
    """A decoded snapshot object -> its SnapshotInventory, every field checked."""
    if obj.get("format") != FORMAT or obj.get("version") != VERSION:
        found = f"{json.dumps(obj.get('format'))} version {json.dumps(obj.get('version'))}"[:200]
        raise CheckpointError(_diag(path, "format", f"expected `\"format\": \"{FORMAT}\"` and `\"version\": "
                                    f"{VERSION}`, found {found}", "write it again with `remapdsl snapshot` of this remapdsl"))
    diags: list[Diagnostic] = []
    unknown = sorted(set(obj) - set(_FIELDS))
    missing = sorted(set(_FIELDS) - set(obj))
    if unknown or missing:
        diags.append(_diag(path, "", f"fields must be exactly {', '.join(_FIELDS)}"
                           f"{'; unknown ' + ', '.join(unknown) if unknown else ''}"
                           f"{'; missing ' + ', '.join(missing) if missing else ''}"))
    config, files, index_file = obj.get("config"), obj.get("files"), obj.get("index_file")
    ignored = obj.get("ignored_files", [])
    if not isinstance(config, dict):
        diags.append(_diag(path, "config", f"must be an object (config.json), found {_kind(config)}"))
    if index_file is not None and not (isinstance(index_file, str) and index_file.endswith(INDEX_SUFFIX)
                                       and "/" not in index_file and "\\" not in index_file):
        diags.append(_diag(path, "index_file", f"must be null or a file name ending in `{INDEX_SUFFIX}`"))
    if not (isinstance(ignored, list) and all(isinstance(n, str) and _unsafe_name(n) is None for n in ignored)):
        diags.append(_diag(path, "ignored_files", f"must be a list of `*{SUFFIX}` file names"))
    if not isinstance(files, dict) or not files:
        diags.append(_diag(path, "files", f"must be a non-empty object of file name to header, found {_kind(files)}"))
        files = {}
    tensors: dict = {}
    headers: dict = {}
    for name, entry in files.items():
        where = f"files[{json.dumps(name)}]"
        if why := _unsafe_name(name):
            diags.append(Diagnostic(code="E322", path=path, message=f"snapshot {where}: file name {why}"))
            continue
        info = _file_info(name, entry, where, path, diags)
        if info is None:
            continue
        try:
            header = parse_header_object(entry["header"], info=info, path=path)
        except CheckpointError as exc:
            prefix = f"{name}: "
            diags.extend(d.model_copy(update={"message": f"snapshot {where}.header: {d.message.removeprefix(prefix)}"})
                         for d in exc.diagnostics)
            continue
        headers[name] = header
    chunks: dict = {}
    if not diags and has_sharding_info(headers):  # a DCP-sharded folder: its keys are in several files
        made = assemble_chunked(headers, lambda name: path)
        tensors, chunks = made.tensors, made.chunks
        diags.extend(d.model_copy(update={"message": f"snapshot: {d.message}"}) for d in made.diagnostics)
    else:
        for name, header in headers.items():
            for ckpt_key, t in header.tensors.items():
                if ckpt_key in tensors:
                    diags.append(Diagnostic(code="E324", path=path, message=f"snapshot files[{json.dumps(name)}]"
                                            f".header: tensor `{ckpt_key}` is also in "
                                            f"files[{json.dumps(tensors[ckpt_key].file)}]"))
                tensors[ckpt_key] = t
    if diags:
        raise CheckpointError(diags)
    infos = {name: header.info for name, header in headers.items()}
    return SnapshotInventory(root=path, tensors=tensors, files=infos, ignored_files=tuple(ignored),
                             index_file=index_file, config=config, chunks=chunks)


def _file_info(name: str, entry: object, where: str, path: str, diags: list[Diagnostic]) -> FileInfo | None:
    """The FileInfo a snapshot's file entry gives (bounded sizes), or None after saying what is wrong."""
    if not isinstance(entry, dict) or tuple(sorted(entry)) != _FILE_FIELDS:
        diags.append(_diag(path, where, f"must be an object with exactly {', '.join(_FILE_FIELDS)}"))
        return None
    nbytes, data_offset, header = entry["nbytes"], entry["data_offset"], entry["header"]
    before = len(diags)
    if not (type(data_offset) is int and PREFIX_NBYTES <= data_offset <= PREFIX_NBYTES + MAX_HEADER_NBYTES):
        diags.append(_diag(path, f"{where}.data_offset", f"must be an integer from {PREFIX_NBYTES} to "
                           f"{PREFIX_NBYTES + MAX_HEADER_NBYTES} (8 + the header length), found {_kind(data_offset)}"))
    if not (type(nbytes) is int and 0 <= nbytes <= MAX_FILE_NBYTES):
        diags.append(_diag(path, f"{where}.nbytes", f"must be an integer from 0 to {MAX_FILE_NBYTES}, "
                           f"found {_kind(nbytes)}"))
    elif len(diags) == before and nbytes < data_offset:
        diags.append(_diag(path, f"{where}.nbytes", f"{nbytes} bytes end before the data section at {data_offset}"))
    if not isinstance(header, dict):
        diags.append(_diag(path, f"{where}.header", f"must be an object (the file's safetensors header), "
                           f"found {_kind(header)}"))
    return FileInfo(file=name, nbytes=nbytes, data_offset=data_offset) if len(diags) == before else None


def _kind(value: object) -> str:
    text = json.dumps(value, default=str)
    return f"`{text[:60]}{'…' if len(text) > 60 else ''}`"


def _diag(path: str, where: str, message: str, hint: str | None = None) -> Diagnostic:
    return Diagnostic(code="E330", path=path, hint=hint,
                      message=f"snapshot {where + ': ' if where else ''}{message}")
