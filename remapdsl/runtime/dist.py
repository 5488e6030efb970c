"""The ranks' exchanges (every rank calls each function in the same order): share headers, agree on the
compiled rules, fail together. With bounds.py, the only caller of torch.distributed."""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .. import errors
from ..checkpoint import Inventory, open_inventory
from ..errors import Diagnostic, RemapError
from .bounds import control_group, ranks_text, roll_call, wait_bounded

T = TypeVar("T")

SETTLE_SECONDS = 5.0  # the most a finished collective waits for the backend to let go of its buffers
_COLLECTIVES = 0  # collectives this process has made through this module (a roll call's name)
MAX_VERSIONS = 4  # on a disagreement, the distinct versions of one aspect described


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def share_inventory(checkpoint, phase: str) -> Inventory:
    """Rank 0 reads the headers once; every rank gets the Inventory (or rank 0's error), restamped."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    inventory = from_first(lambda: open_inventory(checkpoint), phase)  # pickled: rank 0 validated it
    return inventory.restamped(checkpoint) if rank() != 0 else inventory  # this rank's own copy


def from_first(fn: Callable[[], T], phase: str, source: int = 0) -> T:
    """Rank `source`'s `fn()`, on every rank (one broadcast); an error there is raised on every rank, naming it."""
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
    """What the ranks must have been given alike, for `together(..., agree_on=...)`: `digests(result)` maps
    each aspect to a digest; where one differs, `explain(aspect, {rank: detail(result, aspect)})` says how."""

    what: str
    digests: Callable[[Any], dict[str, str]]
    detail: Callable[[Any, str], Any] | None = None
    explain: Callable[[str, dict[int, Any]], list[str]] | None = None
    hint: str = "every rank must load the same rules from the same checkpoint"


class Joint(NamedTuple):
    """What only the ranks together can check, for `together(..., joint=...)`: each rank's `part(result)`
    travels with the phase's outcome, and `check(parts)` (in rank order) runs alike on every rank."""

    part: Callable[[Any], Any]
    check: Callable[[list[Any]], None]


def together(fn: Callable[[], T], agree_on: Agreement | None = None, *, phase: str,
             joint: Joint | None = None) -> T:
    """Run one phase on every rank; if any rank fails, all raise the same error naming the ranks. With
    `agree_on`, differing digests are E410 on every rank; with `joint`, its check runs (in a job only)."""
    error: BaseException | None = None
    result = digests = part = None
    try:
        result = fn()
        if active():
            digests = agree_on.digests(result) if agree_on is not None else None
            part = joint.part(result) if joint is not None else None
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
        error = exc
    if not active():
        if error is not None:
            raise error
        return result
    mine = (_report(error), None, None) if error is not None else (None, digests, part)
    gathered = gather_all(mine, phase)
    failed = [(r, report) for r, (report, _, _) in enumerate(gathered) if report is not None]
    if failed:
        _raise(failed, len(gathered))
    if agree_on is not None:
        _agree(agree_on, result, [d for _, d, _ in gathered])
    if joint is not None:
        joint.check([p for _, _, p in gathered])
    return result


def _agree(agreement: Agreement, result, digests: list[dict[str, str]]) -> None:
    """E410 when the digests differ: per aspect, which ranks have which version, and what differs."""
    lines: list[str] = []
    for aspect in sorted({a for d in digests for a in d}):
        versions: dict[str | None, list[int]] = {}
        for r, d in enumerate(digests):
            versions.setdefault(d.get(aspect), []).append(r)
        if len(versions) < 2:
            continue
        groups = list(versions.values())
        lines.append(f"{aspect}: " + "; ".join(f"{ranks_text(g)} {'has' if len(g) == 1 else 'have'} {str(v)[:12]}"
                                             for v, g in versions.items()))
        if agreement.detail is None or agreement.explain is None:
            continue
        details = {g[0]: from_first(lambda aspect=aspect: _safely(agreement.detail, result, aspect),
                                    "describing a difference", g[0]) for g in groups[:MAX_VERSIONS]}
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


def _report(error: BaseException) -> tuple:
    """What other ranks need to raise the same error: its kind, text and diagnostics."""
    return type(error).__name__, str(error), error.diagnostics if isinstance(error, RemapError) else None


def _raise(failed: list[tuple[int, tuple]], world: int) -> None:
    """The one error every rank raises for `failed` (rank, report): user errors as they are, else E411."""
    if all(rep[2] is not None for _, rep in failed):  # user errors: the same diagnostics everywhere
        seen: dict[str, tuple[Diagnostic, list[int]]] = {}
        for r, rep in failed:
            for d in rep[2]:
                seen.setdefault(d.render(), (d, []))[1].append(r)
        shown = tuple(d if len(ranks) == world else
                      d.model_copy(update={"message": f"{d.message} (on {ranks_text(ranks)})"})
                      for d, ranks in seen.values())
        kinds = {rep[0] for _, rep in failed}
        error = _error_class(kinds.pop() if len(kinds) == 1 else "RemapError")(shown)
    else:
        lines = [f"{ranks_text([r])}: {kind}: {errors.shorten(text, 500)}" for r, (kind, text, _) in failed]
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
    """Rank 0's contents of each tensor on every rank, as uint8 (FP8 passes gloo)."""
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


def gather_all(value: T, phase: str) -> list[T]:
    """Every rank's `value` (picklable), in rank order (one all-gather of its size, one of its bytes)."""
    if not active():
        return [value]
    return [pickle.loads(b) for b in _all_gather_bytes(_dumps(value), phase)]


def exchange(send: torch.Tensor, sizes: list[int], phase: str) -> list[torch.Tensor]:
    """All to all over the control group: the first `sizes[0]` bytes of `send` (flat CPU uint8) go to
    rank 0, the next `sizes[1]` to rank 1, ...; returns what each rank sent this one, in rank order."""
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


def _settled(start: Callable[[], Any], buffers: list[torch.Tensor], phase: str, bound: bool = True) -> None:
    """Run one collective to completion, returning once the backend holds none of `buffers` (a tensor freed
    on a gloo thread at shutdown aborts the process). `bound`: the call's timeout (E415); failed: E413."""
    global _COLLECTIVES
    _COLLECTIVES += 1
    before = _references(buffers)
    try:
        work = start()
        if bound:
            wait_bounded(work, phase, _COLLECTIVES)
        else:
            work.wait()
    except RemapError:
        raise
    except Exception as exc:  # noqa: BLE001 - the backend's own error types differ by backend and version
        raise RemapError(Diagnostic(
            code="E413", message=f"rank {dist.get_rank()} lost the group while {phase}: "
            f"{roll_call(_COLLECTIVES)}; {type(exc).__name__}: "  # without the advice gloo appends to every error
            f"{errors.shorten(str(exc).strip().split('. This is typically caused', 1)[0], 300)}",
            hint="a rank died, was killed or left, or did not reach this step within the process "
                 "group's timeout (`init_process_group(timeout=...)`); its own log says why")) from None
    del work
    deadline, pause = time.monotonic() + SETTLE_SECONDS, 1e-5
    while _references(buffers) > before and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 1e-2)


def _references(buffers: list[torch.Tensor]) -> int:
    return sum(sys.getrefcount(buffer) for buffer in buffers)
