"""The only caller of torch.distributed: share headers, agree on the compiled rules, fail together.

Interface (every rank calls each function, in this order, as DCP's planners do):
`share_inventory` (rank 0 reads the headers, the others receive them), `agree` (all ranks compare
the digest of what they compiled), `together(fn)` (run a phase; an error on any rank becomes the
same error, naming every failing rank, on all ranks, instead of a hang).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from .checkpoint import Inventory, open_inventory
from .errors import Diagnostic, RemapError

T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def share_inventory(checkpoint) -> Inventory:
    """Rank 0 reads the checkpoint's headers once; every rank gets the same Inventory."""
    if isinstance(checkpoint, Inventory):
        return checkpoint
    if not active():
        return open_inventory(checkpoint)
    box: list = [None]
    if dist.get_rank() == 0:
        box[0] = together(lambda: open_inventory(checkpoint).model_dump_json())
    else:
        together(lambda: None)
    dist.broadcast_object_list(box, src=0)
    return Inventory.model_validate_json(box[0])


def agree(digest: Callable[[], str], what: str) -> None:
    """Every rank compiled the same thing, or every rank fails with a message naming the difference.
    `digest` is called only in a distributed job (hashing a large Compiled takes a while)."""
    if not active():
        return
    digest = digest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        detail = "; ".join(f"ranks {v} have {k[:12]}" for k, v in groups.items())
        raise RemapError(Diagnostic(code="E410", message=f"ranks disagree on the {what}: {detail}",
                                    hint="every rank must load the same rules from the same checkpoint"))


def together(fn: Callable[[], T]) -> T:
    """Run one phase on every rank; if any rank fails, all raise the same error naming the ranks."""
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
    report = None
    if error is not None:
        diagnostics = error.diagnostics if isinstance(error, RemapError) else None
        report = (type(error).__name__, str(error), diagnostics)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if not failed:
        return result
    if all(rep[2] is not None for _, rep in failed):  # user errors: the same diagnostics everywhere
        seen: dict[str, Diagnostic] = {}
        for _, rep in failed:
            for d in rep[2]:
                seen.setdefault(d.render(), d)
        raise RemapError(tuple(seen.values()))
    lines = [f"rank {r}: {kind}: {text}" for r, (kind, text, _) in failed]
    raise RemapError(Diagnostic(code="E411", message=f"{len(failed)} of {len(reports)} ranks failed:\n"
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

