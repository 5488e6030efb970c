"""The reader's errors (E600-E609), and `remap_errors`, which takes a RemapError back out of the
CheckpointException DCP wraps what ranks raise in."""

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
    """Around `dcp.load`: DCP's CheckpointException re-raised as the lowest failing rank's RemapError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        error = next((failure[0] for _, failure in sorted(exc.failures.items())
                      if isinstance(failure[0], RemapError)), None)
        if error is None:
            raise
        error.failed_ranks = tuple(sorted(exc.failures))
        raise error from exc
