"""Records: the hot data of a checkpoint and a compiled program, and how a pydantic model holds one.

Data made by the tens of thousands at DeepSeek-V3 scale (a checkpoint's TensorInfos and Chunks, a
program's blocks and bindings) are named tuples or slotted frozen dataclasses, built by their own
constructors from values that one checking function passed (`header.tensor_problems` for a tensor's
facts) or that were computed from such records. Pydantic models stay where validation matters (what
a user or a JSON file gives, a rule file's IR) and are built with their normal constructors, so their
validators run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema


def record_schema(cls: type, source: Any, handler: GetCoreSchemaHandler,
                  check: Callable[[Any], Any] | None = None) -> CoreSchema:
    """The schema of a record field of a pydantic model (for a record's `__get_pydantic_core_schema__`):
    a record given as one is taken as it is (it was checked, or computed from checked values, when it
    was made), an isinstance check in pydantic's core; one given otherwise (JSON, a dict or a list) is
    built by pydantic's own schema of the type, then passed to `check`, which returns it or raises
    ValueError. Serialized as pydantic serializes the type (a named tuple: the list of its fields)."""
    made = handler(source)
    if check is not None:
        made = core_schema.no_info_after_validator_function(check, made)
    return core_schema.json_or_python_schema(
        json_schema=made,
        python_schema=core_schema.union_schema([core_schema.is_instance_schema(cls), made], mode="left_to_right"))


_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


class Pickled:
    """A slotted frozen dataclass record pickled as its class and the fields its constructor takes:
    what a cache the record keeps (an `init=False` field) is left out, and unpickling makes it by its
    own constructor on every Python the package supports."""

    __slots__ = ()

    def __reduce__(self):
        cls = type(self)
        names = _INIT_FIELDS.get(cls)
        if names is None:
            names = _INIT_FIELDS[cls] = tuple(f.name for f in fields(cls) if f.init)
        return cls, tuple(map(self.__getattribute__, names))
