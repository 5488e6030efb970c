"""A checkpoint folder's headers (and index) -> `Inventory`: each checkpoint key's file, dtype, shape, bytes.
An index, where there is one, is authoritative; only headers are read; all problems are raised at once."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from remapdsl.checkpoint.chunks import Chunk, ChunkTable, _diag, assemble_chunked, has_sharding_info
from remapdsl.checkpoint.header import (
    MAX_HEADER_NBYTES,
    PREFIX_NBYTES,
    FileInfo,
    FrozenDict,
    Header,
    TensorInfo,
    is_shape,
    load_json_object,
    read_header,
    tensor_nbytes,
)
from remapdsl.dtypes import BY_NAME, BY_SAFETENSORS
from remapdsl.errors import MAX_SHOWN, CheckpointError, Diagnostic, RemapError, did_you_mean

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX = "model.safetensors.index.json"


class Inventory(BaseModel):
    """Every tensor of one checkpoint, from headers alone, sorted by key (`files` by name); file names are
    relative to `root`, `/`-separated; dtypes are `remapdsl.dtypes` names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str  # absolute path of the checkpoint folder
    tensors: dict[str, TensorInfo]
    files: dict[str, FileInfo]  # the files read, with each one's `__metadata__`
    ignored_files: tuple[str, ...] = ()  # `.safetensors` files in root that the index does not name
    index_file: str | None = None  # the index used, relative to root
    # keys stored in pieces over several files (DCP-sharded), key -> ChunkTable sorted by offsets; their
    # `tensors` entry has the whole shape and bytes and names the first chunk. Empty for most checkpoints.
    chunks: dict[str, tuple[Chunk, ...]] = FrozenDict()

    @field_validator("tensors", "files", mode="after")
    @classmethod
    def _freeze(cls, value: dict) -> dict:
        return FrozenDict(sorted(value.items()))

    @field_validator("chunks", mode="after")
    @classmethod
    def _tables(cls, value: dict) -> dict:
        return FrozenDict(sorted((key, ChunkTable(chunks)) for key, chunks in value.items()))

    @model_validator(mode="after")
    def _check(self) -> Inventory:
        """Each tensor (a chunked one: each chunk) is filed under its key inside a file's data section."""
        files, chunks = self.files, self.chunks
        for name, info in files.items():
            if info.file != name:
                raise ValueError(f"file entry `{name}` describes `{info.file}`")
        for ckpt_key, t in self.tensors.items():
            info = files.get(t.file)
            if t.ckpt_key != ckpt_key or info is None:
                raise ValueError(f"tensor entry `{ckpt_key}` ({t.ckpt_key} in {t.file}) does not fit the files")
            if (t.byte_offset < info.data_offset or t.byte_offset + t.nbytes > info.nbytes) and ckpt_key not in chunks:
                raise ValueError(f"tensor `{ckpt_key}` lies outside the data section of {t.file}")
        for ckpt_key, pieces in chunks.items():
            t = self.tensors.get(ckpt_key)
            if t is None or any(c.file not in files for c in pieces):
                raise ValueError(f"chunks of `{ckpt_key}` do not fit the tensors and files")
            for c in pieces:
                info = files[c.file]
                if c.byte_offset < info.data_offset or c.byte_offset + c.nbytes(t.dtype) > info.nbytes:
                    raise ValueError(f"a chunk of `{ckpt_key}` lies outside the data section of {c.file}")
        return self

    def __reduce__(self):
        """Pickled as columns (rank 0 sends it to every rank), a subclass's own fields beside them."""
        columns = tuple(map(list, zip(*self.tensors.values()))) or tuple([] for _ in TensorInfo._fields)
        extra = {name: getattr(self, name) for name in type(self).model_fields if name not in Inventory.model_fields}
        return _from_columns, (type(self), self.root, dict(self.files), self.ignored_files, self.index_file,
                               columns, dict(self.chunks), extra)

    def restamped(self, checkpoint: str | os.PathLike[str] | None = None) -> Inventory:
        """This inventory at `checkpoint` (default its root), each file's modification time as seen here."""
        root = self.root
        if checkpoint is not None:
            path = os.path.abspath(os.fspath(checkpoint))
            root = path if os.path.isdir(path) else os.path.dirname(path)
        files = {}
        for name, info in self.files.items():
            if info.mtime_ns is None:
                files[name] = info
                continue
            try:
                mtime_ns = os.stat(os.path.join(root, *name.split("/"))).st_mtime_ns
            except OSError:
                mtime_ns = info.mtime_ns
            files[name] = info if mtime_ns == info.mtime_ns else info.model_copy(update={"mtime_ns": mtime_ns})
        return self.model_copy(update={"root": root, "files": FrozenDict(files)})

    @property
    def metadata(self) -> dict[str, dict[str, str]]:
        """Each file's `__metadata__`, by file name."""
        return {name: info.metadata for name, info in self.files.items()}

    def stored(self, ckpt_key: str) -> tuple[Chunk, ...]:
        """Where a tensor's bytes lie: its chunks (DCP-sharded), else one chunk, the whole tensor."""
        chunks = self.chunks.get(ckpt_key)
        if chunks is not None:
            return chunks
        t = self.tensors[ckpt_key]
        return (Chunk(t.file, t.byte_offset, (0,) * len(t.shape), tuple(t.shape)),)

    def path(self, file: str) -> str:
        """The absolute path of one of the inventory's files."""
        return os.path.join(self.root, *file.split("/"))

    @classmethod
    def from_shapes(cls, entries: Mapping[str, tuple[str, Sequence[int]]], *, root: str = "/synthetic",
                    file: str = "model.safetensors") -> Inventory:
        """A synthetic inventory: one file holding `entries` (ckpt_key -> (dtype, shape)) back to back in key
        order, no file on disk. A dtype may be a `remapdsl.dtypes` name or a safetensors code.

        Raises:
            CheckpointError: unknown dtypes and bad shapes (E306, E307, E309), all at once.
        """
        diags: list[Diagnostic] = []
        tensors: dict[str, TensorInfo] = {}
        offset = PREFIX_NBYTES
        for ckpt_key in sorted(entries):
            dtype_name, shape = entries[ckpt_key]
            dtype = BY_NAME.get(dtype_name) or BY_SAFETENSORS.get(dtype_name)
            shape = tuple(shape)
            if dtype is None:  # the rules of header.tensor_problems, one by one: no byte range yet
                diags.append(_diag("E306", f"tensor `{ckpt_key}`: unknown dtype `{dtype_name}`", root,
                                   did_you_mean(str(dtype_name), [*BY_NAME, *BY_SAFETENSORS])))
            elif not is_shape(shape):
                diags.append(_diag("E307", f"tensor `{ckpt_key}`: shape {list(shape)} is not non-negative ints", root))
            elif (nbytes := tensor_nbytes(dtype, shape)) is None:
                diags.append(_diag("E309", f"tensor `{ckpt_key}`: {dtype.name} {list(shape)} is not whole bytes", root))
            else:
                tensors[ckpt_key] = TensorInfo(ckpt_key, file, dtype.name, shape, offset, nbytes)
                offset += nbytes
        if diags:
            raise CheckpointError(diags)
        info = FileInfo(file=file, nbytes=offset, data_offset=PREFIX_NBYTES)
        return cls(root=root, tensors=tensors, files={file: info})


