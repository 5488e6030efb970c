"""One safetensors file's header: the file's first bytes -> a validated `Header` (key -> dtype, shape, bytes).

The format: an 8-byte little-endian header length n, n bytes of UTF-8 JSON, then the data section.
The JSON maps each tensor key to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to
the data section) plus an optional `"__metadata__"` of string to string. Only the header is read, never
tensor data. Every rule the safetensors library enforces is checked here too (tensors tile the data
section with no hole and no overlap; sizes match dtype and shape), plus a few it lets pass (unknown
fields, duplicate JSON keys), and every violation names the file and the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, field_validator, model_validator
from pydantic_core import CoreSchema

from remapdsl.dtypes import BY_NAME, BY_SAFETENSORS, DType
from remapdsl.errors import CheckpointError, Diagnostic, did_you_mean
from remapdsl.records import record_schema

MAX_HEADER_NBYTES = 100_000_000  # the safetensors library's own cap
PREFIX_NBYTES = 8
METADATA_KEY = "__metadata__"
_FIELDS = ("data_offsets", "dtype", "shape")
_FIELD_SET = frozenset(_FIELDS)


class FrozenDict(dict):
    """A dict that refuses mutation: pydantic, pickle and JSON see a plain dict, callers cannot edit it."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("checkpoint data is frozen")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (FrozenDict, (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo) -> FrozenDict:
        return self


def tensor_nbytes(dtype: DType, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of this header dtype and shape occupies, or None when not a whole number of bytes."""
    nbits = math.prod(shape) * dtype.bits
    return nbits // 8 if nbits % 8 == 0 else None


def is_shape(shape: object) -> bool:
    """Whether `shape` is a shape: a list or tuple of non-negative ints (a bool is not one)."""
    if type(shape) is not list and type(shape) is not tuple:
        return False
    for n in shape:
        if type(n) is not int or n < 0:
            return False
    return True


def tensor_problems(dtype: DType | None, shape: object, begin: object, end: object,
                    limit: int | None = None) -> tuple[str, ...]:
    """The rules of a safetensors tensor that these values break, () when they keep every one.

    Each rule is written once, here or in the two functions it calls (`is_shape`, `tensor_nbytes`),
    for every reader of tensor facts: the header parser, TensorInfo (`check_tensor_info`), and
    `Inventory.from_shapes` (which has no byte range yet: it applies those two). The caller has
    looked the dtype up (None: not known) and gives the tensor's bytes as [begin, end).

    - "dtype": the dtype is known;
    - "shape": the shape is a list or tuple of non-negative ints (`is_shape`);
    - "offsets": begin and end are ints with 0 <= begin <= end;
    - "bits": dtype x shape is a whole number of bytes (`tensor_nbytes`);
    - "bytes": [begin, end) holds exactly those bytes;
    - "limit": end is at most `limit` (the end of the data section), when one is given.

    The first three are reported together; the others only once those hold, one at a time.
    """
    dtype_ok, shape_ok = dtype is not None, is_shape(shape)
    offsets_ok = type(begin) is int and type(end) is int and 0 <= begin <= end
    if not (dtype_ok and shape_ok and offsets_ok):
        return tuple(rule for rule, ok in (("dtype", dtype_ok), ("shape", shape_ok), ("offsets", offsets_ok))
                     if not ok)
    nbytes = tensor_nbytes(dtype, shape)
    if nbytes is None:
        return ("bits",)
    if nbytes != end - begin:
        return ("bytes",)
    if limit is not None and end > limit:
        return ("limit",)
    return ()


class TensorInfo(NamedTuple):
    """Where one checkpoint tensor lives: its file, header dtype and shape, and its absolute byte range.

    `dtype` is a `remapdsl.dtypes` name (`bfloat16`, `float8_e4m3fn`), never a safetensors code.
    `shape` is the header shape, in elements as the header counts them (4-bit values for F4).
    `byte_offset` counts from the start of the file, not of the data section.

    A record, not a model: a DeepSeek-V3 checkpoint has 46,000-92,000 of them. One is made from
    values that passed the rules of `tensor_problems` (the header parser, `from_shapes`, the writer's
    `check_tensor_info`) or that were computed from such a record's (chunks, in-memory layouts). A pydantic model holding TensorInfos (Header,
    Inventory) takes a TensorInfo as it is, and checks one given as JSON or a dict with
    `check_tensor_info`; in JSON a TensorInfo is the list of its fields.
    """

    ckpt_key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def byte_end(self) -> int:
        """One past the tensor's last byte, from the start of the file."""
        return self.byte_offset + self.nbytes

    @classmethod
    def __get_pydantic_core_schema__(cls, source: type, handler: GetCoreSchemaHandler) -> CoreSchema:
        return record_schema(cls, source, handler, check_tensor_info)


