"""Op and format arguments written as literals -> the problems they show before any checkpoint
(E122-E125); arguments that are not literals are checked at compile time."""

from __future__ import annotations

from collections.abc import Iterator

from . import ir
from ..params import Param
from .limits import Problem

_POSITIVE = {"groups", "n", "times", "to", "heads"}
_COUNTS = {1: "one", 2: "two", 3: "three", 4: "four"}


def op_problems(op: ir.Op) -> Iterator[Problem]:
    """Literal sizes of a built-in op that can never be right (counts below 1, a reshape with two -1)."""
    for param in op.params:
        value = getattr(op, param.name)
        if param.name in _POSITIVE and isinstance(value, ir.Int) and value.value < 1:
            yield "E122", f"`{param.name}` must be at least 1, not {value.value}", value.span, None
    if isinstance(op, ir.Split) and isinstance(op.sizes, ir.List):
        for item in op.sizes.items:
            if isinstance(item, ir.Int) and item.value < 1:
                yield "E122", f"split sizes must be at least 1, not {item.value}", item.span, None
    if isinstance(op, ir.Reshape) and isinstance(op.shape, ir.List):
        ints = [i for i in op.shape.items if isinstance(i, ir.Int)]
        inferred = [i for i in ints if i.value == -1]
        if len(inferred) > 1:
            yield ("E123", "a reshape may infer one size (`-1`), not several", inferred[1].span,
                   "give every size but one")
        for item in ints:
            if item.value < -1 or item.value == 0:
                yield "E122", f"reshape sizes must be at least 1 (or one -1), not {item.value}", item.span, None
    if isinstance(op, ir.Permute) and isinstance(op.dims, ir.List):
        ints = [i.value for i in op.dims.items if isinstance(i, ir.Int)]
        if len(ints) == len(op.dims.items) and sorted(d % len(ints) for d in ints) != list(range(len(ints))):
            yield "E124", f"`permute` needs each dim once; {ints} is not a permutation", op.dims.span, None


def size_problems(param: Param, value: ir.List) -> Iterator[Problem]:
    """A literal list for a parameter that declares a fixed number of sizes (`Param.sizes`): one
    entry per size (E125), each at least 1 (E122)."""
    if len(value.items) != len(param.sizes):
        count = _COUNTS.get(len(param.sizes), str(len(param.sizes)))
        yield ("E125", f"`{param.name}` takes {count} sizes, [{', '.join(param.sizes)}]; got {len(value.items)}",
               value.span, None)
    for item in value.items:
        if isinstance(item, ir.Int) and item.value < 1:
            yield "E122", f"{param.name} sizes must be at least 1, not {item.value}", item.span, None
