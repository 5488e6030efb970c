"""The compiled form every executor runs: runtime tensors tiled by blocks, and the bindings behind them
(so a save can read the blocks backwards); frozen, JSON-serializable, with a process-stable `digest()`."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from ..errors import SpanField
from ..indexmap import Block, FirstDimIndex
from ..records import Pickled

FEW_BLOCKS = 16  # a runtime tensor with more blocks finds those meeting a box by bisection


@dataclass(frozen=True, slots=True)
class RuntimeTensor(Pickled):
    """One runtime tensor: its shape and dtype, the blocks that tile it, the rule that made it (a record,
    not a model: a model can have tens of thousands)."""

    runtime_key: str
    shape: tuple[int, ...]
    dtype: str
    blocks: tuple[Block, ...]
    rule: SpanField | None = None
    ckpt_keys: tuple[str, ...] = ()
    grid: tuple[int, ...] = ()  # per dim, the block a shard edge must respect (stored quantized values)
    _index: Annotated[Any, Field(exclude=True)] = field(default=None, init=False, repr=False, compare=False)

    def blocks_meeting(self, offsets, sizes) -> tuple[Block, ...] | list[Block]:
        """The blocks that may meet the box [offsets, offsets + sizes): all of a few, else those
        whose first dim reaches it (an index built on first use, kept with the tensor)."""
        if len(self.blocks) <= FEW_BLOCKS or not self.shape:
            return self.blocks
        if self._index is None:
            object.__setattr__(self, "_index", FirstDimIndex(self.blocks, self.blocks))  # a cache, not a field
        return self._index.meeting(offsets, sizes)


class CkptTensor(NamedTuple):
    """A checkpoint tensor as the compiler saw it (the save direction writes it back)."""

    ckpt_key: str
    file: str
    dtype: str
    shape: tuple[int, ...]


class LogicalTensor(NamedTuple):
    """A tensor a format makes from checkpoint parts (a `dequantize` binding), named by blocks like a
    checkpoint tensor; `parts` in the format's order (values first)."""

    logical_key: str
    format: str
    params: tuple[tuple[str, int | float | str | tuple[int, ...]], ...]
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    rule: SpanField | None = None

    def param_dict(self) -> dict:
        return dict(self.params)


@dataclass(frozen=True, slots=True)
class StoredQuantized(Pickled):
    """Parts of a quantized weight that the rules move as they are (a `quantized` binding)."""

    values: str  # the checkpoint key of the stored values
    format: str
    params: tuple[tuple[str, int | float | str | tuple[int, ...]], ...]
    parts: tuple[str, ...]
    grid: tuple[int, ...]  # per dim of the values: cuts fall on multiples of these
    rule: SpanField | None = None


@dataclass(frozen=True, slots=True)
class BoundRule(Pickled):
    """One binding of one statement: its captures, the checkpoint keys it read, what it made."""

    rule: SpanField | None
    captures: tuple[tuple[str, int | str], ...]
    ckpt_keys: tuple[str, ...]
    runtime_keys: tuple[str, ...]


class Compiled(BaseModel):
    """Everything an executor needs, with no reference to the rule language (the compiler builds it
    unvalidated with `model_construct`; `model_validate_json` validates every field)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime_tensors: tuple[RuntimeTensor, ...]  # sorted by runtime key
    ckpt_tensors: tuple[CkptTensor, ...]  # every checkpoint tensor, sorted by key
    logical: tuple[LogicalTensor, ...] = ()  # dequantized tensors, sorted by key
    quantized: tuple[StoredQuantized, ...] = ()  # quantized tensors moved as stored, by values key
    bindings: tuple[BoundRule, ...]
    dropped: tuple[str, ...] = ()  # checkpoint keys removed by `drop`
    unused_drops: tuple[SpanField, ...] = ()  # `drop` statements that matched nothing
    keep: tuple[str, ...] = ()  # regular expressions of runtime keys that take nothing

    def runtime_tensor(self, runtime_key: str) -> RuntimeTensor:
        """The runtime tensor of a key (a binary search: `runtime_tensors` is sorted by key)."""
        at = bisect.bisect_left(self.runtime_tensors, runtime_key, key=lambda d: d.runtime_key)
        if at < len(self.runtime_tensors) and self.runtime_tensors[at].runtime_key == runtime_key:
            return self.runtime_tensors[at]
        raise KeyError(runtime_key)

    def empty_state_dict(self, keys: Iterable[str] | None = None, device=None) -> dict:
        """An uninitialized torch tensor of the compiled shape and dtype for each runtime tensor (or
        those of `keys`): a state dict to load into. Imports torch."""
        import torch

        chosen = self.runtime_tensors if keys is None else [self.runtime_tensor(k) for k in keys]
        return {d.runtime_key: torch.empty(d.shape, dtype=getattr(torch, d.dtype), device=device) for d in chosen}

    def logical_by_key(self) -> dict[str, LogicalTensor]:
        return {t.logical_key: t for t in self.logical}

    def digest(self) -> str:
        """sha256 of the canonical JSON form: equal for equal inputs, in any process."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()
