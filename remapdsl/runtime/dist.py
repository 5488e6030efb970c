"""The only caller of torch.distributed: share headers, agree on the compiled rules, fail together.

Interface (every rank calls each function, in this order, as DCP's planners do):
`share_inventory` (rank 0 reads the headers, the others receive them), `together(fn[, agree_on])`
(run a phase; an error on any rank becomes the same error, naming every failing rank, on all ranks,
instead of a hang; with `agree_on`, the ranks also compare digests of what they were given, and on
a difference say what differs), `broadcast_from_first` (tensors every rank holds whole). Each
exchange is one collective (two for objects: their sizes, then their bytes).

Control exchanges (errors, digests, headers, plans, sizes; CPU tensors) go over a CPU-capable group:
the default group when it has a backend for CPU tensors (gloo, `"cpu:gloo,cuda:nccl"`), else one
gloo group over the same ranks, made once per default group (an NCCL-only job). Tensors a caller
moves (`broadcast_from_first`) go over the default group when they live on a device, the control
group when on the CPU. Every wait for other ranks is bounded by the call's own timeout (`bounded`),
not the group's; a rank that does not arrive in time is named on every rank that did (E415).

Every collective here is issued by this module on buffers it keeps referenced until the backend has
released them: gloo's worker threads hold each finished work (its tensors) for a moment after the
caller wakes, and a tensor whose last reference is dropped on such a thread needs the interpreter's
lock; during interpreter shutdown that aborts the process ("terminate called without an active
exception"). So when a call returns, no thread of the backend holds anything of it
(docs/distributed.md, "Leaving the group clean").
"""

from __future__ import annotations

import datetime
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .. import errors
from ..checkpoint import Inventory, open_inventory
from ..errors import Diagnostic, RemapError

T = TypeVar("T")

# How long a finished collective may wait for the backend's threads to let go of its buffers (in
# practice microseconds; the bound only keeps a backend that never lets go from hanging a call).
SETTLE_SECONDS = 5.0
ROLL_CALL_SECONDS = 2.0  # after a failed collective: how long survivors wait to hear from the others
_COLLECTIVES = 0  # collectives this process has made through this module (a roll call's name)
DEFAULT_TIMEOUT = 300.0  # seconds a call waits at one exchange for the other ranks, unless told otherwise
# A rank waiting at an exchange longer than this notes it in the group's store, so that a rank that
# never arrives can be named; faster exchanges touch no store.
ARRIVAL_SECONDS = 1.0
_timeout: ContextVar[float] = ContextVar("remapdsl_timeout", default=DEFAULT_TIMEOUT)
_control: tuple[Any, Any] | None = None  # (the default group, the group control exchanges go over)
_GROUPS_MADE = 0  # control groups this process has made (their meeting's name in the store)
# On a disagreement, how many distinct versions of one aspect are described (the first rank of each).
MAX_VERSIONS = 4


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def seconds(timeout) -> float:
    """A call's `timeout=` (seconds, a `datetime.timedelta`, or None for DEFAULT_TIMEOUT) in seconds;
    E416 if not positive."""
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
    """Every exchange made inside waits at most `timeout` for the other ranks (a call's `timeout=`;
    None keeps the bound in force: DEFAULT_TIMEOUT, or an enclosing call's)."""
    token = _timeout.set(_timeout.get() if timeout is None else seconds(timeout))
    try:
        yield
    finally:
        _timeout.reset(token)


def bounded_iter(items: Iterator[T], timeout) -> Iterator[T]:
    """`items` (a generator making exchanges) with each step run under `bounded(timeout)`, so the
    bound holds in the generator and never leaks into the caller's code between steps."""
    limit = _timeout.get() if timeout is None else seconds(timeout)
    try:
        while True:
            with bounded(limit):
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item
    finally:
        items.close()


