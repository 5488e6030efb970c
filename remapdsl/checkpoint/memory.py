"""Checkpoint tensors held in memory, read as a checkpoint's files are (for `remapdsl.ingest`): one tensor
to a file from offset 0, a plan's positioned reads become copies."""

from __future__ import annotations

from collections.abc import Mapping

from .header import FileInfo, TensorInfo
from .inventory import Inventory
from .reader import CheckpointReader, as_byte_view


def in_memory(layout: Inventory) -> Inventory:
    """`layout`'s tensors (keys, dtypes, shapes), each alone in a file named by its key."""
    tensors, files = {}, {}
    for key, t in layout.tensors.items():
        tensors[key] = TensorInfo(key, key, t.dtype, t.shape, 0, t.nbytes)
        files[key] = FileInfo(file=key, nbytes=t.nbytes, data_offset=0)  # no header: the data from byte 0
    return Inventory(root="<memory>", tensors=tensors, files=files)


class MemoryReader(CheckpointReader):
    """Reads of an `in_memory` inventory from `buffers` (checkpoint key -> its bytes)."""

    def __init__(self, inventory: Inventory, buffers: Mapping[str, object]):
        super().__init__(inventory)
        self.buffers = {key: as_byte_view(b) for key, b in buffers.items()}

    def mapped(self, file: str):
        return self.buffers[file]

    def _read_fully(self, file: str, buffers: list[memoryview], first: int, total: int) -> None:
        for b in buffers:
            b[:] = self.buffers[file][first:first + b.nbytes]
            first += b.nbytes

    def close(self) -> None:
        self.buffers = {}
