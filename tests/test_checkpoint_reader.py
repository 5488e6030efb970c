"""CheckpointReader: positioned reads give exactly a tensor's bytes, into torch, numpy, bytearray memory."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remapdsl.checkpoint.inventory import Inventory, open_inventory
from remapdsl.checkpoint.reader import CheckpointReader, as_byte_view
from remapdsl.errors import CheckpointError


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def ckpt(tmp_path) -> tuple[Inventory, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "a.weight": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "a.fp8": torch.randn(4, 8, generator=gen).to(torch.float8_e4m3fn),
        "a.scale": torch.tensor(0.125),
        "a.empty": torch.zeros(0, 2),
        "b.ids": torch.arange(10, dtype=torch.int64),
        "b.mask": torch.tensor([True, False, True]),
    }
    save_file(dict(list(tensors.items())[:3]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[3:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    return open_inventory(tmp_path), tensors


def test_read_every_tensor_into_torch_memory(ckpt):
    inv, tensors = ckpt
    with CheckpointReader(inv) as reader:
        for ckpt_key, expected in tensors.items():
            out = torch.empty_like(expected)
            assert reader.read_tensor_into(ckpt_key, out) == inv.tensors[ckpt_key].nbytes
            assert tensor_bytes(out) == tensor_bytes(expected)
            assert bytes(reader.read_tensor(ckpt_key)) == tensor_bytes(expected)


def test_read_agrees_with_safe_open(ckpt):
    inv, _ = ckpt
    with CheckpointReader(inv) as reader:
        for name in inv.files:
            with safe_open(inv.path(name), framework="pt") as f:
                for ckpt_key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    assert bytes(reader.read_tensor(ckpt_key)) == tensor_bytes(f.get_tensor(ckpt_key))


def test_partial_reads_into_numpy_and_bytearray(ckpt):
    inv, tensors = ckpt
    whole = tensor_bytes(tensors["a.weight"])
    with CheckpointReader(inv) as reader:
        row = np.empty(7, dtype=np.uint16)
        reader.read_tensor_into("a.weight", row, start=2 * 14)  # row 2 of a [5, 7] bf16 tensor
        assert row.tobytes() == whole[28:42]
        assert torch.equal(torch.from_numpy(row).view(torch.bfloat16), tensors["a.weight"][2])
        tail = bytearray(5)
        reader.read_tensor_into("a.weight", tail, start=len(whole) - 5)
        assert bytes(tail) == whole[-5:]
        assert reader.read_tensor_into("a.weight", bytearray(), start=len(whole)) == 0
        grid = np.empty((2, 3), dtype=np.uint8)  # a multi-dim destination is filled in C order
        reader.read_tensor_into("a.fp8", grid, start=1)
        assert grid.tobytes() == tensor_bytes(tensors["a.fp8"])[1:7]


def test_one_read_may_span_adjacent_tensors(ckpt):
    inv, _ = ckpt
    name = "model-00001-of-00002.safetensors"
    info = inv.files[name]
    with open(inv.path(name), "rb") as f:
        blob = f.read()
    buf = bytearray(info.nbytes - info.data_offset)
    with CheckpointReader(inv) as reader:
        reader.read_into(name, info.data_offset, buf)
    assert bytes(buf) == blob[info.data_offset :]
    first, second = sorted((t for t in inv.tensors.values() if t.file == name), key=lambda t: t.byte_offset)[
        :2
    ]
    assert first.byte_end == second.byte_offset
    assert (
        bytes(buf[first.byte_offset - info.data_offset : second.byte_end - info.data_offset])
        == blob[first.byte_offset : second.byte_end]
    )


@pytest.mark.parametrize("sizes", [[70, 32, 4], [1] * 106, [3, 0, 50, 0, 53], [106]])
def test_one_file_range_scattered_over_many_buffers(ckpt, sizes):
    """A file range read with one call into consecutive buffers of any sizes, more than IOV_MAX
    of them included, lands byte for byte where a plain read of the range puts it."""
    inv, _ = ckpt
    name = "model-00001-of-00002.safetensors"
    info = inv.files[name]
    with open(inv.path(name), "rb") as f:
        blob = f.read()[info.data_offset:]
    assert sum(sizes) == len(blob) == 106
    with CheckpointReader(inv) as reader:
        buffers = [bytearray(n) for n in sizes]
        assert reader.scatter_into(name, info.data_offset, [memoryview(b) for b in buffers]) == 106
        assert b"".join(buffers) == blob
        many = [bytearray(1) for _ in range(107)]
        with pytest.raises(CheckpointError) as err:  # past the data section: refused before reading
            reader.scatter_into(name, info.data_offset, [memoryview(b) for b in many])
        assert err.value.diagnostic.code == "E340"
        offset = info.data_offset + 1
        pieces = [bytearray(1) for _ in range(105)]
        reader.scatter_into(name, offset, [memoryview(b) for b in pieces])
        assert b"".join(pieces) == blob[1:]


def test_scattered_reads_past_iov_max(tmp_path):
    save_file({"w": torch.arange(3000, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    inv = open_inventory(tmp_path)
    t = inv.tensors["w"]
    buffers = [bytearray(1) for _ in range(3000)]
    with CheckpointReader(inv) as reader:
        reader.scatter_into(t.file, t.byte_offset, [memoryview(b) for b in buffers])
    assert b"".join(buffers) == bytes(i % 256 for i in range(3000))


@pytest.mark.parametrize("start, nbytes", [(0, 71), (-1, 1), (70, 1), (71, 0)])
def test_reads_outside_the_tensor_are_refused(ckpt, start, nbytes):
    inv, _ = ckpt
    assert inv.tensors["a.weight"].nbytes == 70
    with CheckpointReader(inv) as reader, pytest.raises(CheckpointError) as err:
        reader.read_tensor_into("a.weight", bytearray(nbytes), start=start)
    diag = err.value.diagnostic
    assert (
        diag.code == "E340"
        and "`a.weight`" in diag.message
        and "model-00001-of-00002.safetensors" in diag.message
    )


def test_reads_outside_the_data_section_are_refused(ckpt):
    inv, _ = ckpt
    name = "model-00002-of-00002.safetensors"
    info = inv.files[name]
    with CheckpointReader(inv) as reader:
        for offset, nbytes in [
            (0, 8),
            (info.data_offset - 1, 2),
            (info.nbytes - 1, 2),
            (info.nbytes + 10, 0),
        ]:
            with pytest.raises(CheckpointError) as err:
                reader.read_into(name, offset, bytearray(nbytes))
            assert err.value.diagnostic.code == "E340" and name in err.value.diagnostic.message


def test_unknown_key_or_file(ckpt):
    inv, _ = ckpt
    with CheckpointReader(inv) as reader:
        with pytest.raises(CheckpointError) as err:
            reader.read_tensor_into("a.wieght", bytearray(1))
        assert err.value.diagnostic.code == "E341" and err.value.diagnostic.hint == "did you mean `a.weight`?"
        with pytest.raises(CheckpointError) as err:
            reader.read_into("model-00003-of-00003.safetensors", 100, bytearray(1))
        assert err.value.diagnostic.code == "E341"


def test_bad_destination_buffers(ckpt):
    inv, _ = ckpt
    with CheckpointReader(inv) as reader:
        with pytest.raises(ValueError):
            reader.read_tensor_into("a.weight", b"\0" * 4)
        with pytest.raises(ValueError):
            reader.read_tensor_into("a.weight", torch.empty(4, 4, dtype=torch.uint8).t())
        with pytest.raises(ValueError):
            reader.read_tensor_into("a.weight", np.empty((4, 4), dtype=np.uint8)[:, :2])
    assert as_byte_view(torch.empty(0, dtype=torch.bfloat16)).nbytes == 0
    assert as_byte_view(torch.empty(3, dtype=torch.bfloat16)).nbytes == 6


def test_a_file_that_changed_or_shrank_is_refused(ckpt):
    inv, _ = ckpt
    first, second = (inv.path(name) for name in inv.files)
    with CheckpointReader(inv) as reader:
        reader.read_tensor("b.ids")  # opens the second file
        os.truncate(second, inv.files["model-00002-of-00002.safetensors"].nbytes - 3)
        with pytest.raises(CheckpointError) as err:
            reader.read_tensor("b.mask")
        assert err.value.diagnostic.code == "E342"
        with open(first, "ab") as f:
            f.write(b"\0")
        with pytest.raises(CheckpointError) as err:
            reader.read_tensor("a.weight")
        assert err.value.diagnostic.code == "E342" and "model-00001-of-00002.safetensors" in str(err.value)


def test_reads_from_many_threads(ckpt):
    inv, tensors = ckpt
    jobs = [k for k in tensors for _ in range(20)]
    with CheckpointReader(inv) as reader, ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: bytes(reader.read_tensor(k)), jobs))
    assert got == [tensor_bytes(tensors[k]) for k in jobs]


def test_synthetic_inventory_has_no_files_to_read():
    inv = Inventory.from_shapes({"w": ("bfloat16", (2, 2))})
    with CheckpointReader(inv) as reader, pytest.raises(CheckpointError) as err:
        reader.read_tensor("w")
    assert err.value.diagnostic.code == "E301"


def test_scattered_reads_resume_after_short_reads(ckpt, monkeypatch):
    """preadv may return fewer bytes than asked (a signal, a slow device): the rest is read after,
    from where the short read stopped, in the middle of a buffer included."""
    from remapdsl.checkpoint import reader as module

    def at_most_5_bytes(fd, buffers, offset):
        first = buffers[0]
        return os.preadv(fd, [first[: min(5, first.nbytes)]], offset)

    monkeypatch.setattr(module, "_preadv_many", at_most_5_bytes)
    inv, _ = ckpt
    name = "model-00001-of-00002.safetensors"
    info = inv.files[name]
    with open(inv.path(name), "rb") as f:
        blob = f.read()[info.data_offset:]
    buffers = [bytearray(n) for n in (12, 0, 3, 91)]
    with CheckpointReader(inv) as reader:
        reader.scatter_into(name, info.data_offset, [memoryview(b) for b in buffers])
    assert b"".join(buffers) == blob
