"""Checkpoint tensors held in memory, read as a checkpoint's files are: for `remapdsl.ingest`.

`in_memory` lays a checkpoint's tensors out one to a file, each file its tensor's bytes alone
(data from offset 0), so a plan made against it addresses each tensor by its own offsets;
MemoryReader serves those reads from buffers (the `(key, tensor)` pairs a stream delivers) with
the reader's own code paths (positioned reads become copies, the mapped file is the buffer).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..trusted import construct
from .header import FileInfo, FrozenDict, TensorInfo
from .inventory import Inventory
from .reader import CheckpointReader, as_byte_view


def in_memory(layout: Inventory) -> Inventory:
    """`layout`'s tensors (keys, dtypes, shapes), each alone in a file named by its key."""
    tensors, files = {}, {}
    for key, t in layout.tensors.items():
        tensors[key] = TensorInfo(ckpt_key=key, file=key, dtype=t.dtype, shape=tuple(t.shape), byte_offset=0,
                                  nbytes=t.nbytes)
        # no header: the data from byte 0 (checked data would want a safetensors header first)
        files[key] = construct(FileInfo, file=key, nbytes=t.nbytes, data_offset=0, metadata=FrozenDict())
    return construct(Inventory, root="<memory>", tensors=FrozenDict(sorted(tensors.items())),
                     files=FrozenDict(sorted(files.items())))


class MemoryReader(CheckpointReader):
    """Reads of an `in_memory` inventory, from `buffers` (checkpoint key -> its bytes: anything
    with the buffer protocol, a contiguous CPU tensor's `as_byte_view`)."""

    def __init__(self, inventory: Inventory, buffers: Mapping[str, object]):
        super().__init__(inventory)
        self.buffers = {key: as_byte_view(b) for key, b in buffers.items()}

    def mapped(self, file: str):
        return self.buffers[file]

    def _pread_into(self, file: str, view: memoryview, byte_offset: int) -> None:
        view[:] = self.buffers[file][byte_offset:byte_offset + view.nbytes]

    def _read_fully(self, file: str, buffers: list[memoryview], first: int, total: int) -> None:
        at = first
        for b in buffers:
            self._pread_into(file, b, at)
            at += b.nbytes

    def close(self) -> None:
        self.buffers = {}
