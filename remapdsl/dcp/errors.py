"""The reader's errors, and errors made fit to cross DCP's collectives (codes E600-E609).

DCP runs a StorageReader's and its planner's steps inside its own exchanges, which pickle whatever a
rank raised to send it to the others (torch.distributed.checkpoint.utils `_DistWrapper`); an error
that cannot be rebuilt from its pickle would fail that exchange instead of being reported. So every
RemapError raised inside DCP's steps goes out as one that can.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import Diagnostic, RemapError


class ReaderError(RemapError):
    """A request of `dcp.load` that the rules cannot serve (E600-E609); survives pickling."""

    def __reduce__(self):
        return type(self), (self.diagnostics,)


def portable(exc: RemapError) -> RemapError:
    """`exc` itself if it survives a pickle round trip, else a ReaderError with its diagnostics."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send the diagnostics instead
        return ReaderError(exc.diagnostics)


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
