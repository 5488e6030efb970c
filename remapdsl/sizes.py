"""Sizes as people write them (`5GB`, `500MB`, `2GiB`, or a number of bytes) -> bytes; E522 otherwise."""

from __future__ import annotations

from .errors import Diagnostic, RemapError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def parse_size(value: int | str, what: str) -> int:
    """`value` in bytes: an int as it is, a text with a unit (decimal KB/MB/GB/TB, binary KiB/MiB/GiB);
    `what` names it in the error (`--max-shard-size 5XB`, `max_shard_size=0`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().upper()
        digits = text.rstrip("BKMGTI")  # a unit alone ("GB") is no size
        unit = text[len(digits):]
        try:
            number = float(digits) * UNITS[unit]
        except (KeyError, ValueError):
            raise RemapError(Diagnostic(code="E522", message=f"`{what}` is not a size",
                                        hint="for example 500MB, 5GB or 2GiB")) from None
    if number < 1:
        raise RemapError(Diagnostic(code="E522", message=f"`{what}` must be positive"))
    return int(number)
