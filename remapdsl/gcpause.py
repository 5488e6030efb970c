"""Keep Python's cyclic garbage collector off the objects a call builds by the hundred thousand.

Compiling and planning build tens of thousands of small objects; in a process that already holds a
large heap (a model, torch.distributed state) each full collection walks every object, and on a
1,000-tensor sharded load those walks cost more than the compile itself (seen profiling the load of
bench/dist_phases.py by hand: compile 0.18 s with collections, 0.04 s without). So the collector is
paused while they are built (`paused_gc`), and, inside a driver's call (`frozen_heap`), what is
alive at its start and what each paused phase built is moved out of the collector's sight
(`gc.freeze`) until the call ends (`gc.unfreeze`): the collections that run during its reads and
writes walk only what was allocated since, and garbage made then is collected as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_FREEZING: ContextVar[bool] = ContextVar("remapdsl_freezing", default=False)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore its previous state after. Inside a
    `frozen_heap`, what the block built is frozen with the rest."""
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
    """Freeze the objects alive now for the block, unfreezing them (into the oldest generation) at
    its end. Nothing is done where objects are frozen already (the caller's own use of gc.freeze,
    or an enclosing call): those are the caller's to unfreeze."""
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
