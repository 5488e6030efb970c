"""Param: one declared argument of an op or a quantized format; a base module, shared by the IR and quant/."""

from __future__ import annotations

from typing import Literal, NamedTuple

ArgKind = Literal["capture", "int", "ints", "dtype", "number", "scale_dtype"]


class Param(NamedTuple):
    """One parameter of an op or a format: its name, what it takes, and how the formatter prints it.

    `sizes` names the entries of an `ints` parameter that is a fixed number of sizes, each at least
    1 (`("rows", "cols")`); the static checks hold a literal list to it (E125, E122).
    """

    name: str
    kind: ArgKind
    required: bool = True
    positional: bool = False  # printed without `name=` in canonical form
    sizes: tuple[str, ...] = ()
