"""Header validation (remapdsl/checkpoint/header.py), as the mutation run found it untested: the whole
message and hint of every header error (the suite checked the code, the file and the key), the
wording that depends on where a hole lies, and the small frozen types a header is made of. Files are
written byte by byte, as a broken or hostile writer would leave them."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import struct

import pytest

from pydantic import ValidationError

from remapdsl.checkpoint.header import (FileInfo, FrozenDict, Header, TensorInfo, check_tensor_info, hash_header,
                                         pread_exact, read_header)
from remapdsl.errors import CheckpointError

TILE = "safetensors requires the tensors to tile the data section exactly"


def _entry(dtype, shape, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _write(path, header: object, data: bytes = b"") -> str:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def _problems(path: str) -> list[tuple]:
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert all(d.path == path for d in info.value.diagnostics)
    return [(d.code, d.message.removeprefix("s.safetensors: "), d.hint) for d in info.value.diagnostics]


ENTRIES = [
    # (header, data, code, message after the file name, hint)
    ({"w": [1, 2]}, b"", "E305", "tensor `w`: entry is a JSON list, expected an object", None),
    ({"w": [1, 2, 3]}, b"", "E305", "tensor `w`: entry is a JSON list, expected an object", None),
    ({"w": 5}, b"", "E305", "tensor `w`: entry is a JSON int, expected an object", None),
    ({"w": {"dtype": "U8", "shape": [1]}}, b"\0", "E305",
     "tensor `w`: entry must have exactly dtype, shape, data_offsets (missing ['data_offsets'])", None),
    ({"w": _entry("U8", [1], 0, 1) | {"crc": 1, "a": 2}}, b"\0", "E305",
     "tensor `w`: entry must have exactly dtype, shape, data_offsets (unknown ['a', 'crc'])", None),
    ({"w": {"dtype": "U8", "data_offsets": [0, 1], "crc": 1}}, b"\0", "E305",
     "tensor `w`: entry must have exactly dtype, shape, data_offsets (missing ['shape']; unknown ['crc'])", None),
    ({"w": _entry("F8_E4M4", [1], 0, 1)}, b"\0", "E306", 'tensor `w`: dtype "F8_E4M4" is not a safetensors dtype',
     "did you mean `F8_E4M3`?"),
    ({"w": _entry("float32", [1], 0, 4)}, b"\0" * 4, "E306", 'tensor `w`: dtype "float32" is not a safetensors dtype',
     "`float32` is the torch name; its safetensors code is `F32`"),
    ({"w": _entry("U8", [-1], 0, 0)}, b"", "E307", "tensor `w`: shape [-1] must be a list of non-negative integers",
     None),
    ({"w": _entry("U8", [True], 0, 1)}, b"\0", "E307",
     "tensor `w`: shape [true] must be a list of non-negative integers", None),
    ({"w": _entry("U8", [1], 1, 0)}, b"\0", "E308",
     "tensor `w`: data_offsets [1, 0] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0", "E308",
     "tensor `w`: data_offsets [0, 1, 2] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": _entry("U8", [0], -1, -1)}, b"", "E308",
     "tensor `w`: data_offsets [-1, -1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": _entry("U8", [1], True, 1)}, b"\0", "E308",
     "tensor `w`: data_offsets [true, 1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": _entry("F32", [2], 0, 4)}, b"\0" * 4, "E309", "tensor `w`: F32 [2] needs 8 bytes, data_offsets [0, 4] hold 4",
     None),
    ({"a": _entry("U8", [4], 0, 4), "w": _entry("F32", [2], 4, 8)}, b"\0" * 8, "E309",
     "tensor `w`: F32 [2] needs 8 bytes, data_offsets [4, 8] hold 4", None),
    ({"w": _entry("U8", [8], 0, 1)}, b"\0", "E309", "tensor `w`: U8 [8] needs 8 bytes, data_offsets [0, 1] hold 1", None),
    ({"w": _entry("U8", [9], 0, 8)}, b"\0" * 8, "E309", "tensor `w`: U8 [9] needs 9 bytes, data_offsets [0, 8] hold 8",
     None),
    ({"a": _entry("U8", [1], 0, 1), "w": _entry("U8", [4], 1, 3)}, b"\0" * 3, "E309",
     "tensor `w`: U8 [4] needs 4 bytes, data_offsets [1, 3] hold 2", None),
    ({"w": _entry("U8", [1], 0.0, 1)}, b"\0", "E308",
     "tensor `w`: data_offsets [0.0, 1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": _entry("U8", [1], 0, 1.0)}, b"\0", "E308",
     "tensor `w`: data_offsets [0, 1.0] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": {"dtype": "U8", "shape": [1], "data_offsets": 5}}, b"\0", "E308",
     "tensor `w`: data_offsets 5 must be [begin, end] with 0 <= begin <= end", None),
    ({"w": _entry("F4", [3], 0, 2)}, b"\0" * 2, "E309", "tensor `w`: F4 [3] is 12 bits, not a whole number of bytes",
     None),
    ({"w": _entry("U8", [4], 0, 4)}, b"\0" * 3, "E310",
     "tensor `w`: data_offsets [0, 4] run past the 3-byte data section", "the file may be truncated"),
    ({"a": _entry("U8", [2], 0, 2), "w": _entry("U8", [2], 2, 4)}, b"\0" * 3, "E310",
     "tensor `w`: data_offsets [2, 4] run past the 3-byte data section", "the file may be truncated"),
    ({"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [2], 2, 4)}, b"\0" * 4, "E311",
     "tensor `b` [2, 4) overlaps tensor `a` (ends at 4)", TILE),
    ({"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 3, 5)}, b"\0" * 5, "E312",
     "1 unused bytes after tensor `a`, before tensor `b` at 3", TILE),
    ({"b": _entry("U8", [2], 2, 4)}, b"\0" * 4, "E312",
     "2 unused bytes at the start of the data section, before tensor `b` at 2", TILE),
    ({"a": _entry("U8", [2], 0, 2)}, b"\0" * 3, "E312", "1 trailing bytes after tensor `a`: no tensor covers them", TILE),
    ({}, b"\0" * 2, "E312", "2 trailing bytes in a file with no tensors: no tensor covers them", TILE),
    ({"__metadata__": {"format": 1}, "a": _entry("U8", [1], 0, 1)}, b"\0", "E313",
     '`__metadata__` must map strings to strings, found {"format": 1}', None),
    ({"__metadata__": ["pt"]}, b"", "E313", '`__metadata__` must map strings to strings, found ["pt"]', None),
    ({"__metadata__": ["x" * 300]}, b"", "E313",
     '`__metadata__` must map strings to strings, found ' + ('["' + "x" * 300)[:200], None),
    ({"__metadata__": {"a": "b"}, "a": _entry("U8", [2], 0, 2)}, b"\0" * 3, "E312",
     "1 trailing bytes after tensor `a`: no tensor covers them", TILE),
    ({"a": _entry("U8", [2], 0, 2), "z": _entry("U8", [0], 2, 2), "b": _entry("U8", [2], 3, 5)}, b"\0" * 5, "E312",
     "1 unused bytes after tensor `z`, before tensor `b` at 3", TILE),
]


@pytest.mark.parametrize("header, data, code, message, hint", ENTRIES)
def test_each_header_error_says_exactly_what_is_wrong(tmp_path, header, data, code, message, hint):
    assert _problems(_write(tmp_path / "s.safetensors", header, data)) == [(code, message, hint)]


def test_overlaps_are_reported_even_when_another_entry_is_invalid_but_holes_are_not(tmp_path):
    """A hole next to an entry that is itself wrong is no news; an overlap of two valid ones is."""
    header = {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [2], 2, 4), "c": _entry("U8", [1], 8, 9),
              "d": _entry("X9", [1], 9, 10)}
    assert _problems(_write(tmp_path / "s.safetensors", header, b"\0" * 10)) == [
        ("E306", 'tensor `d`: dtype "X9" is not a safetensors dtype', "known: " + _known_codes()),
        ("E311", "tensor `b` [2, 4) overlaps tensor `a` (ends at 4)", TILE)]


def _known_codes() -> str:
    from remapdsl.dtypes import BY_SAFETENSORS

    return ", ".join(BY_SAFETENSORS)


def test_an_overlap_inside_a_longer_tensor_keeps_measuring_from_the_longer_end(tmp_path):
    """`z` [1, 2) lies inside `a` [0, 4); `b` [3, 5) then overlaps `a`, not `z`, which ended first."""
    header = {"a": _entry("U8", [4], 0, 4), "z": _entry("U8", [1], 1, 2), "b": _entry("U8", [2], 3, 5)}
    assert [m for _, m, _ in _problems(_write(tmp_path / "s.safetensors", header, b"\0" * 5))] == [
        "tensor `z` [1, 2) overlaps tensor `a` (ends at 4)", "tensor `b` [3, 5) overlaps tensor `a` (ends at 4)"]


@pytest.mark.parametrize("blob, code, message", [
    (b"\x05\0\0", "E302", "file has 3 bytes, too short for the 8-byte header length"),
    (struct.pack("<Q", 100) + b"{}", "E303", "header length 100 is larger than the rest of the 10-byte file"),
    (struct.pack("<Q", 3) + b"{}", "E303", "header length 3 is larger than the rest of the 10-byte file"),
    (struct.pack("<Q", 100_000_000) + b"{}", "E303", "header length 100000000 is larger than the rest of the 10-byte file"),
    (struct.pack("<Q", 100_000_001) + b"{}", "E303", "header length 100000001 exceeds the 100000000-byte cap"),
    (b"\xff" * 8 + b"{}", "E303", "header length 18446744073709551615 exceeds the 100000000-byte cap"),
    (struct.pack("<Q", 3) + b"{}\0", "E304", "the header is not valid JSON (Extra data at line 1 column 3)"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "E304", "the header is not UTF-8 (invalid start byte at byte 0)"),
    (struct.pack("<Q", 2) + b"[]", "E304", "the header is a JSON list, expected an object"),
    (struct.pack("<Q", 28) + b'{"__metadata__": {"a": NaN}}', "E304", "the header is not valid JSON (`NaN` is not JSON)"),
    (struct.pack("<Q", 40) + b'{"w": {"dtype": "U8", "dtype": "U8"}}   ', "E314", "the header names `dtype` twice"),
    (struct.pack("<Q", 48) + b'{"w": {"shape": [1], "dtype": "U8", "dtype": 1}}', "E314",
     "the header names `dtype` twice"),
])
def test_each_prefix_and_json_error_says_exactly_what_is_wrong(tmp_path, blob, code, message):
    path = tmp_path / "s.safetensors"
    path.write_bytes(blob)
    assert _problems(str(path)) == [(code, message, None)]


def test_a_header_entry_with_offsets_in_the_data_section_reads_back_where_the_bytes_are(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "a": _entry("U8", [2], 0, 2), "b": _entry("I16", [1, 2], 2, 6)}
    path = _write(tmp_path / "s.safetensors", header, bytes(range(6)))
    read = read_header(path, file="sub/s.safetensors")
    start = 8 + len(json.dumps(header).encode())
    assert read.info == FileInfo(file="sub/s.safetensors", nbytes=start + 6, data_offset=start,
                                 metadata={"format": "pt"})
    assert read.info.mtime_ns == os.stat(path).st_mtime_ns
    assert [(t.ckpt_key, t.file, t.dtype, t.shape, t.byte_offset, t.nbytes, t.byte_end, t.numel)
            for t in read.tensors.values()] == [
        ("a", "sub/s.safetensors", "uint8", (2,), start, 2, start + 2, 2),
        ("b", "sub/s.safetensors", "int16", (1, 2), start + 2, 4, start + 6, 2)]
    assert hash_header(path, start) == hashlib.sha256((tmp_path / "s.safetensors").read_bytes()[:start]).hexdigest()


def test_pread_exact_reads_on_across_short_reads_and_stops_at_the_end(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(10)))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_exact(fd, 4, 3) == bytes([3, 4, 5, 6])
        assert pread_exact(fd, 20, 7) == bytes([7, 8, 9])
        assert pread_exact(fd, 0, 0) == b""
        assert pread_exact(fd, 1, 2) == b"\x02"
    finally:
        os.close(fd)


GOOD_ROW = {"ckpt_key": "k", "file": "f", "dtype": "bfloat16", "shape": (2, 2), "byte_offset": 0, "nbytes": 8}


@pytest.mark.parametrize("fields, message", [
    ({"dtype": "bf16"}, "tensor `k`: unknown dtype name `bf16`"),
    ({"shape": (2, -1)}, "tensor `k`: negative shape or offset"),
    ({"byte_offset": -1}, "tensor `k`: negative shape or offset"),
    ({"nbytes": 6}, "tensor `k`: 6 bytes do not hold bfloat16 [2, 2]"),
])
def test_tensor_info_says_which_invariant_a_row_breaks(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_tensor_info(TensorInfo(**(GOOD_ROW | fields)))
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Header(info=FileInfo(file="f", nbytes=16, data_offset=8), tensors={"k": GOOD_ROW | fields})  # as JSON
    scalar = TensorInfo(ckpt_key="k", file="f", dtype="bfloat16", shape=(), byte_offset=0, nbytes=2)
    empty = TensorInfo(ckpt_key="k", file="f", dtype="bfloat16", shape=(0, 3), byte_offset=0, nbytes=0)
    assert check_tensor_info(scalar) is scalar and check_tensor_info(empty) is empty


def test_file_info_checks_where_its_data_section_starts():
    FileInfo(file="f", nbytes=8, data_offset=8)
    FileInfo(file="f", nbytes=8, data_offset=0)  # no header: an in-memory inventory's file
    for nbytes, data_offset in ((10, 7), (10, 1), (10, 11), (0, 8)):
        with pytest.raises(ValueError, match=f"f: data section starts at {data_offset} in a {nbytes}-byte file"):
            FileInfo(file="f", nbytes=nbytes, data_offset=data_offset)


def test_file_infos_compare_and_hash_by_layout_not_by_when_they_were_read():
    a = FileInfo(file="f", nbytes=10, data_offset=8, metadata={"k": "v"}, mtime_ns=1)
    b = FileInfo(file="f", nbytes=10, data_offset=8, metadata={"k": "v"}, mtime_ns=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert hash(a) != hash(FileInfo(file="g", nbytes=10, data_offset=8, metadata={"k": "v"}))  # spread, not constant
    assert a != FileInfo(file="f", nbytes=10, data_offset=9, metadata={"k": "v"})
    assert a != FileInfo(file="g", nbytes=10, data_offset=8, metadata={"k": "v"})
    assert a != FileInfo(file="f", nbytes=10, data_offset=8)
    assert (a == "f") is False
    with pytest.raises(TypeError, match="^checkpoint data is frozen$"):
        a.metadata["k"] = "w"


def test_a_frozen_dict_refuses_every_edit_and_copies_as_itself():
    d = FrozenDict({"a": 1})
    for edit in (lambda: d.__setitem__("b", 2), lambda: d.__delitem__("a"), d.clear, lambda: d.pop("a"), d.popitem,
                 lambda: d.setdefault("b", 2), lambda: d.update(b=2)):
        with pytest.raises(TypeError, match="^checkpoint data is frozen$"):
            edit()
    assert d == {"a": 1} and copy.copy(d) is d and copy.deepcopy(d) is d
    assert hash(d) == hash(FrozenDict({"a": 1})) != hash(FrozenDict({"a": 2}))
    again = pickle.loads(pickle.dumps(d))
    assert type(again) is FrozenDict and again == d


def test_a_dtype_that_is_a_json_list_is_e306_not_a_crash(tmp_path):
    path = _write(tmp_path / "s.safetensors", {"w": _entry([1], [1], 0, 1)}, b"\0")
    assert _problems(path) == [("E306", "tensor `w`: dtype [1] is not a safetensors dtype", "known: " + _known_codes())]


def test_hashing_a_header_never_waits_on_a_fifo(tmp_path):
    """A path that is a named pipe (a checkpoint file replaced under a running job) is opened
    without blocking, no writer needed, and refused at once as OSError (a pipe cannot be read
    at an offset), which the callers report as the file they could not read."""
    import errno
    import threading

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(hash_header(fifo, 16))
        except OSError as exc:
            outcome.append(exc.errno)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    finished_alone = bool(outcome)
    if not finished_alone:  # blocked in open: let it through before failing
        os.close(os.open(fifo, os.O_RDWR))
        reader.join(5)
    assert finished_alone and outcome == [errno.ESPIPE]


def test_a_folder_in_place_of_a_file_is_e301_with_its_hint(tmp_path):
    folder = tmp_path / "model.safetensors"
    folder.mkdir()
    with pytest.raises(CheckpointError) as info:
        read_header(folder)
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E301", "model.safetensors: is not a regular file",
                                           "a symlink must point at a regular file")


def test_a_missing_file_is_e301_saying_why_it_cannot_be_opened(tmp_path):
    with pytest.raises(CheckpointError) as info:
        read_header(tmp_path / "s.safetensors")
    d = info.value.diagnostic
    assert (d.code, d.message, d.path) == ("E301", "s.safetensors: cannot open the file (No such file or directory)",
                                           str(tmp_path / "s.safetensors"))