def _from_columns(cls, root, files, ignored_files, index_file, columns, chunks, extra) -> Inventory:
    """An inventory unpickled (`Inventory.__reduce__`): its records remade from their columns."""
    tensors = dict(zip(columns[0], map(TensorInfo._make, zip(*columns))))
    return cls(root=root, tensors=tensors, files=files, ignored_files=ignored_files, index_file=index_file,
               chunks=chunks, **extra)


def open_inventory(path: str | os.PathLike[str]) -> Inventory:
    """Read the headers of a checkpoint into an Inventory; no tensor data is read.

    Args:
        path: a checkpoint folder; or an index file (`*.safetensors.index.json`), to pick one of
            several; or a single `.safetensors` file (then nothing else in its folder is looked at).

    Raises:
        CheckpointError: every problem of the folder, index and headers at once (codes E301-E327; for
            a DCP-sharded folder, chunks that do not tile a tensor: E350-E354).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        root, index_file = path, _find_index(path)
    elif path.endswith(INDEX_SUFFIX) and os.path.isfile(path):
        root, index_file = os.path.dirname(path), os.path.basename(path)
    elif path.endswith(SUFFIX) and os.path.isfile(path):
        return _assemble(os.path.dirname(path), [os.path.basename(path)])
    elif not os.path.exists(path):
        raise CheckpointError(_diag("E301", "no such file or folder", path))
    else:
        raise CheckpointError(_diag("E320", "not a checkpoint: expected a folder, an index file or a "
                                    ".safetensors file", path))
    present = _safetensors_in(root)
    if index_file is None:
        if not present:
            raise CheckpointError(_diag("E320", f"no `{DEFAULT_INDEX}` and no `*{SUFFIX}` file in the folder", root,
                                        "point at the folder that holds the model's safetensors files"))
        return _assemble(root, present)
    weight_map = _read_index(root, index_file)
    named = set(weight_map.values())
    return _assemble(root, sorted(named), index_file, weight_map, tuple(n for n in present if n not in named))


def listing(path: str | os.PathLike[str]) -> list:
    """What identifies a checkpoint without opening it: its folder's name, its files' names and sizes."""
    path = os.path.abspath(os.fspath(path))
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        names = [os.path.basename(path)] if path.endswith(SUFFIX) else _safetensors_in(folder)
        sizes = [[name, os.stat(os.path.join(folder, name)).st_size] for name in names]
    except OSError:
        sizes = []  # reading the headers reports it
    return [os.path.basename(folder), sizes]


def _safetensors_in(root: str) -> list[str]:
    """Names of the `*.safetensors` entries directly in root (symlinks included, checked when read)."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if e.name.endswith(SUFFIX))


