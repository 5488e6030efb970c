"""What the read and write executors share: dtypes by name, a piece's local region, value steps,
an item's elements viewed in the mapped file, and one part's covering box read from the files."""

from __future__ import annotations

import warnings

import torch

from ..checkpoint import CheckpointReader
from ..dtypes import BY_NAME
from ..errors import Diagnostic, RemapError


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def region(tensor: torch.Tensor, item) -> torch.Tensor:
    """A plan item's local region; E417 where the tensor does not hold it whole (slicing would cut it)."""
    view = tensor[tuple(slice(o, o + s) for o, s in zip(item.local_offsets, item.sizes))]
    if tuple(view.shape) != tuple(item.sizes):
        raise outside(item, f"a tensor of shape {list(tensor.shape)}")
    return view


def outside(item, what: str) -> RemapError:
    """E417: a plan item whose region does not lie in its runtime tensor (a defect of remapdsl)."""
    ckpt = getattr(item, "ckpt_key", None) or getattr(item, "logical", None)  # a read or write item; a decode
    source = f" from `{ckpt}`" if ckpt else ""
    return RemapError(Diagnostic(
        code="E417", message=f"a plan item for `{item.runtime_key}`{source}, offsets {list(item.local_offsets)} "
        f"sizes {list(item.sizes)}, does not lie in {what}: nothing of it was read or written",
        hint="the plan does not fit the tensors it runs on: a defect of remapdsl; please report it with "
             "the rule file, the checkpoint's headers and the layout"))


def mapped_values(reader: CheckpointReader, item) -> torch.Tensor | None:
    """A read item's elements as a strided view of the mapped file (None: first byte unaligned)."""
    dtype = torch_dtype(item.dtype)
    if item.runs.first % dtype.itemsize:
        return None
    span = 1 + sum((n - 1) * t for n, t in zip(item.sizes, item.source_strides))
    with warnings.catch_warnings():  # the map is read-only, and only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(reader.mapped(item.file), dtype=dtype, offset=item.runs.first, count=span)
    return flat.as_strided(item.sizes, item.source_strides)


def read_part(part, reader: CheckpointReader) -> torch.Tensor:
    """One part's covering box as a tensor of its sizes, in the part's dtype where torch has it."""
    kind = BY_NAME[part.dtype]
    dtype = torch_dtype(part.dtype) if kind.in_torch else torch.uint8
    staging = torch.empty(part.runs.total, dtype=torch.uint8)
    reader.read_runs_into(part.file, part.runs, staging)
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
