"""Quantized formats: logical tensors stored as packed values plus scales (docs/quantized.md).

`get_format(name)` finds a format, `register_format(fmt)` adds one written in Python (a subclass of
`QuantFormat`). Importing this package does not import torch.
"""

from .format import FormatError, Part, QuantFormat
from .registry import format_names, get_format, register_format, unregister_format

__all__ = ["FormatError", "Part", "QuantFormat", "format_names", "get_format", "register_format",
           "unregister_format"]