def _find_index(root: str) -> str | None:
    with os.scandir(root) as entries:
        found = sorted(e.name for e in entries if e.name.endswith(INDEX_SUFFIX))
    if DEFAULT_INDEX in found:
        return DEFAULT_INDEX
    if len(found) > 1:
        raise CheckpointError(_diag("E327", f"{len(found)} index files and none is `{DEFAULT_INDEX}`: "
                                    f"{', '.join(found)}", root, "open the index file you mean instead of the folder"))
    return found[0] if found else None


def _read_index(root: str, index_file: str) -> dict[str, str]:
    """The index's weight_map (ckpt_key -> file), with every file name checked to stay inside root."""
    path = os.path.join(root, index_file)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_HEADER_NBYTES + 1)
    except OSError as exc:
        raise CheckpointError(_diag("E301", f"{index_file}: cannot read the index ({exc.strerror})", path)) from None
    if len(raw) > MAX_HEADER_NBYTES:
        raise CheckpointError(_diag("E321", f"{index_file}: index is larger than {MAX_HEADER_NBYTES} bytes", path))
    try:
        index = load_json_object(raw, "the index")
    except ValueError as exc:
        raise CheckpointError(_diag("E321", f"{index_file}: {exc}", path)) from None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(_diag("E321", f"{index_file}: expected a non-empty object `weight_map` of tensor "
                                    "key to file name", path))
    diags = [_diag("E321", f"{index_file}: tensor `{ckpt_key}` maps to {name!r}, not a file name", path)
             for ckpt_key, name in weight_map.items() if not isinstance(name, str)]
    diags.extend(_diag("E322", f"{index_file}: file name `{name}` (for tensor `{ckpt_key}`) {why}", path,
                       "index file names must be relative names inside the checkpoint folder")
                 for name, ckpt_key in _first_key_per_file(weight_map).items() if (why := _unsafe_name(name)))
    if diags:
        raise CheckpointError(diags)
    return weight_map


