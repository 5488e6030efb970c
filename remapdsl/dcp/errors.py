"""The reader's errors, and errors made fit to cross DCP's collectives (codes E600-E609).

DCP runs a StorageReader's and its planner's steps inside its own exchanges, which pickle whatever a
rank raised to send it to the others (torch.distributed.checkpoint.utils `_DistWrapper`): every
RemapError is rebuilt from its pickle with its class and diagnostics (`RemapError.__reduce__`), and
`remap_errors` takes it back out of the CheckpointException DCP wraps it in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import Diagnostic, RemapError


class ReaderError(RemapError):
    """A request of `dcp.load` that the rules cannot serve (E600-E609); pickles, as every RemapError."""


def fail(code: str, message: str, hint: str | None = None, path: str | None = None) -> ReaderError:
    return ReaderError(Diagnostic(code=code, message=message, hint=hint, path=path))


@contextmanager
def remap_errors() -> Iterator[None]:
    """Around `dcp.load`: a CheckpointException that DCP raised for RemapErrors (its planning or
    reading steps wrap what ranks raise) re-raised as the RemapError of the lowest failing rank,
    with `failed_ranks`; any other exception passes unchanged. Every rank gets the same one."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        found = {rank: failure[0] for rank, failure in sorted(exc.failures.items())
                 if isinstance(failure[0], RemapError)}
        if not found:
            raise
        error = next(iter(found.values()))
        error.failed_ranks = tuple(sorted(exc.failures))
        raise error from exc
