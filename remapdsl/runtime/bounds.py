"""How long a rank waits for the others (the call's `timeout=`, E415 naming the ranks that never
arrived), over which group, and who is gone after a failed collective (`roll_call`)."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import Diagnostic, RemapError, runs_text

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0  # seconds a call waits at one exchange for the other ranks, unless told otherwise
ARRIVAL_SECONDS = 1.0  # a rank waiting longer notes it in the store (faster exchanges touch no store)
ROLL_CALL_SECONDS = 2.0  # after a timeout or a failed collective: how long to wait to hear from the others
_timeout: ContextVar[float] = ContextVar("remapdsl_timeout", default=DEFAULT_TIMEOUT)
_control: tuple[Any, Any] | None = None  # (the default group, the group control exchanges go over)
_GROUPS_MADE = 0  # control groups this process has made (their meeting's name in the store)


def ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`: a list of ranks, runs collapsed."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {runs_text(ranks)}"


def seconds(timeout) -> float:
    """A call's `timeout=` (seconds, a timedelta, or None: DEFAULT_TIMEOUT) in seconds; E416 if not positive."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise RemapError(Diagnostic(code="E416", message=f"timeout={timeout!r} is not a positive, finite number "
                                    "of seconds (or a datetime.timedelta)",
                                    hint=f"the default is {DEFAULT_TIMEOUT:g} s: how long a rank waits at one "
                                         "exchange for the others"))
    return float(value)


@contextmanager
def bounded(timeout) -> Iterator[None]:
    """Every exchange inside waits at most `timeout` (None: the bound in force, an enclosing call's)."""
    token = _timeout.set(_timeout.get() if timeout is None else seconds(timeout))
    try:
        yield
    finally:
        _timeout.reset(token)


def bounded_iter(items: Iterator[T], timeout) -> Iterator[T]:
    """`items` (a generator making exchanges), each step under `bounded(timeout)`, never the caller's code."""
    limit = _timeout.get() if timeout is None else seconds(timeout)
    try:
        while True:  # the token set by hand: a context manager an item costs 0.1 s a 45k-tensor export
            token = _timeout.set(limit)
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                _timeout.reset(token)
            yield item
    finally:
        items.close()


def control_group():
    """The group control exchanges go over: None (the default group) when it has a CPU backend, else a
    gloo group of its ranks, made once after they meet in the store (a rank that never comes: E415)."""
    global _control, _GROUPS_MADE
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.group.WORLD
    if _control is not None and _control[0] is default:
        return _control[1]
    group = None
    if not any(part.strip().startswith("cpu:") for part in dist.get_backend_config(default).split(",")):
        _GROUPS_MADE += 1
        _meet(f"remapdsl/control-group/{_GROUPS_MADE}", "making the group for control exchanges")
        group = dist.new_group(backend="gloo")
    _control = (default, group)
    return group


def _meet(name: str, phase: str) -> None:
    """Wait, at most the call's timeout, until every rank reached `name` in the store; else E415."""
    store = _store()
    me, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{name}/{me}", b"1")
    if store.add(f"{name}/count", 1) == world:
        store.set(f"{name}/all", b"1")
    limit = _timeout.get()
    try:
        store.wait([f"{name}/all"], _at_least_a_millisecond(limit))
    except Exception:  # noqa: BLE001 - the store's timeout error differs by store and version
        missing = [r for r in range(world) if not store.check([f"{name}/{r}"])]
        raise late(missing, limit, phase) from None


def _store():
    return dist.distributed_c10d._get_default_store()


def late(missing: list[int], limit: float, phase: str) -> RemapError:
    """E415: this rank waited `limit` seconds while `phase` for `missing`, which never arrived."""
    what = f"{ranks_text(missing)} never arrived" if missing else \
        "every rank arrived, at different exchanges (the ranks made different calls)"
    error = RemapError(Diagnostic(
        code="E415", message=f"rank {dist.get_rank()} waited {limit:g} s while {phase}: {what}",
        hint="every rank must make the same remapdsl calls in the same order; the rank named is stuck, "
             "slower (still working on an earlier step), or never made this call: its own log says which. "
             "Raise `timeout=` if ranks legitimately arrive further apart"))
    error.failed_ranks = tuple(missing)
    return error


def wait_bounded(work, phase: str, collective: int) -> None:
    """Wait for `work` at most the call's timeout, then name the ranks not waiting (E415)."""
    limit = _timeout.get()
    first = min(ARRIVAL_SECONDS, limit)
    if _waited(work, first):
        return
    store, key = _store(), _waiting(dist.get_rank())
    store.set(key, str(collective))
    if _waited(work, limit - first):
        store.set(key, "")
        return
    raise late(_missing(collective), limit, phase)


def _waited(work, limit: float) -> bool:
    """Whether `work` finished within `limit` seconds; its error if it failed."""
    try:
        work.wait(timeout=_at_least_a_millisecond(limit))
    except Exception:
        if work.is_completed():  # it failed: the backend's own error
            raise
        return False
    return True


def _at_least_a_millisecond(limit: float) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=max(1, round(limit * 1000)))


def _waiting(rank: int) -> str:
    """The store's entry saying at which collective `rank` waits long ("" once it does not)."""
    return f"remapdsl/waiting/{rank}"


def _missing(collective: int) -> list[int]:
    """The ranks not waiting in any exchange after ROLL_CALL_SECONDS (the first to ask tells the others)."""
    store, world, me = _store(), dist.get_world_size(), dist.get_rank()
    answer = f"remapdsl/missing/{collective}"
    if store.add(answer + "/asked", 1) != 1:
        try:  # another rank looks: its answer, unless it is gone too (then look here)
            store.wait([answer], _at_least_a_millisecond(ROLL_CALL_SECONDS + 1))
            return [r for r in json.loads(store.get(answer)) if r != me]
        except Exception:  # noqa: BLE001, S110 - the store's timeout error differs by store and version
            pass

    def behind(r: int) -> bool:
        key = _waiting(r)
        return not store.check([key]) or not store.get(key)

    missing = [r for r in range(world) if r != me]
    deadline = time.monotonic() + ROLL_CALL_SECONDS
    while True:
        missing = [r for r in missing if behind(r)]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    store.set(answer, json.dumps(missing))
    return missing


def roll_call(collective: int) -> str:
    """Which ranks are gone after a collective failed: those not waiting within ROLL_CALL_SECONDS."""
    try:
        _store().set(_waiting(dist.get_rank()), str(collective))
        missing = _missing(collective)
    except Exception as exc:  # noqa: BLE001 - a store that is gone fails with the backend's own errors
        return (f"the group's store cannot be reached either ({type(exc).__name__}): rank 0, which "
                "usually hosts it, may be the one lost")
    if not missing:
        return "every rank answered a roll call afterwards (a rank left the group, or a network fault)"
    named = ", ".join(map(str, missing))
    return (f"rank{'s' if len(missing) > 1 else ''} {named} did not answer a roll call within "
            f"{ROLL_CALL_SECONDS:g} s (lost or stuck)")