def _first_key_per_file(weight_map: Mapping[str, object]) -> dict[str, str]:
    seen: dict[str, str] = {}
    for ckpt_key, name in weight_map.items():
        if isinstance(name, str):  # others are reported as not file names (E321)
            seen.setdefault(name, ckpt_key)
    return seen


def _unsafe_name(name: str) -> str | None:
    """Why a file name from an index could escape the folder or mean something else elsewhere, or None."""
    if not name:
        return "is empty"
    if "\\" in name or "\0" in name or ":" in name.split("/")[0]:
        return "contains a backslash, NUL or drive letter"
    if name.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, `.` or `..` component"
    if not name.endswith(SUFFIX):
        return f"does not end in `{SUFFIX}`"
    return None


def _assemble(root: str, files: list[str], index_file: str | None = None,
              weight_map: dict[str, str] | None = None, ignored: tuple[str, ...] = ()) -> Inventory:
    """Read every file's header and cross-check keys between files and against the index."""
    diags: list[Diagnostic] = []
    headers: dict[str, Header] = {}
    users = _first_key_per_file(weight_map) if weight_map is not None else {}
    for name in files:
        path = os.path.join(root, *name.split("/"))
        if name in users and not os.path.lexists(path):
            diags.append(_diag("E301", f"{index_file} names {name} (for tensor `{users[name]}` and maybe more), "
                               "which does not exist", path))
            continue
        try:
            headers[name] = read_header(path, file=name)
        except CheckpointError as exc:
            diags.extend(exc.diagnostics)
    files = {name: header.info for name, header in headers.items()}
    if not diags and weight_map is None and has_sharding_info(headers):  # DCP's writer: tensors of chunks
        made = assemble_chunked(headers, lambda name: os.path.join(root, *name.split("/")))
        if made.diagnostics:
            raise CheckpointError(made.diagnostics)
        return Inventory(root=root, tensors=made.tensors, files=files, ignored_files=ignored,
                         chunks=made.chunks)
    where: dict[str, list[str]] = {}
    for name, header in headers.items():
        for ckpt_key in header.tensors:
            where.setdefault(ckpt_key, []).append(name)
    for ckpt_key, names in where.items():
        if len(names) > 1:
            hint = "add a model.safetensors.index.json or remove the stray file" if weight_map is None else None
            diags.append(_diag("E324", f"tensor `{ckpt_key}` is in {len(names)} files: {', '.join(names)}",
                               os.path.join(root, names[1]), hint))
        elif weight_map is not None and weight_map.get(ckpt_key) != names[0]:
            assigned = weight_map.get(ckpt_key)
            said = f"assigns it to {assigned}" if assigned is not None else "does not list it"
            diags.append(_diag("E326", f"tensor `{ckpt_key}` is in {names[0]}, but {index_file} {said}",
                               os.path.join(root, names[0])))
    if weight_map is not None:
        for ckpt_key, name in weight_map.items():
            # A key found in another file was reported above (E324 or E326); here only keys found nowhere.
            if name in headers and ckpt_key not in where:
                # Hints cost a fuzzy search over the file's keys: only for the errors that will be shown.
                hint = did_you_mean(ckpt_key, headers[name].tensors) if len(diags) < MAX_SHOWN else None
                diags.append(_diag("E325", f"{index_file} assigns tensor `{ckpt_key}` to {name}, which does not "
                                   "hold it", os.path.join(root, index_file), hint))
    if diags:
        raise CheckpointError(diags)
    tensors = {k: t for header in headers.values() for k, t in header.tensors.items()}
    return Inventory(root=root, tensors=tensors, files=files, ignored_files=ignored, index_file=index_file)


def read_config(inventory: Inventory) -> dict[str, Any]:
    """The model config next to a checkpoint (config.json), or {} when there is none."""
    return read_config_file(Path(inventory.root) / "config.json")


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json as a dict, or {} when there is no such file (E212 when it cannot be read)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RemapError(Diagnostic(code="E212", message=f"cannot read the model config: {exc}",
                                    path=str(path))) from None
