"""What the read and write executors share: dtypes by name, a piece's local region, value steps,
and one part's covering box read from the files."""

from __future__ import annotations

import warnings

import torch

from ..checkpoint import CheckpointReader
from ..dtypes import BY_NAME

MANY_RUNS = 64  # above this many byte runs, an item is copied from the mapped file


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def region(tensor: torch.Tensor, item) -> torch.Tensor:
    """The local region [local_offsets, local_offsets + sizes) of a plan item."""
    return tensor[tuple(slice(o, o + s) for o, s in zip(item.local_offsets, item.sizes))]


def read_part(part, reader: CheckpointReader) -> torch.Tensor:
    """One part's covering box as a tensor of its sizes, in the part's dtype where torch has it."""
    kind = BY_NAME[part.dtype]
    dtype = torch_dtype(part.dtype) if kind.in_torch else torch.uint8
    if len(part.runs) > MANY_RUNS and part.origin % dtype.itemsize == 0 and part.strides:
        # many short runs (a column shard): one strided copy from the mapped file, the same bytes
        span = 1 + sum((n - 1) * t for n, t in zip(part.sizes, part.strides))
        with warnings.catch_warnings():  # the map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(reader.mapped(part.file), dtype=dtype, offset=part.origin, count=span)
        return flat.as_strided(part.sizes, part.strides).contiguous()
    staging = torch.empty(sum(n for _, n in part.runs), dtype=torch.uint8)
    at = 0
    for byte_offset, nbytes in part.runs:
        reader.read_into(part.file, byte_offset, staging[at:at + nbytes])
        at += nbytes
    return staging.view(dtype).view(part.sizes)


def apply_steps(values: torch.Tensor, steps) -> torch.Tensor:
    """Value steps: casts, and scale/add computed in float32 then cast back to the dtype."""
    for kind, value in steps:
        if kind == "cast":
            values = values.to(torch_dtype(value))
        elif kind == "scale":
            values = (values.float() * value).to(values.dtype)
        else:
            values = (values.float() + value).to(values.dtype)
    return values
