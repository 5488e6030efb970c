"""Keep Python's cyclic garbage collector off the objects a call builds by the hundred thousand: with a
large heap, full collections cost more than the compile. Compiling and planning pause it (`paused_gc`); a
driver's call freezes what was alive and what each pause built (`frozen_heap`): its I/O's walk the new."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_FREEZING: ContextVar[bool] = ContextVar("remapdsl_freezing", default=False)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the block, then restore it; inside a `frozen_heap`, what the block
    built is frozen with the rest."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _FREEZING.get():
            gc.freeze()
        if was_enabled:
            gc.enable()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the block, unfreezing them (into the oldest generation) at its end;
    nothing where objects are frozen already (by the caller, or an enclosing call): those are theirs to unfreeze."""
    if _FREEZING.get() or gc.get_freeze_count():
        yield
        return
    token = _FREEZING.set(True)
    gc.freeze()
    try:
        yield
    finally:
        _FREEZING.reset(token)
        gc.unfreeze()
