"""Keep Python's cyclic garbage collector off the objects a call builds by the hundred thousand.

With a large heap (a model, torch.distributed state), full collections cost more than the compile. So the
collector is paused while compiling and planning (`paused_gc`), and a driver's call (`frozen_heap`) freezes
what was alive at its start and what each paused phase built, so its I/O's collections walk only the new.
"""

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
