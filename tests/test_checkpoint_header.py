"""read_header against the safetensors library, and one hand-made malformed file per validation rule:
each error's whole message and hint (the wording that depends on where a hole lies included), and
the small frozen types a header is made of. Files are written byte by byte, as a broken or hostile
writer would leave them."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import struct
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from remapdsl.checkpoint.header import (
    MAX_HEADER_NBYTES,
    FileInfo,
    FrozenDict,
    Header,
    TensorInfo,
    check_tensor_info,
    tensor_problems,
    hash_header,
    pread_exact,
    read_header,
    tensor_nbytes,
)
from remapdsl.dtypes import BY_NAME, BY_SAFETENSORS, DTYPES
from remapdsl.errors import CheckpointError

TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Deterministic bytes of any dtype, as a tensor of that dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: torch.Size(shape).numel() * size].view(dtype).reshape(shape).clone()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_raw(path, header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> str:
    """A safetensors-like file from a header object (or raw header bytes) and a data section."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def assert_matches_library(path: str) -> None:
    """Every parsed field agrees with safe_open, and each byte range holds that tensor's bytes."""
    header = read_header(path)
    with open(path, "rb") as f:
        blob = f.read()
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == list(header.tensors)
        assert (f.metadata() or {}) == header.info.metadata
        for ckpt_key, info in header.tensors.items():
            view = f.get_slice(ckpt_key)
            assert BY_NAME[info.dtype].safetensors == view.get_dtype()
            assert list(info.shape) == view.get_shape()
            data = blob[info.byte_offset : info.byte_end]
            assert len(data) == info.nbytes
            if BY_NAME[info.dtype].safetensors in ("F6_E2M3", "F6_E3M2", "F4"):
                continue  # no torch dtype to decode through safe_open here
            assert data == tensor_bytes(f.get_tensor(ckpt_key))
    assert header.info.nbytes == len(blob)
    assert header.info.data_offset == 8 + struct.unpack("<Q", blob[:8])[0]


def test_dtype_table_is_complete_and_consistent():
    codes = {
        "BOOL",
        "F4",
        "F6_E2M3",
        "F6_E3M2",
        "U8",
        "I8",
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "I16",
        "U16",
        "F16",
        "BF16",
        "I32",
        "U32",
        "F32",
        "C64",
        "F64",
        "I64",
        "U64",
    }
    assert set(BY_SAFETENSORS) == codes and len(DTYPES) == len(codes) == len(BY_NAME)
    for dtype in DTYPES:
        torch_dtype = getattr(torch, dtype.name, None)
        if torch_dtype is not None and dtype.bits >= 8:
            assert torch.empty((), dtype=torch_dtype).element_size() * 8 == dtype.bits


def test_every_torch_dtype_with_zero_dim_and_empty_tensors(tmp_path):
    tensors = {f"t.{str(d).split('.')[-1]}": make_tensor(d, (3, 2), i) for i, d in enumerate(TORCH_DTYPES)}
    tensors["scalar.f32"] = torch.tensor(2.5)
    tensors["scalar.fp8"] = make_tensor(torch.float8_e4m3fn, ())
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["empty.fp8"] = torch.zeros(5, 0, dtype=torch.float8_e4m3fn)
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt", "note": "x"})
    assert_matches_library(path)
    header = read_header(path)
    assert header.tensors["scalar.fp8"].shape == () and header.tensors["scalar.fp8"].nbytes == 1
    assert header.tensors["t.float8_e4m3fn"].dtype == "float8_e4m3fn"
    assert header.tensors["empty"].nbytes == 0 and header.tensors["empty"].shape == (0, 4)
    assert header.info.metadata == {"format": "pt", "note": "x"}
    assert header.tensors["t.float32"].file == "model.safetensors"


def test_f4_header_counts_four_bit_elements(tmp_path):
    packed = make_tensor(torch.uint8, (3, 4)).view(torch.float4_e2m1fn_x2)
    path = str(tmp_path / "f4.safetensors")
    save_file({"w": packed}, path)
    info = read_header(path).tensors["w"]
    assert (info.dtype, info.shape, info.nbytes) == ("float4_e2m1fn_x2", (3, 8), 12)
    assert_matches_library(path)
    with open(path, "rb") as f:
        assert f.read()[info.byte_offset : info.byte_end] == tensor_bytes(packed.view(torch.uint8))


def test_sub_byte_sizes():
    f4, f6 = BY_SAFETENSORS["F4"], BY_SAFETENSORS["F6_E2M3"]
    assert (
        tensor_nbytes(f4, (3, 2)) == 3 and tensor_nbytes(f4, (3,)) is None and tensor_nbytes(f4, ()) is None
    )
    assert tensor_nbytes(f6, (4,)) == 3 and tensor_nbytes(f6, (2,)) is None and tensor_nbytes(f4, (0,)) == 0