def check_tensor_info(t: TensorInfo) -> TensorInfo:
    """`t` itself when its fields keep the rules of a tensor (`tensor_problems`); ValueError saying
    which one they break otherwise."""
    begin, nbytes = t.byte_offset, t.nbytes
    end = begin + nbytes if type(begin) is int and type(nbytes) is int else None
    broken = tensor_problems(BY_NAME.get(t.dtype) if type(t.dtype) is str else None, t.shape, begin, end)
    if not broken:
        return t
    if "dtype" in broken:
        raise ValueError(f"tensor `{t.ckpt_key}`: unknown dtype name `{t.dtype}`")
    if "shape" in broken or not (type(begin) is int and begin >= 0):
        raise ValueError(f"tensor `{t.ckpt_key}`: negative shape or offset")
    raise ValueError(f"tensor `{t.ckpt_key}`: {nbytes} bytes do not hold {t.dtype} {list(t.shape)}")


class FileInfo(BaseModel):
    """One safetensors file of a checkpoint: its size, where its data section starts, its metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str  # name relative to the checkpoint folder, `/`-separated
    nbytes: int  # size of the whole file
    data_offset: int  # first byte of the data section: 8 + header length
    metadata: dict[str, str] = Field(default_factory=FrozenDict)
    # the file's modification time when its header was read (None: no file behind it, as in a
    # synthetic inventory or a snapshot); the reader refuses the file if it changed since (E342)
    mtime_ns: int | None = None

    @field_validator("metadata", mode="after")
    @classmethod
    def _freeze(cls, value: dict[str, str]) -> dict[str, str]:
        return FrozenDict(value)

    def _described(self) -> tuple:
        return self.file, self.nbytes, self.data_offset, self.metadata

    def __eq__(self, other: object) -> bool:
        """Equal when they describe the same file layout: `mtime_ns` is when one was looked at (a
        snapshot, or another node's copy, of the same file compares equal)."""
        if not isinstance(other, FileInfo):
            return NotImplemented
        return self._described() == other._described()

    def __hash__(self) -> int:
        return hash(self._described())

    @model_validator(mode="after")
    def _check(self) -> FileInfo:
        """The data section starts after the 8-byte length and the header, or at 0 in a file that has
        no header (an in-memory inventory's, `checkpoint.memory`), and within the file."""
        if not (PREFIX_NBYTES <= self.data_offset or self.data_offset == 0) or self.data_offset > self.nbytes:
            raise ValueError(
                f"{self.file}: data section starts at {self.data_offset} in a {self.nbytes}-byte file"
            )
        return self


class Header(BaseModel):
    """A parsed, validated safetensors header: the file's facts and its tensors, sorted by key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    info: FileInfo
    tensors: dict[str, TensorInfo]

    @field_validator("tensors", mode="after")
    @classmethod
    def _freeze(cls, value: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        return FrozenDict(value)


class _DuplicateKey(Exception):
    def __init__(self, name: str):
        self.name = name


class DuplicateJsonKey(ValueError):
    """A JSON object names one key twice; `json` would silently keep the last one."""


def _pairs_without_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateKey(name)
            seen.add(name)
    return out


def _reject_constant(name: str) -> object:
    raise ValueError(f"`{name}` is not JSON")


def load_json_object(text: bytes, what: str) -> dict:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, an object. Raises ValueError with a reason."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(
            decoded, object_pairs_hook=_pairs_without_duplicates, parse_constant=_reject_constant
        )
    except _DuplicateKey as exc:
        raise DuplicateJsonKey(f"{what} names `{exc.name}` twice") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a JSON {type(value).__name__}, expected an object")
    return value


def pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    """Exactly nbytes from offset, or fewer when the file ends first."""
    chunks = []
    while nbytes > 0:
        chunk = os.pread(fd, nbytes, offset)
        if not chunk:
            break
        chunks.append(chunk)
        nbytes -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def hash_header(path: str | os.PathLike[str], data_offset: int) -> str:
    """sha256 of a file's first `data_offset` bytes (the 8-byte length and the header JSON) as this
    process reads them now; never data. Ranks with their own copies compare these (E410): a copy of
    the same size whose header says other things (tensors of one shape swapped, a stale copy) differs.

    Raises:
        OSError: the file cannot be opened or read.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        return hashlib.sha256(pread_exact(fd, data_offset, 0)).hexdigest()
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike[str], *, file: str | None = None) -> Header:
    """Read and validate the header of one safetensors file; no tensor data is read.

    Args:
        path: the file (a symlink is followed; its target must be a regular file).
        file: the name recorded in each TensorInfo, relative to the checkpoint folder; default the
            file's base name.

    Raises:
        CheckpointError: every problem found in the header at once (codes E301-E314).
    """
    path = os.fspath(path)
    name = file if file is not None else os.path.basename(path)

    def fail(code: str, message: str, hint: str | None = None) -> CheckpointError:
        return CheckpointError(Diagnostic(code=code, message=f"{name}: {message}", path=path, hint=hint))

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise fail("E301", f"cannot open the file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail("E301", "is not a regular file", "a symlink must point at a regular file")
        size = st.st_size
        prefix = pread_exact(fd, PREFIX_NBYTES, 0)
        if len(prefix) < PREFIX_NBYTES:
            raise fail("E302", f"file has {size} bytes, too short for the 8-byte header length")
        (header_nbytes,) = struct.unpack("<Q", prefix)
        if header_nbytes > MAX_HEADER_NBYTES:
            raise fail("E303", f"header length {header_nbytes} exceeds the {MAX_HEADER_NBYTES}-byte cap")
        if header_nbytes > size - PREFIX_NBYTES:
            raise fail(
                "E303", f"header length {header_nbytes} is larger than the rest of the {size}-byte file"
            )
        raw = pread_exact(fd, header_nbytes, PREFIX_NBYTES)
    finally:
        os.close(fd)
    try:
        obj = load_json_object(raw, "the header")
    except DuplicateJsonKey as exc:
        raise fail("E314", str(exc)) from None
    except ValueError as exc:
        raise fail("E304", str(exc)) from None
    info = FileInfo(file=name, nbytes=size, data_offset=PREFIX_NBYTES + header_nbytes, mtime_ns=st.st_mtime_ns)
    return parse_header_object(obj, info=info, path=path)


def parse_header_object(obj: dict, *, info: FileInfo, path: str | None = None) -> Header:
    """Validate a decoded header JSON object against the file it came from (size, data offset)."""
    diags: list[Diagnostic] = []
    data_nbytes = info.nbytes - info.data_offset

    def report(code: str, message: str, hint: str | None = None) -> None:
        diags.append(Diagnostic(code=code, message=f"{info.file}: {message}", path=path, hint=hint))

    metadata = obj.get(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        report("E313", f"`{METADATA_KEY}` must map strings to strings, found {json.dumps(metadata)[:200]}")
        metadata = {}
    ranges: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorInfo] = {}
    file, data_offset = info.file, info.data_offset
    for ckpt_key in sorted(k for k in obj if k != METADATA_KEY):
        found = _entry(ckpt_key, obj[ckpt_key], data_nbytes, report)
        if found is not None:
            dtype, shape, begin, end = found
            ranges.append((begin, end, ckpt_key))
            tensors[ckpt_key] = TensorInfo(ckpt_key, file, dtype.name, shape, data_offset + begin, end - begin)
    all_valid = len(tensors) == len(obj) - (METADATA_KEY in obj)
    for code, message in _coverage_problems(ranges, data_nbytes, check_holes=all_valid):
        report(code, message, "safetensors requires the tensors to tile the data section exactly")
    if diags:
        raise CheckpointError(diags)
    file_info = FileInfo(file=info.file, nbytes=info.nbytes, data_offset=info.data_offset, metadata=metadata,
                         mtime_ns=info.mtime_ns)
    return Header(info=file_info, tensors=tensors)


def _entry(ckpt_key: str, entry: object, data_nbytes: int, report) -> tuple | None:
    """(dtype, shape, begin, end) of one header entry, or None after reporting what is wrong: its
    JSON form here (an object of exactly dtype, shape, data_offsets), the tensor's own rules in
    `tensor_problems`."""
    if type(entry) is not dict or entry.keys() != _FIELD_SET:
        _wrong_form(ckpt_key, entry, report)
        return None
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    dtype = BY_SAFETENSORS.get(code) if type(code) is str else None
    begin, end = offsets if type(offsets) is list and len(offsets) == 2 else (None, None)
    broken = tensor_problems(dtype, shape, begin, end, data_nbytes)
    if not broken:
        return dtype, tuple(shape), begin, end
    where = f"tensor `{ckpt_key}`"
    if "dtype" in broken:
        if isinstance(code, str) and code in BY_NAME:
            hint = f"`{code}` is the torch name; its safetensors code is `{BY_NAME[code].safetensors}`"
        else:
            hint = did_you_mean(str(code), BY_SAFETENSORS) or f"known: {', '.join(BY_SAFETENSORS)}"
        report("E306", f"{where}: dtype {json.dumps(code)} is not a safetensors dtype", hint)
    if "shape" in broken:
        report("E307", f"{where}: shape {json.dumps(shape)} must be a list of non-negative integers")
    if "offsets" in broken:
        report("E308", f"{where}: data_offsets {json.dumps(offsets)} must be [begin, end] with 0 <= begin <= end")
    if "bits" in broken:
        report("E309", f"{where}: {code} {shape} is {math.prod(shape) * dtype.bits} bits, not a whole number of bytes")
    if "bytes" in broken:
        report("E309", f"{where}: {code} {shape} needs {tensor_nbytes(dtype, shape)} bytes, "
               f"data_offsets [{begin}, {end}] hold {end - begin}")
    if "limit" in broken:
        report("E310", f"{where}: data_offsets [{begin}, {end}] run past the {data_nbytes}-byte data section",
               "the file may be truncated")
    return None


def _wrong_form(ckpt_key: str, entry: object, report) -> None:
    """E305: a header entry that is not an object of exactly dtype, shape and data_offsets."""
    where = f"tensor `{ckpt_key}`"
    if not isinstance(entry, dict):
        report("E305", f"{where}: entry is a JSON {type(entry).__name__}, expected an object")
        return
    missing = [f for f in _FIELDS if f not in entry]
    extra = sorted(f for f in entry if f not in _FIELDS)
    what = "; ".join(p for p in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if p)
    report("E305", f"{where}: entry must have exactly dtype, shape, data_offsets ({what})")


def _coverage_problems(
    ranges: list[tuple[int, int, str]], data_nbytes: int, *, check_holes: bool
) -> Iterator[tuple[str, str]]:
    """Overlaps (always) and holes or trailing bytes (when every entry was valid) in the data section."""
    cursor, last = 0, None
    for begin, end, ckpt_key in sorted(ranges):
        if begin < cursor:
            yield "E311", f"tensor `{ckpt_key}` [{begin}, {end}) overlaps tensor `{last}` (ends at {cursor})"
        elif begin > cursor and check_holes:
            after = f"after tensor `{last}`" if last is not None else "at the start of the data section"
            yield "E312", f"{begin - cursor} unused bytes {after}, before tensor `{ckpt_key}` at {begin}"
        if end >= cursor:
            cursor, last = end, ckpt_key
    if check_holes and cursor < data_nbytes:
        after = f"after tensor `{last}`" if last is not None else "in a file with no tensors"
        yield "E312", f"{data_nbytes - cursor} trailing bytes {after}: no tensor covers them"
