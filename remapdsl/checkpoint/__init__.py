"""Checkpoint inventory: safetensors headers and index -> `Inventory`; byte-range reads into caller memory
(docs/checkpoints.md)."""

from remapdsl.checkpoint.header import FileInfo, Header, TensorInfo, read_header, tensor_nbytes
from remapdsl.checkpoint.inventory import Inventory, open_inventory, read_config
from remapdsl.checkpoint.reader import CheckpointReader, as_byte_view

__all__ = [
    "CheckpointReader",
    "FileInfo",
    "Header",
    "Inventory",
    "TensorInfo",
    "as_byte_view",
    "open_inventory",
    "read_config",
    "read_header",
    "tensor_nbytes",
]