def test_hand_written_sub_byte_and_unknown_to_torch_dtypes_agree_with_library(tmp_path):
    header = {
        "a": entry("F6_E2M3", [4], 0, 3),
        "b": entry("F4", [2, 3], 3, 6),
        "c": entry("F6_E3M2", [0], 6, 6),
    }
    path = write_raw(tmp_path / "x.safetensors", header, bytes(6))
    assert_matches_library(path)
    assert read_header(path).tensors["a"].dtype == "float6_e2m3fn"


def test_empty_header_is_a_valid_file(tmp_path):
    header = read_header(write_raw(tmp_path / "e.safetensors", {}))
    assert header.tensors == {} and header.info.metadata == {}


def test_header_data_is_frozen_and_round_trips(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.ones(2)}, path, metadata={"k": "v"})
    header = read_header(path)
    with pytest.raises(TypeError):
        header.tensors["b"] = header.tensors["a"]
    with pytest.raises(TypeError):
        header.info.metadata["k"] = "w"
    with pytest.raises(AttributeError):  # a named tuple
        header.tensors["a"].nbytes = 4
    assert pickle.loads(pickle.dumps(header)) == header
    assert type(header).model_validate_json(header.model_dump_json()) == header
    hash(header)


def test_tensor_info_is_checked_by_the_one_function_of_the_tensor_rules():
    good = {"ckpt_key": "a", "file": "f", "dtype": "bfloat16", "shape": (2,), "byte_offset": 8, "nbytes": 4}
    assert check_tensor_info(TensorInfo(**good)) == TensorInfo(**good)
    for bad in ({"nbytes": 3}, {"dtype": "BF16"}, {"shape": (-2,), "nbytes": -4}, {"nbytes": -4},
                {"shape": (2.0,)}, {"byte_offset": -8}):
        with pytest.raises(ValueError):
            check_tensor_info(TensorInfo(**(good | bad)))
        if bad != {"shape": (2.0,)}:  # as a dict, pydantic reads 2.0 as the int 2 first
            with pytest.raises(ValidationError):  # a model holding one given as a dict checks it
                Header(info=FileInfo(file="f", nbytes=12, data_offset=8), tensors={"a": good | bad})
    with pytest.raises(TypeError):
        TensorInfo(**(good | {"extra": 1}))


def test_inconsistent_bytes_are_refused_by_the_rules_the_header_parser_uses():
    bf16, f4 = BY_NAME["bfloat16"], BY_NAME["float4_e2m1fn_x2"]
    assert tensor_problems(bf16, (2, 3), 8, 20) == ()
    assert tensor_problems(bf16, [2, 3], 8, 19) == ("bytes",)  # 11 bytes do not hold 6 bfloat16
    assert tensor_problems(f4, (3,), 0, 2) == ("bits",)
    assert tensor_problems(bf16, (2, 3), 8, 20, limit=16) == ("limit",)
    assert tensor_problems(None, (-1,), 4, 2) == ("dtype", "shape", "offsets")  # reported together
    assert tensor_problems(bf16, (True,), 0, 2) == ("shape",) and tensor_problems(bf16, (1,), 0.0, 2) == ("offsets",)
    with pytest.raises(ValueError, match=r"^tensor `w`: 11 bytes do not hold bfloat16 \[2, 3\]$"):
        check_tensor_info(TensorInfo("w", "f", "bfloat16", (2, 3), 8, 11))


# --- malformed files: one per rule; each error names the file and the key --------------------------------

