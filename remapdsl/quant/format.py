"""The protocol of a quantized format: QuantFormat (shapes, covers, decode, encode), Part, FormatError.

From shapes alone a format says what logical tensor its parts make and which box of each part a
logical box needs (what the compiler and plans use, no torch); the executor calls `decode`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from ..params import Param

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class Part(NamedTuple):
    """One physical tensor of a quantized weight, as the header gives it."""

    key: str
    dtype: str
    shape: tuple[int, ...]


class FormatError(ValueError):
    """The parts or parameters do not fit the format; the message names what and how."""


class QuantFormat:
    """A quantized storage format. Subclass it, set the class attributes, implement the methods.

    `parts` names what each source of the `dequantize` statement holds, in order (the packed values
    first, then scales). `params` declares the arguments a rule writes (`remapdsl.params.Param`: `ints`,
    `int`, `number`, `dtype`, `scale_dtype`), which the static checks hold it to; every format takes
    `to=`, the logical dtype.
    """

    name: ClassVar[str]
    parts: ClassVar[tuple[str, ...]]
    params: ClassVar[tuple[Param, ...]]
    summary: ClassVar[str] = ""  # what it stores, in one line
    one_scale: ClassVar[bool] = False  # one scale for the whole tensor: never fuse two as they are
    encodes: ClassVar[bool] = False  # implements `encode`: a save writes it back with its stored scales
    requantizes: ClassVar[bool] = False  # implements `requantize`: new scales from the values

    def logical_shape(self, parts: Sequence[Part], params: Mapping[str, Any]) -> tuple[int, ...]:
        """The logical tensor's shape; raise FormatError when a part's dtype or shape does not fit."""
        raise NotImplementedError

    def views(self, parts: Sequence[Part], params: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
        """The shape each part is addressed by in `cover` (the same bytes, row-major)."""
        return tuple(p.shape for p in parts)

    def cover(self, box: Box, parts: Sequence[Part], params: Mapping[str, Any]) -> tuple[Box, ...]:
        """For a box of the logical tensor, the box of each part's view that decoding it needs."""
        raise NotImplementedError

    def decode(self, tensors: Sequence[Any], box: Box, covers: Sequence[Box], params: Mapping[str, Any],
               out: Any) -> None:
        """Write the logical `box` into `out` (a torch tensor of the box's sizes, dtype `to`).

        `tensors[i]` holds part i's `covers[i]`, shaped as that box, in the part's dtype where torch
        has it (else uint8). Vectorized: torch ops over the whole box, no loop per block or element.
        """
        raise NotImplementedError

    def encode(self, values: Any, box: Box, covers: Sequence[Box], scales: Sequence[Any],
               params: Mapping[str, Any]) -> Any:
        """The inverse of `decode` with the stored scales: float32 `values` of the logical `box` ->
        the values part's covering box (a uint8 tensor of its bytes, row-major). `scales[i]` holds
        part i + 1's cover. Values decoded and not changed come back bit for bit; a value the
        stored scale cannot reach raises FormatError."""
        raise NotImplementedError

    def requantize(self, values: Any, box: Box, parts: Sequence[Part], params: Mapping[str, Any]) -> tuple:
        """New scales from the values themselves: float32 `values` of the logical `box` -> (the
        values part's cover as uint8 bytes, the scales part's cover in its dtype). The box must hold
        whole blocks (or reach the tensor's end); else FormatError."""
        raise NotImplementedError

    def value_grid(self, parts: Sequence[Part], params: Mapping[str, Any]) -> tuple[int, ...]:
        """Per dim of the stored values (part 0), how many consecutive elements share their scales
        or their bytes: where rules move the stored form as it is (`quantized`), every cut must
        fall on a multiple of it."""
        return (1,) * len(parts[0].shape)
