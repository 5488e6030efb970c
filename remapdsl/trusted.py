"""Frozen pydantic models built from values already checked, without a validation pass.

The parser, the compiler and the header reader make tens of thousands of small frozen models whose
every field they have just checked themselves (with the same functions the validators use);
pydantic's own `model_construct` still costs ~10 us each (it copies defaults, runs post-init).
Defaults of these models are immutable, so they are shared, not copied.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_LAYOUTS: dict[type, tuple[dict[str, Any], dict[str, Any] | None]] = {}
_put = object.__setattr__


def _layout(cls: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A model class's field defaults and its private attributes' defaults (None without any),
    read once a class; both immutable (a private cache starts as None), so they are shared."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        defaults = {name: info.default for name, info in cls.model_fields.items()}
        private = {name: attr.get_default() for name, attr in cls.__private_attributes__.items()}
        layout = _LAYOUTS[cls] = defaults, private or None
    return layout


def construct(cls: type[BaseModel], **values: Any) -> Any:
    """An instance of `cls` with `values` (checked by the caller) and the class's defaults."""
    defaults, private = _LAYOUTS.get(cls) or _layout(cls)
    obj = cls.__new__(cls)
    _put(obj, "__dict__", {**defaults, **values})
    _put(obj, "__pydantic_fields_set__", set(values))
    _put(obj, "__pydantic_extra__", None)
    _put(obj, "__pydantic_private__", dict(private) if private else None)
    return obj


def construct_rows(cls: type[BaseModel], names: tuple[str, ...], rows) -> list:
    """Instances of `cls` from rows of values for the fields `names` (every field named)."""
    _, private = _LAYOUTS.get(cls) or _layout(cls)
    if private:
        return [construct(cls, **dict(zip(names, row))) for row in rows]
    new, fields = cls.__new__, frozenset(names)
    out = []
    for row in rows:
        obj = new(cls)
        _put(obj, "__dict__", dict(zip(names, row)))
        _put(obj, "__pydantic_fields_set__", set(fields))
        _put(obj, "__pydantic_extra__", None)
        _put(obj, "__pydantic_private__", None)
        out.append(obj)
    return out
