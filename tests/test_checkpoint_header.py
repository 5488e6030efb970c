"""read_header against the safetensors library, and one hand-made malformed file per validation rule."""

from __future__ import annotations

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

from remapdsl.checkpoint.header import (MAX_HEADER_NBYTES, FileInfo, Header, TensorInfo, check_tensor_info,
                                         read_header, tensor_nbytes, tensor_problems)
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
