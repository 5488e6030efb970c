"""The only caller of torch.distributed: share headers, agree on the compiled rules, fail together.

Interface (every rank calls each function, in this order, as DCP's planners do):
`share_inventory` (rank 0 reads the headers, the others receive them), `together(fn[, agree_on])`
(run a phase; an error on any rank becomes the same error, naming every failing rank, on all ranks,
instead of a hang; with `agree_on`, the ranks also compare the digest of what they compiled).
Each is one collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ..checkpoint import Inventory, open_inventory
from ..errors import Diagnostic, RemapError

T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def share_inventory(checkpoint) -> Inventory:
    """Rank 0 reads the checkpoint's headers once; every rank gets the same Inventory (one
    broadcast, carrying either the inventory or rank 0's error)."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    return from_first(lambda: open_inventory(checkpoint))  # pickled: rank 0 validated it


def from_first(fn: Callable[[], T]) -> T:
    """Rank 0's `fn()`, on every rank (one broadcast); an error there is raised on every rank."""
    if not active():
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (None, fn())
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then raised
            box[0] = (_report(exc), None)
    dist.broadcast_object_list(box, src=0)
    report, value = box[0]
    if report is not None:
        _raise([(0, report)], dist.get_world_size())
    return value


def together(fn: Callable[[], T], agree_on: tuple[str, Callable[[T], str]] | None = None) -> T:
    """Run one phase on every rank; if any rank fails, all raise the same error naming the ranks.

    With `agree_on=(what, digest)`, the ranks also compare `digest(result)` in the same exchange:
    a rank that compiled something else (other rules, other checkpoint) makes every rank fail
    with a message naming the difference, not hang.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
        error = exc
    if not active():
        if error is not None:
            raise error
        return result
    mine = (_report(error), None) if error is not None else (
        None, agree_on[1](result) if agree_on is not None else None)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [(r, report) for r, (report, _) in enumerate(gathered) if report is not None]
    if failed:
        _raise(failed, len(gathered))
    digests = [digest for _, digest in gathered]
    if agree_on is not None and len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        detail = "; ".join(f"ranks {v} have {k[:12]}" for k, v in groups.items())
        raise RemapError(Diagnostic(code="E410", message=f"ranks disagree on the {agree_on[0]}: {detail}",
                                    hint="every rank must load the same rules from the same checkpoint"))
    return result


def _report(error: BaseException) -> tuple:
    """What other ranks need to raise the same error: its kind, text and diagnostics."""
    return type(error).__name__, str(error), error.diagnostics if isinstance(error, RemapError) else None


def _raise(failed: list[tuple[int, tuple]], world: int) -> None:
    if all(rep[2] is not None for _, rep in failed):  # user errors: the same diagnostics everywhere
        seen: dict[str, Diagnostic] = {}
        for _, rep in failed:
            for d in rep[2]:
                seen.setdefault(d.render(), d)
        raise RemapError(tuple(seen.values()))
    lines = [f"rank {r}: {kind}: {text}" for r, (kind, text, _) in failed]
    raise RemapError(Diagnostic(code="E411", message=f"{len(failed)} of {world} ranks failed:\n"
                                + "\n".join(lines)))


def broadcast_from_first(tensors: list) -> None:
    """Rank 0's contents of each tensor, on every rank. Bytes travel as uint8, so dtypes the
    backend cannot carry (FP8 on gloo) pass unchanged."""
    if not active():
        return
    import torch

    for tensor in tensors:
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.broadcast(buffer.view(torch.uint8) if buffer.dim() else buffer.reshape(1).view(torch.uint8), src=0)
        if buffer is not tensor:
            tensor.copy_(buffer)