def share_inventory(checkpoint, phase: str = "reading the checkpoint's headers") -> Inventory:
    """Rank 0 reads the checkpoint's headers once; every rank gets the same Inventory (one
    broadcast, carrying either the inventory or rank 0's error), read from this rank's own
    `checkpoint`, checked against its own files' modification times (`Inventory.restamped`)."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    inventory = from_first(lambda: open_inventory(checkpoint), phase)  # pickled: rank 0 validated it
    return inventory.restamped(checkpoint) if rank() != 0 else inventory  # this rank's own copy


def from_first(fn: Callable[[], T], phase: str = "sharing rank 0's result") -> T:
    """Rank 0's `fn()`, on every rank (one broadcast); an error there is raised on every rank."""
    return from_rank(0, fn, phase)


def from_rank(source: int, fn: Callable[[], T], phase: str = "sharing a rank's result") -> T:
    """Rank `source`'s `fn()`, on every rank; an error there is raised on every rank, naming it."""
    if not active():
        return fn()
    payload = None
    if dist.get_rank() == source:
        try:
            payload = _dumps((None, fn()))
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then raised
            payload = _dumps((_report(exc), None))
    report, value = pickle.loads(_broadcast_bytes(payload, source, phase))
    if report is not None:
        _raise([(source, report)], dist.get_world_size())
    return value


class Agreement(NamedTuple):
    """What the ranks must have been given alike, for `together(..., agree_on=...)`.

    `digests(result)` maps each aspect (the rules, the config, ...) to a digest of this rank's; all
    ranks exchange those. Where an aspect differs, the first rank of each version sends
    `detail(result, aspect)` and `explain(aspect, {rank: detail})` says, in sentences, what differs.
    """

    what: str
    digests: Callable[[Any], dict[str, str]]
    detail: Callable[[Any, str], Any] | None = None
    explain: Callable[[str, dict[int, Any]], list[str]] | None = None
    hint: str = "every rank must load the same rules from the same checkpoint"


def together(fn: Callable[[], T], agree_on: Agreement | tuple[str, Callable[[T], str]] | None = None,
             phase: str = "a phase") -> T:
    """Run one phase on every rank; if any rank fails, all raise the same error naming the ranks.

    With `agree_on` (an Agreement, or `(what, digest)`), the ranks also compare digests of their
    results in the same exchange: a rank given something else (other rules, another checkpoint or
    config, another layout) makes every rank fail with E410 saying what differs, instead of a hang
    or a silently different result.
    """
    if agree_on is not None and not isinstance(agree_on, Agreement):
        what, digest = agree_on
        agree_on = Agreement(what, lambda result: {what: digest(result)})
    error: BaseException | None = None
    result = digests = None
    try:
        result = fn()
        digests = agree_on.digests(result) if agree_on is not None and active() else None
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
        error = exc
    if not active():
        if error is not None:
            raise error
        return result
    mine = (_report(error), None) if error is not None else (None, digests)
    gathered = [pickle.loads(b) for b in _all_gather_bytes(_dumps(mine), phase)]
    failed = [(r, report) for r, (report, _) in enumerate(gathered) if report is not None]
    if failed:
        _raise(failed, len(gathered))
    if agree_on is not None:
        _agree(agree_on, result, [d for _, d in gathered])
    return result


def _agree(agreement: Agreement, result, digests: list[dict[str, str]]) -> None:
    """E410 on every rank when the ranks' digests differ: per aspect, which ranks have which
    version, and (from the first rank of each version) what the difference is."""
    lines: list[str] = []
    for aspect in sorted({a for d in digests for a in d}):
        versions: dict[str | None, list[int]] = {}
        for r, d in enumerate(digests):
            versions.setdefault(d.get(aspect), []).append(r)
        if len(versions) < 2:
            continue
        groups = list(versions.values())
        lines.append(f"{aspect}: " + "; ".join(f"{_ranks(g)} {'has' if len(g) == 1 else 'have'} {str(v)[:12]}"
                                             for v, g in versions.items()))
        if agreement.detail is None or agreement.explain is None:
            continue
        details = {g[0]: from_rank(g[0], lambda aspect=aspect: _safely(agreement.detail, result, aspect),
                                   "describing a difference") for g in groups[:MAX_VERSIONS]}
        try:
            lines.extend(f"  {s}" for s in agreement.explain(aspect, details))
        except Exception as exc:  # noqa: BLE001 - the digests above still say who differs
            lines.append(f"  (the difference could not be described: {type(exc).__name__}: {exc})")
    if lines:
        raise RemapError(Diagnostic(code="E410", message=f"ranks disagree on the {agreement.what}:\n"
                                    + "\n".join(lines), hint=agreement.hint))


