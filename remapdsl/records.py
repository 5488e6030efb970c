"""Records: data made by the tens of thousands (TensorInfos, Chunks, blocks, bindings) are named tuples or
slotted frozen dataclasses of checked values, which pydantic models (input validation) hold as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from functools import cache
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema


def record_schema(cls: type, source: Any, handler: GetCoreSchemaHandler,
                  check: Callable[[Any], Any] | None = None) -> CoreSchema:
    """The schema of a record field (for a record's `__get_pydantic_core_schema__`): a record is taken
    as it is (checked when made); JSON, a dict or a list is built by pydantic's schema, then `check`ed."""
    made = handler(source)
    if check is not None:
        made = core_schema.no_info_after_validator_function(check, made)
    return core_schema.json_or_python_schema(
        json_schema=made,
        python_schema=core_schema.union_schema([core_schema.is_instance_schema(cls), made], mode="left_to_right"))


@cache
def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.init)


class Pickled:
    """A slotted frozen dataclass record pickled as its constructor's fields (`init=False` caches left out)."""

    __slots__ = ()

    def __reduce__(self):
        return type(self), tuple(map(self.__getattribute__, _init_fields(type(self))))
