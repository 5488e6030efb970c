"""Param: one declared argument of an op or a quantized format; a base module, shared by the IR and quant/."""

from __future__ import annotations

from typing import Literal, NamedTuple

ArgKind = Literal["capture", "int", "ints", "dtype", "number", "scale_dtype"]


class Param(NamedTuple):
    """One parameter of an op or a format: its name, what it takes, and how the formatter prints it."""

    name: str
    kind: ArgKind
    required: bool = True
    positional: bool = False  # printed without `name=` in canonical form
    sizes: tuple[str, ...] = ()  # an `ints` of this many sizes, each >= 1 (`("rows", "cols")`; E122, E125)