def _safely(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - described as text instead
        return f"<{type(exc).__name__}: {exc}>"


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`: a list of ranks, runs collapsed."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _report(error: BaseException) -> tuple:
    """What other ranks need to raise the same error: its kind, text and diagnostics."""
    return type(error).__name__, str(error), error.diagnostics if isinstance(error, RemapError) else None


def _raise(failed: list[tuple[int, tuple]], world: int) -> None:
    """The one error every rank raises for the failures of `failed` (rank, report): user errors
    keep their diagnostics and class, each message naming the ranks it came from unless every rank
    raised it; anything else is E411, naming each rank with its error."""
    if all(rep[2] is not None for _, rep in failed):  # user errors: the same diagnostics everywhere
        seen: dict[str, tuple[Diagnostic, list[int]]] = {}
        for r, rep in failed:
            for d in rep[2]:
                seen.setdefault(d.render(), (d, []))[1].append(r)
        shown = tuple(d if len(ranks) == world else
                      d.model_copy(update={"message": f"{d.message} (on {_ranks(ranks)})"})
                      for d, ranks in seen.values())
        kinds = {rep[0] for _, rep in failed}
        error = _error_class(kinds.pop() if len(kinds) == 1 else "RemapError")(shown)
    else:
        lines = [f"{_ranks([r])}: {kind}: {errors.shorten(text, 500)}" for r, (kind, text, _) in failed]
        error = RemapError(Diagnostic(code="E411", message=f"{len(failed)} of {world} ranks failed:\n"
                                      + "\n".join(lines)))
    error.failed_ranks = tuple(r for r, _ in failed)
    raise error


def _error_class(name: str) -> type[RemapError]:
    """The RemapError subclass of that name (so `except BindError` holds on every rank)."""
    todo, found = [RemapError], {}
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found.get(name, RemapError)


def broadcast_from_first(tensors: list) -> None:
    """Rank 0's contents of each tensor, on every rank: a device tensor over the default group, a
    CPU one over the control group. Bytes travel as uint8, so dtypes the backend cannot carry (FP8
    on gloo) pass unchanged."""
    if not active():
        return
    for tensor in tensors:
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = buffer.view(torch.uint8) if buffer.dim() else buffer.reshape(1).view(torch.uint8)
        on_device = flat.device.type != "cpu"
        group = None if on_device else control_group()
        _settled(lambda flat=flat, group=group: dist.broadcast(flat, src=0, group=group, async_op=True), [flat],
                 "broadcasting replicated tensors", bound=not on_device)
        if buffer is not tensor:
            tensor.copy_(buffer)


def gather_all(value: T, phase: str = "exchanging") -> list[T]:
    """Every rank's `value` (picklable), in rank order (one all-gather of its size, one of its bytes)."""
    if not active():
        return [value]
    return [pickle.loads(b) for b in _all_gather_bytes(_dumps(value), phase)]


def exchange(send: torch.Tensor, sizes: list[int], phase: str = "exchanging") -> list[torch.Tensor]:
    """All to all over the control group: the first `sizes[0]` bytes of `send` (flat uint8, on the
    CPU) go to rank 0, the next `sizes[1]` to rank 1, ...; returns what each rank sent this one, in
    rank order (views of one buffer; one exchange of the sizes, one of the bytes)."""
    group = control_group()
    outgoing = torch.tensor(sizes, dtype=torch.int64)
    incoming = torch.empty(len(sizes), dtype=torch.int64)
    _settled(lambda: dist.all_to_all_single(incoming, outgoing, group=group, async_op=True),
             [outgoing, incoming], phase)
    counts = incoming.tolist()
    received = torch.empty(sum(counts), dtype=torch.uint8)
    _settled(lambda: dist.all_to_all_single(received, send, counts, list(sizes), group=group, async_op=True),
             [send, received], phase)
    return list(torch.split(received, counts))


def _dumps(value) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _broadcast_bytes(payload: bytes | None, source: int, phase: str) -> bytes:
    """`payload` of rank `source` on every rank: its size, then its bytes (two broadcasts)."""
    group = control_group()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    _settled(lambda: dist.broadcast(size, src=source, group=group, async_op=True), [size], phase)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    _settled(lambda: dist.broadcast(data, src=source, group=group, async_op=True), [data], phase)
    return payload if payload is not None else data.numpy().tobytes()


def _all_gather_bytes(payload: bytes, phase: str) -> list[bytes]:
    """Every rank's `payload`, in rank order: the sizes, then the bytes padded to the longest."""
    group = control_group()
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _settled(lambda: dist.all_gather(sizes, size, group=group, async_op=True), [size, *sizes], phase)
    lengths = [int(s.item()) for s in sizes]
    data = torch.zeros(max(lengths), dtype=torch.uint8)
    data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(world)]
    _settled(lambda: dist.all_gather(out, data, group=group, async_op=True), [data, *out], phase)
    return [o[:n].numpy().tobytes() for o, n in zip(out, lengths)]


def control_group():
    """The group control exchanges go over: None (the default group) when that has a backend for
    CPU tensors or there is no group, else a gloo group over the same ranks, made once per default
    group by every rank at the same exchange (its first). The ranks first meet in the group's
    store, so a rank that never arrives is named within the call's timeout instead of blocking
    the group's creation. A caller's own collectives on CPU tensors can use it too (`group=`)."""
    global _control, _GROUPS_MADE
    if not active():
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
    """Wait, at most the call's timeout, until every rank has reached `name` (through the store:
    one entry and one count a rank); else E415 naming the ranks that did not."""
    store = _store()
    me, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{name}/{me}", b"1")
    if store.add(f"{name}/count", 1) == world:
        store.set(f"{name}/all", b"1")
    limit = _timeout.get()
    try:
        store.wait([f"{name}/all"], datetime.timedelta(seconds=limit))
    except Exception:  # noqa: BLE001 - the store's timeout error differs by store and version
        missing = [r for r in range(world) if not store.check([f"{name}/{r}"])]
        raise _late(missing, limit, phase) from None


def _store():
    """The store the default group was made with (where the ranks meet and answer roll calls)."""
    return dist.distributed_c10d._get_default_store()


def _late(missing: list[int], limit: float, phase: str) -> RemapError:
    """E415: this rank waited `limit` seconds while `phase` for `missing`, which never arrived."""
    what = f"{_ranks(missing)} never arrived" if missing else \
        "every rank arrived, at different exchanges (the ranks made different calls)"
    error = RemapError(Diagnostic(
        code="E415", message=f"rank {dist.get_rank()} waited {limit:g} s while {phase}: {what}",
        hint="every rank must make the same remapdsl calls in the same order; the rank named is stuck, "
             "slower (still working on an earlier step), or never made this call: its own log says which. "
             "Raise `timeout=` if ranks legitimately arrive further apart"))
    error.failed_ranks = tuple(missing)
    return error


def _settled(start: Callable[[], Any], buffers: list[torch.Tensor], phase: str, bound: bool = True) -> None:
    """Run one collective to completion and return only once the backend holds none of `buffers`.

    A finished work stays referenced by the backend's worker thread for a moment after `wait()`
    returns; the tensors it holds keep a reference to their Python objects, so each buffer's
    reference count is above what it was before the collective until the backend lets go. Waiting
    for that here (the interpreter lock released, so the thread can finish) means no buffer of
    this module is ever freed on a backend thread, and none is left for interpreter shutdown.

    With `bound` (a control exchange), the wait is bounded by the call's timeout: past
    ARRIVAL_SECONDS this rank notes its arrival in the store; past the timeout, the ranks that did
    not note theirs are named (E415). A collective the backend fails (a peer process gone, the
    group's own timeout passed) is E413 on this rank, naming the phase and the ranks lost.
    """
    global _COLLECTIVES
    _COLLECTIVES += 1
    before = _references(buffers)
    try:
        work = start()
        if bound:
            _wait_bounded(work, phase)
        else:
            work.wait()
    except RemapError:
        raise
    except Exception as exc:  # noqa: BLE001 - the backend's own error types differ by backend and version
        raise RemapError(Diagnostic(
            code="E413", message=f"rank {dist.get_rank()} lost the group while {phase}: "
            f"{_roll_call(_COLLECTIVES)}; {type(exc).__name__}: {_first_sentence(exc)}",
            hint="a rank died, was killed or left, or did not reach this step within the process "
                 "group's timeout (`init_process_group(timeout=...)`); its own log says why")) from None
    del work
    deadline, pause = time.monotonic() + SETTLE_SECONDS, 1e-5
    while _references(buffers) > before and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 1e-2)


def _wait_bounded(work, phase: str) -> None:
    """Wait for `work` at most the call's timeout. Past ARRIVAL_SECONDS this rank notes in the
    store that it waits here (cleared once the work is done), so that after a timeout the ranks
    not waiting can be named (E415). A backend error is raised as it is (its work is completed)."""
    limit = _timeout.get()
    first = min(ARRIVAL_SECONDS, limit)
    if _waited(work, first):
        return
    store, key = _store(), _waiting(dist.get_rank())
    store.set(key, str(_COLLECTIVES))
    if _waited(work, limit - first):
        store.set(key, "")
        return
    raise _late(_missing(), limit, phase)


def _waited(work, limit: float) -> bool:
    """True once `work` finished within `limit` seconds, False if it has not; its error if it failed."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except Exception:
        if work.is_completed():  # it failed: the backend's own error
            raise
        return False
    return True


def _waiting(rank: int) -> str:
    """The store's entry saying at which collective `rank` is waiting long ("" once it is not)."""
    return f"remapdsl/waiting/{rank}"


def _missing() -> list[int]:
    """The ranks not waiting in an exchange (at this collective or any other: a broadcast's
    receivers may finish it and wait at the next while its root still waits for a rank that never
    came), after waiting up to ROLL_CALL_SECONDS for them (a rank that arrived a moment ago notes
    it within ARRIVAL_SECONDS)."""
    store, world, me = _store(), dist.get_world_size(), dist.get_rank()

    def behind(r: int) -> bool:
        key = _waiting(r)
        return not store.check([key]) or not store.get(key)

    missing = [r for r in range(world) if r != me]
    deadline = time.monotonic() + ROLL_CALL_SECONDS
    while True:
        missing = [r for r in missing if behind(r)]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


def _roll_call(collective: int) -> str:
    """Which ranks are gone, after a collective failed: every survivor notes in the process
    group's store that it is waiting at this collective, then waits up to ROLL_CALL_SECONDS for
    the others to be noted waiting too. The store is
    the one the group was made with; if it is gone too (rank 0 hosts a TCPStore), so is rank 0,
    most likely."""
    try:
        _store().set(_waiting(dist.get_rank()), str(collective))
        missing = _missing()
    except Exception as exc:  # noqa: BLE001 - a store that is gone fails with the backend's own errors
        return (f"the group's store cannot be reached either ({type(exc).__name__}): rank 0, which "
                "usually hosts it, may be the one lost")
    if not missing:
        return "every rank answered a roll call afterwards (a rank left the group, or a network fault)"
    named = ", ".join(map(str, missing))
    return (f"rank{'s' if len(missing) > 1 else ''} {named} did not answer a roll call within "
            f"{ROLL_CALL_SECONDS:g} s (lost or stuck)")


def _first_sentence(exc: BaseException) -> str:
    """The backend's message, without the advice gloo appends to every error."""
    text = str(exc).strip().split(". This is typically caused", 1)[0]
    return errors.shorten(text, 300)


def _references(buffers: list[torch.Tensor]) -> int:
    """The references to all of `buffers` together (counted the same way before and after)."""
    total = 0
    for buffer in buffers:
        total += sys.getrefcount(buffer)
    return total
