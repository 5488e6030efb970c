"""Bounded host staging for bytes bound for a device: per reader thread a ring of pinned buffers, each
reused once its asynchronous copy finished, so a rank pins at most the bound whatever it loads."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..errors import Diagnostic, RemapError


class Staging(NamedTuple):
    """`buffers` buffers of `buffer_bytes` per reader thread, pinned where CUDA is (`everything`: CPU too)."""

    buffer_bytes: int = 2 << 20
    buffers: int = 4
    pin: bool = True
    everything: bool = False

    def bound(self, threads: int) -> int:
        """The most staging bytes a load on `threads` reader threads allocates."""
        return max(1, threads) * self.buffers * self.buffer_bytes


STAGING = Staging()  # a call's default bound: 16 MiB, four 2 MiB buffers for each of two threads


def staging_within(staging_bytes: int | None) -> Staging:
    """The staging of a call's `staging_bytes=` (None: STAGING) on its two reader threads: 2 MiB buffers
    filling a thread's share, else two of half of it. E416 under two 1 kB buffers a thread."""
    if staging_bytes is None:
        return STAGING
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 4 << 10:
        raise RemapError(Diagnostic(code="E416", message=f"staging_bytes={staging_bytes!r} is not a whole number of "
                                    "bytes of at least 4 kB (two staging buffers of at least 1 kB for each of 2 "
                                    "reader threads)",
                                    hint=f"the default is {STAGING.bound(2) >> 20} MiB: the most host memory a call "
                                         "pins to copy bytes to a device"))
    share = staging_bytes // 2
    if share >= 2 * STAGING.buffer_bytes:
        return STAGING._replace(buffers=share // STAGING.buffer_bytes)
    return STAGING._replace(buffer_bytes=share // 2, buffers=2)


# (bytes, fill): a piece of a destination in order; `fill(buffer)` writes its bytes into `buffer`
Piece = tuple[int, Callable[[torch.Tensor], object]]


class StagingRing:
    """At most `buffers` host buffers, each filled, then copied (to a CUDA device asynchronously)."""

    def __init__(self, staging: Staging = STAGING, event: Callable[[torch.device], object] | None = None):
        if staging.buffer_bytes < 1 or staging.buffers < 1:
            raise ValueError(f"a staging ring needs at least one buffer of at least one byte, not {staging}")
        self.staging = staging
        self.allocated = 0
        self._made = 0  # buffers made
        self._free: list[torch.Tensor] = []
        self._busy: deque[tuple[torch.Tensor, object]] = deque()  # (buffer, event), oldest first
        self._event = event or _event_after_copy

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def upload(self, destination: torch.Tensor, pieces: Iterable[Piece]) -> None:
        """Fill `destination` (flat uint8, any device) from `pieces` in order, each through one buffer."""
        at = 0
        for nbytes, fill in pieces:
            if nbytes > self.staging.buffer_bytes:
                raise ValueError(f"a piece of {nbytes} bytes does not fit a {self.staging.buffer_bytes}-byte buffer")
            buffer = self._take()
            piece = buffer[:nbytes]
            try:
                fill(piece)
                destination[at:at + nbytes].copy_(piece, non_blocking=True)
            except BaseException:
                self._free.append(buffer)  # its copy never started
                raise
            self._busy.append((buffer, self._event(destination.device)))
            at += nbytes
        if at != destination.numel():
            raise ValueError(f"the pieces hold {at} bytes, the destination {destination.numel()}")

    def _take(self) -> torch.Tensor:
        """A free buffer, a new one while fewer than `buffers` exist, else the oldest once its copy ends."""
        for _ in range(len(self._busy)):  # those finished, in order: the newest ends on top
            buffer, event = self._busy.popleft()
            if event is None or event.query():
                self._free.append(buffer)
            else:
                self._busy.append((buffer, event))
        if self._free:
            return self._free.pop()
        if self._made < self.staging.buffers:
            buffer = torch.empty(self.staging.buffer_bytes, dtype=torch.uint8,
                                 pin_memory=self.staging.pin and torch.cuda.is_available())
            self._made += 1
            self.allocated += buffer.numel()
            return buffer
        return self._oldest()

    def _oldest(self) -> torch.Tensor:
        """The buffer whose copy began first, once that copy ended."""
        buffer, event = self._busy.popleft()
        if event is not None:
            event.synchronize()
        return buffer

    def close(self) -> None:
        """Wait for every copy still in flight; the buffers are kept for the next upload."""
        while self._busy:
            self._free.append(self._oldest())


class Rings:
    """The staging rings of a call: a thread takes one at its first staged item, hands it back (`release`)."""

    def __init__(self, staging: Staging = STAGING):
        self.staging = staging
        self._held: dict[int, StagingRing] = {}
        self._idle: list[StagingRing] = []
        self._made: list[StagingRing] = []
        self._lock = threading.Lock()

    def staged(self, tensor: torch.Tensor) -> bool:
        """Whether bytes bound for `tensor` go through a ring (a device tensor, or `everything`)."""
        return tensor.device.type != "cpu" or self.staging.everything

    def ring(self) -> StagingRing:
        thread = threading.get_ident()
        with self._lock:
            if thread not in self._held:
                if not self._idle:
                    self._made.append(StagingRing(self.staging))
                    self._idle.append(self._made[-1])
                self._held[thread] = self._idle.pop()
            return self._held[thread]

    def release(self) -> None:
        """This thread stops staging: its ring (copies still in flight included) goes idle."""
        with self._lock:
            ring = self._held.pop(threading.get_ident(), None)
            if ring is not None:
                self._idle.append(ring)

    @property
    def allocated(self) -> int:
        return sum(r.allocated for r in self._made)

    @property
    def count(self) -> int:
        return len(self._made)

    def close(self) -> None:
        """Wait for every copy and the device's work on it, so the tensors are ready on any stream."""
        for ring in self._made:
            ring.close()
        if self._made and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def __enter__(self) -> Rings:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _event_after_copy(device: torch.device):
    """A CUDA event recorded after the copy just issued on `device`; None for a (synchronous) CPU copy."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def run_pieces(file: str, runs, reader, most: int) -> Iterable[Piece]:
    """The bytes of a strided run set of `file`, in order, as pieces of at most `most` bytes."""
    if runs.length <= most:
        for chunk in runs.chunks(max(1, most // max(1, runs.length))):
            yield chunk.total, lambda buffer, chunk=chunk: reader.read_runs_into(file, chunk, buffer)
        return
    for start in runs.starts():
        for at in range(0, runs.length, most):
            n = min(most, runs.length - at)
            yield n, lambda buffer, offset=start + at: reader.read_into(file, offset, buffer)


def tensor_pieces(source: torch.Tensor, most: int) -> Iterable[Piece]:
    """The bytes of a contiguous CPU tensor, in order, as pieces of at most `most` bytes."""
    flat = source.reshape(-1).view(torch.uint8)
    for at in range(0, flat.numel(), most):
        piece = flat[at:at + most]
        yield piece.numel(), lambda buffer, piece=piece: buffer.copy_(piece)
