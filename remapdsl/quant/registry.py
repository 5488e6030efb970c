"""The registry of quantized formats: a `dequantize` statement's format name -> its QuantFormat.

The built-in ones are registered on import; a program registers its own before it loads rules that
name them (rule files only name formats).
"""

from __future__ import annotations

from .builtin import BUILTIN_FORMATS
from .format import QuantFormat

_FORMATS: dict[str, QuantFormat] = {}


def register_format(fmt: QuantFormat, *, replace: bool = False) -> QuantFormat:
    """Make `fmt` available to `dequantize` statements by its name; returns it."""
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"register a QuantFormat instance, not {type(fmt).__name__}")
    if not fmt.name.isidentifier():
        raise ValueError(f"a format name is an identifier, not {fmt.name!r}")
    if not any(p.name == "to" for p in fmt.params):
        raise ValueError(f"format `{fmt.name}` must declare `to` (the logical dtype) among its params")
    if fmt.name in _FORMATS and not replace:
        raise ValueError(f"format `{fmt.name}` is already registered (pass replace=True to replace it)")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Forget the format of that name (nothing happens when none is registered)."""
    _FORMATS.pop(name, None)


def get_format(name: str) -> QuantFormat:
    """The format registered under `name`; KeyError when there is none."""
    return _FORMATS[name]


def format_names() -> list[str]:
    """The names of every registered format, sorted."""
    return sorted(_FORMATS)


for _format in BUILTIN_FORMATS:
    register_format(_format)
