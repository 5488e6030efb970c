"""Compiled blocks + existing tensors -> the tensors filled from the checkpoint files (one process).

Each block reads the byte range that covers its source elements (straight into the destination's
memory when both sides are one contiguous run and no value step applies), then copies it through a
strided view with its value steps. Nothing is read before every destination's shape and dtype are
checked against the compiled ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping

import torch
from pydantic import BaseModel, ConfigDict

from .checkpoint import CheckpointReader, Inventory
from .compile.model import Block, Compiled, Destination
from .dtypes import BY_NAME
from .errors import BindError, Diagnostic


class LoadReport(BaseModel):
    """What a load did: the runtime tensors it filled, from which checkpoint tensors, bytes read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loaded: tuple[str, ...]
    ckpt_keys: tuple[str, ...]
    bytes_read: int
    seconds: float


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_targets(compiled: Compiled, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every destination exists in the model with the compiled shape and dtype, and every model
    tensor is produced by a rule or named by `keep`; all problems reported at once."""
    import re

    problems = []
    keep = [re.compile(p) for p in compiled.keep]
    produced = {d.runtime_key for d in compiled.destinations}
    for d in compiled.destinations:
        tensor = tensors.get(d.runtime_key)
        if tensor is None:
            problems.append(Diagnostic(code="E230", span=d.rule, message=f"the rules produce "
                            f"`{d.runtime_key}`, but the model has no such tensor",
                            hint=_near(d.runtime_key, tensors)))
        elif tuple(tensor.shape) != d.shape or tensor.dtype != torch_dtype(d.dtype):
            problems.append(Diagnostic(code="E232", span=d.rule, message=f"`{d.runtime_key}` is "
                            f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} in the "
                            f"model, but the rules make it {list(d.shape)} {d.dtype}",
                            hint="add `| cast(...)` to the rule" if tuple(tensor.shape) == d.shape
                            else None))
    for key in tensors:
        if key not in produced and not any(k.fullmatch(key) for k in keep):
            problems.append(Diagnostic(code="E231", message=f"model tensor `{key}` is produced by no "
                            "rule", hint="map it from the checkpoint, or name it in a `keep`"))
    if problems:
        raise BindError(problems)


def run_load(compiled: Compiled, inventory: Inventory, tensors: MutableMapping[str, torch.Tensor]) -> LoadReport:
    """Fill `tensors` in place from the checkpoint through the compiled blocks."""
    start = time.perf_counter()
    check_targets(compiled, tensors)
    nbytes = 0
    with CheckpointReader(inventory) as reader, torch.no_grad():
        for d in compiled.destinations:
            nbytes += _load_destination(d, tensors[d.runtime_key], inventory, reader)
    return LoadReport(loaded=tuple(d.runtime_key for d in compiled.destinations),
                      ckpt_keys=tuple(sorted({k for d in compiled.destinations for k in d.ckpt_keys})),
                      bytes_read=nbytes, seconds=time.perf_counter() - start)


def _load_destination(d: Destination, tensor: torch.Tensor, inventory: Inventory,
                      reader: CheckpointReader) -> int:
    nbytes = 0
    for b in d.blocks:
        view = tensor[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
        if b.ckpt_key is None:  # a pad region: made in its dtype, then the later value steps
            view.copy_(_steps(torch.full(b.sizes, b.fill, dtype=torch.float64), b.steps))
            continue
        nbytes += _read_block(b, view, inventory, reader)
    return nbytes


def _read_block(b: Block, view: torch.Tensor, inventory: Inventory, reader: CheckpointReader) -> int:
    info = inventory.tensors[b.ckpt_key]
    dtype = torch_dtype(info.dtype)
    itemsize = BY_NAME[info.dtype].bits // 8
    shape = tuple(info.shape)
    row_major = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        row_major[k] = row_major[k + 1] * shape[k + 1]
    start = sum(s * x for s, x in zip(row_major, b.base))
    strides = [sum(row_major[k] * b.coeff[k][j] for k in range(len(shape))) for j in range(len(b.sizes))]
    low = start + sum(min(0, t * (n - 1)) for t, n in zip(strides, b.sizes))
    high = start + sum(max(0, t * (n - 1)) for t, n in zip(strides, b.sizes))
    count = high - low + 1
    byte_offset = info.byte_offset + low * itemsize
    if not b.steps and view.dtype == dtype and view.is_contiguous() and _dense(strides, b.sizes):
        reader.read_into(info.file, byte_offset, view)  # straight into the destination
        return count * itemsize
    staging = torch.empty(count * itemsize, dtype=torch.uint8)
    reader.read_into(info.file, byte_offset, staging)
    flat = staging.view(dtype)
    flips = [j for j, t in enumerate(strides) if t < 0]
    source = flat.as_strided(tuple(b.sizes), tuple(abs(t) for t in strides),
                             start - low + sum(strides[j] * (b.sizes[j] - 1) for j in flips))
    if flips:
        source = source.flip(flips)
    view.copy_(_steps(source, b.steps))
    return count * itemsize


def _steps(values: torch.Tensor, steps) -> torch.Tensor:
    """Value steps: casts, and scale/add computed in float32 then cast back to the dtype."""
    for kind, value in steps:
        if kind == "cast":
            values = values.to(torch_dtype(value))
        elif kind == "scale":
            values = (values.float() * value).to(values.dtype)
        else:
            values = (values.float() + value).to(values.dtype)
    return values


def _dense(strides: list[int], sizes: tuple[int, ...]) -> bool:
    """Whether element strides describe one contiguous row-major run of the given sizes."""
    expected = 1
    for t, n in zip(reversed(strides), reversed(sizes)):
        if n != 1 and t != expected:
            return False
        expected *= n
    return True


def _near(name: str, tensors: Mapping[str, torch.Tensor]) -> str | None:
    from .errors import suggest

    close = suggest(name, list(tensors))
    return f"did you mean `{close}`?" if close else None
