"""A quantized format written in Python, as a user registers one (docs/quantized.md's example):
the tests that register a format of their own subclass it, with a name of their own."""

from __future__ import annotations

import torch

from remapdsl.quant import FormatError, QuantFormat, get_format


class Int8Row(QuantFormat):
    """int8 values with one float32 scale per row: decodes, neither encodes nor requantizes."""

    name = "int8_row"
    values_dtype = "int8"  # a subclass may store wider values
    parts = ("values", "scales")
    params = get_format("fp8_channel").params

    def logical_shape(self, parts, params):
        values, scales = parts
        if values.dtype != self.values_dtype or tuple(scales.shape) != tuple(values.shape[:-1]):
            raise FormatError(f"want {self.values_dtype} values and one scale per row, "
                              f"got {values.dtype} {scales.shape}")
        return tuple(values.shape)

    def cover(self, box, parts, params):
        return box, (box[0][:-1], box[1][:-1])

    def decode(self, tensors, box, covers, params, out):
        values, scales = tensors
        torch.mul(values.to(torch.float32), scales.unsqueeze(-1), out=out)