MALFORMED = [
    # (id, code, header object, data, the key the message must name)
    ("entry-not-object", "E305", {"w": [1, 2]}, b"", "w"),
    ("missing-field", "E305", {"w": {"dtype": "U8", "shape": [1]}}, b"\0", "w"),
    ("extra-field", "E305", {"w": entry("U8", [1], 0, 1) | {"crc": 1}}, b"\0", "w"),
    ("unknown-dtype", "E306", {"w": entry("F8_E4M4", [1], 0, 1)}, b"\0", "w"),
    ("dtype-not-string", "E306", {"w": entry(8, [1], 0, 1)}, b"\0", "w"),
    ("torch-name-as-dtype", "E306", {"w": entry("float32", [1], 0, 4)}, b"\0" * 4, "w"),
    ("negative-dim", "E307", {"w": entry("U8", [-1], 0, 0)}, b"", "w"),
    ("float-dim", "E307", {"w": entry("U8", [1.0], 0, 1)}, b"\0", "w"),
    ("bool-dim", "E307", {"w": entry("U8", [True], 0, 1)}, b"\0", "w"),
    ("shape-not-list", "E307", {"w": entry("U8", 3, 0, 3)}, b"\0" * 3, "w"),
    ("offsets-reversed", "E308", {"w": entry("U8", [1], 1, 0)}, b"\0", "w"),
    ("offsets-three", "E308", {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0", "w"),
    ("offsets-negative", "E308", {"w": entry("U8", [0], -1, -1)}, b"", "w"),
    ("size-mismatch", "E309", {"w": entry("F32", [2], 0, 4)}, b"\0" * 4, "w"),
    ("f4-not-whole-bytes", "E309", {"w": entry("F4", [3], 0, 2)}, b"\0" * 2, "w"),
    ("past-data-section", "E310", {"w": entry("U8", [4], 0, 4)}, b"\0" * 3, "w"),
    ("overlap", "E311", {"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 2, 4)}, b"\0" * 4, "b"),
    ("zero-size-inside", "E311", {"a": entry("U8", [4], 0, 4), "z": entry("U8", [0], 2, 2)}, b"\0" * 4, "z"),
    ("hole", "E312", {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, b"\0" * 5, "b"),
    ("trailing-bytes", "E312", {"a": entry("U8", [2], 0, 2)}, b"\0" * 3, "a"),
    (
        "metadata-int",
        "E313",
        {"__metadata__": {"format": 1}, "a": entry("U8", [1], 0, 1)},
        b"\0",
        "__metadata__",
    ),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_header_is_rejected_with_file_and_key(tmp_path, case):
    _, code, header, data, ckpt_key = case
    path = write_raw(tmp_path / "shard-1.safetensors", header, data)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    diag = err.value.diagnostic
    assert diag.code == code, str(err.value)
    assert diag.path == path
    assert "shard-1.safetensors" in diag.message and f"`{ckpt_key}`" in diag.message
    assert path in str(err.value)


@pytest.mark.parametrize(
    "case", [c for c in MALFORMED if c[1] in ("E309", "E310", "E311", "E312", "E313")], ids=lambda c: c[0]
)
def test_library_also_refuses_what_we_refuse(tmp_path, case):
    path = write_raw(tmp_path / "x.safetensors", case[2], case[3])
    with pytest.raises(SafetensorError), safe_open(path, framework="pt") as f:
        list(f.keys())


RAW = [
    ("too-short", "E302", b"\x05\0\0"),
    ("length-past-file", "E303", struct.pack("<Q", 100) + b"{}"),
    ("length-over-cap", "E303", struct.pack("<Q", MAX_HEADER_NBYTES + 1) + b"{}"),
    ("not-utf8", "E304", struct.pack("<Q", 2) + b"\xff\xfe"),
    ("not-json", "E304", struct.pack("<Q", 3) + b"{a}"),
    ("empty-header", "E304", struct.pack("<Q", 0)),
    ("json-list", "E304", struct.pack("<Q", 2) + b"[]"),
    ("nan", "E304", struct.pack("<Q", 28) + b'{"__metadata__": {"a": NaN}}'),
    ("duplicate-key", "E314", None),
]


@pytest.mark.parametrize("case", RAW, ids=[c[0] for c in RAW])
def test_malformed_prefix_or_json_is_rejected(tmp_path, case):
    _, code, blob = case
    path = str(tmp_path / "bad.safetensors")
    if blob is None:
        text = b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "w": {}}'
        blob = struct.pack("<Q", len(text)) + text + b"\0"
    with open(path, "wb") as f:
        f.write(blob)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert err.value.diagnostic.code == code, str(err.value)
    assert "bad.safetensors" in err.value.diagnostic.message
    if code == "E314":
        assert "`w`" in err.value.diagnostic.message


def test_header_padding_with_spaces_is_fine(tmp_path):
    text = json.dumps({"w": entry("U8", [2], 0, 2)}).encode() + b"   "
    header = read_header(write_raw(tmp_path / "p.safetensors", None, b"ab", raw_header=text))
    assert header.tensors["w"].byte_offset == 8 + len(text)


def test_not_a_regular_file_and_missing_file(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    for name in ("dir.safetensors", "missing.safetensors"):
        with pytest.raises(CheckpointError) as err:
            read_header(tmp_path / name)
        assert err.value.diagnostic.code == "E301" and name in err.value.diagnostic.message
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError) as err:
        read_header(fifo)
    assert err.value.diagnostic.code == "E301"


def test_all_problems_of_a_header_are_reported_at_once(tmp_path):
    header = {
        "a": entry("U9", [1], 0, 1),
        "b": entry("U8", [-1], 1, 2),
        "c": entry("F32", [1], 2, 3),
        "__metadata__": {"x": []},
    }
    with pytest.raises(CheckpointError) as err:
        read_header(write_raw(tmp_path / "m.safetensors", header, b"\0" * 3))
    found = sorted((d.code, d.message.split("`")[1]) for d in err.value.diagnostics)
    assert found == [("E306", "a"), ("E307", "b"), ("E309", "c"), ("E313", "__metadata__")]


# --- property: the parser agrees with safetensors on random tensor sets ------------------------------------

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
tensor_sets = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}(\.[a-z0-9_]{1,5}){0,2}", fullmatch=True),
    st.tuples(st.sampled_from(TORCH_DTYPES), shapes),
    min_size=0,
    max_size=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_parser_agrees_with_safetensors(spec, metadata):
    tensors = {k: make_tensor(dtype, shape, i) for i, (k, (dtype, shape)) in enumerate(spec.items())}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file(tensors, path, metadata=metadata or None)
        assert_matches_library(path)
        header = read_header(path)
        for k, t in tensors.items():
            assert header.tensors[k].shape == tuple(t.shape)
            assert BY_NAME[header.tensors[k].dtype] == BY_NAME[str(t.dtype).removeprefix("torch.")]


# --- each error's whole message and hint; the frozen types ------------------------------------------------

TILE = "safetensors requires the tensors to tile the data section exactly"


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
    ({"w": entry("U8", [1], 0, 1) | {"crc": 1, "a": 2}}, b"\0", "E305",
     "tensor `w`: entry must have exactly dtype, shape, data_offsets (unknown ['a', 'crc'])", None),
    ({"w": {"dtype": "U8", "data_offsets": [0, 1], "crc": 1}}, b"\0", "E305",
     "tensor `w`: entry must have exactly dtype, shape, data_offsets (missing ['shape']; unknown ['crc'])", None),
    ({"w": entry("F8_E4M4", [1], 0, 1)}, b"\0", "E306", 'tensor `w`: dtype "F8_E4M4" is not a safetensors dtype',
     "did you mean `F8_E4M3`?"),
    ({"w": entry("float32", [1], 0, 4)}, b"\0" * 4, "E306", 'tensor `w`: dtype "float32" is not a safetensors dtype',
     "`float32` is the torch name; its safetensors code is `F32`"),
    ({"w": entry("U8", [-1], 0, 0)}, b"", "E307", "tensor `w`: shape [-1] must be a list of non-negative integers",
     None),
    ({"w": entry("U8", [True], 0, 1)}, b"\0", "E307",
     "tensor `w`: shape [true] must be a list of non-negative integers", None),
    ({"w": entry("U8", [1], 1, 0)}, b"\0", "E308",
     "tensor `w`: data_offsets [1, 0] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0", "E308",
     "tensor `w`: data_offsets [0, 1, 2] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": entry("U8", [0], -1, -1)}, b"", "E308",
     "tensor `w`: data_offsets [-1, -1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": entry("U8", [1], True, 1)}, b"\0", "E308",
     "tensor `w`: data_offsets [true, 1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": entry("F32", [2], 0, 4)}, b"\0" * 4, "E309", "tensor `w`: F32 [2] needs 8 bytes, data_offsets [0, 4] hold 4",
     None),
    ({"a": entry("U8", [4], 0, 4), "w": entry("F32", [2], 4, 8)}, b"\0" * 8, "E309",
     "tensor `w`: F32 [2] needs 8 bytes, data_offsets [4, 8] hold 4", None),
    ({"w": entry("U8", [8], 0, 1)}, b"\0", "E309", "tensor `w`: U8 [8] needs 8 bytes, data_offsets [0, 1] hold 1", None),
    ({"w": entry("U8", [9], 0, 8)}, b"\0" * 8, "E309", "tensor `w`: U8 [9] needs 9 bytes, data_offsets [0, 8] hold 8",
     None),
    ({"a": entry("U8", [1], 0, 1), "w": entry("U8", [4], 1, 3)}, b"\0" * 3, "E309",
     "tensor `w`: U8 [4] needs 4 bytes, data_offsets [1, 3] hold 2", None),
    ({"w": entry("U8", [1], 0.0, 1)}, b"\0", "E308",
     "tensor `w`: data_offsets [0.0, 1] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": entry("U8", [1], 0, 1.0)}, b"\0", "E308",
     "tensor `w`: data_offsets [0, 1.0] must be [begin, end] with 0 <= begin <= end", None),
    ({"w": {"dtype": "U8", "shape": [1], "data_offsets": 5}}, b"\0", "E308",
     "tensor `w`: data_offsets 5 must be [begin, end] with 0 <= begin <= end", None),
    ({"w": entry("F4", [3], 0, 2)}, b"\0" * 2, "E309", "tensor `w`: F4 [3] is 12 bits, not a whole number of bytes",
     None),
    ({"w": entry("U8", [4], 0, 4)}, b"\0" * 3, "E310",
     "tensor `w`: data_offsets [0, 4] run past the 3-byte data section", "the file may be truncated"),
    ({"a": entry("U8", [2], 0, 2), "w": entry("U8", [2], 2, 4)}, b"\0" * 3, "E310",
     "tensor `w`: data_offsets [2, 4] run past the 3-byte data section", "the file may be truncated"),
    ({"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 2, 4)}, b"\0" * 4, "E311",
     "tensor `b` [2, 4) overlaps tensor `a` (ends at 4)", TILE),
    ({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, b"\0" * 5, "E312",
     "1 unused bytes after tensor `a`, before tensor `b` at 3", TILE),
    ({"b": entry("U8", [2], 2, 4)}, b"\0" * 4, "E312",
     "2 unused bytes at the start of the data section, before tensor `b` at 2", TILE),
    ({"a": entry("U8", [2], 0, 2)}, b"\0" * 3, "E312", "1 trailing bytes after tensor `a`: no tensor covers them", TILE),
    ({}, b"\0" * 2, "E312", "2 trailing bytes in a file with no tensors: no tensor covers them", TILE),
    ({"__metadata__": {"format": 1}, "a": entry("U8", [1], 0, 1)}, b"\0", "E313",
     '`__metadata__` must map strings to strings, found {"format": 1}', None),
    ({"__metadata__": ["pt"]}, b"", "E313", '`__metadata__` must map strings to strings, found ["pt"]', None),
    ({"__metadata__": ["x" * 300]}, b"", "E313",
     '`__metadata__` must map strings to strings, found ' + ('["' + "x" * 300)[:200], None),
    ({"__metadata__": {"a": "b"}, "a": entry("U8", [2], 0, 2)}, b"\0" * 3, "E312",
     "1 trailing bytes after tensor `a`: no tensor covers them", TILE),
    ({"a": entry("U8", [2], 0, 2), "z": entry("U8", [0], 2, 2), "b": entry("U8", [2], 3, 5)}, b"\0" * 5, "E312",
     "1 unused bytes after tensor `z`, before tensor `b` at 3", TILE),
]


@pytest.mark.parametrize("header, data, code, message, hint", ENTRIES)
def test_each_header_error_says_exactly_what_is_wrong(tmp_path, header, data, code, message, hint):
    assert _problems(write_raw(tmp_path / "s.safetensors", header, data)) == [(code, message, hint)]


def test_overlaps_are_reported_even_when_another_entry_is_invalid_but_holes_are_not(tmp_path):
    """A hole next to an entry that is itself wrong is no news; an overlap of two valid ones is."""
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 2, 4), "c": entry("U8", [1], 8, 9),
              "d": entry("X9", [1], 9, 10)}
    assert _problems(write_raw(tmp_path / "s.safetensors", header, b"\0" * 10)) == [
        ("E306", 'tensor `d`: dtype "X9" is not a safetensors dtype', "known: " + _known_codes()),
        ("E311", "tensor `b` [2, 4) overlaps tensor `a` (ends at 4)", TILE)]


def _known_codes() -> str:
    from remapdsl.dtypes import BY_SAFETENSORS

    return ", ".join(BY_SAFETENSORS)


def test_an_overlap_inside_a_longer_tensor_keeps_measuring_from_the_longer_end(tmp_path):
    """`z` [1, 2) lies inside `a` [0, 4); `b` [3, 5) then overlaps `a`, not `z`, which ended first."""
    header = {"a": entry("U8", [4], 0, 4), "z": entry("U8", [1], 1, 2), "b": entry("U8", [2], 3, 5)}
    assert [m for _, m, _ in _problems(write_raw(tmp_path / "s.safetensors", header, b"\0" * 5))] == [
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
    header = {"__metadata__": {"format": "pt"}, "a": entry("U8", [2], 0, 2), "b": entry("I16", [1, 2], 2, 6)}
    path = write_raw(tmp_path / "s.safetensors", header, bytes(range(6)))
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
    path = write_raw(tmp_path / "s.safetensors", {"w": entry([1], [1], 0, 1)}, b"\0")
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
