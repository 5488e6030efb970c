"""Positioned byte-range reads from an inventory's files into caller-owned memory (`os.preadv`, thread-safe;
many short runs one strided copy from the file's map): each range checked first, a changed file refused."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from types import TracebackType

import numpy as np
from numpy.lib.stride_tricks import as_strided

from remapdsl.checkpoint.inventory import Inventory
from remapdsl.errors import CheckpointError, Diagnostic, did_you_mean
from remapdsl.indexmap import Runs

MANY_RUNS = 64  # above this many runs, a run set is copied from the mapped file, not read run by run
IOV_MAX = 1024  # the most buffers one preadv takes (POSIX IOV_MAX on Linux)


def as_byte_view(buffer: object) -> memoryview:
    """A writable, flat byte view of buffer's memory (a contiguous CPU torch tensor or a buffer object)."""
    if type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1 and buffer.c_contiguous \
            and not buffer.readonly:
        return buffer  # already one
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # a torch tensor, without importing torch
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"need a contiguous CPU tensor, got {buffer.device.type} tensor, "
                             f"stride {buffer.stride()}")
        nbytes = buffer.numel() * buffer.element_size()
        return bytes_at(buffer.data_ptr(), nbytes) if nbytes else memoryview(bytearray())
    view = memoryview(buffer)  # type: ignore[arg-type]
    if view.readonly:
        raise ValueError("the destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("the destination buffer is not contiguous")
    return view.cast("B")


def bytes_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` of memory at `address` (a tensor's)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


class CheckpointReader:
    """Reads byte ranges (absolute offsets) of one inventory's files, opening each on first use."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
            maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the map closes when it is collected
                pass
        for fd in fds.values():
            os.close(fd)

    def mapped(self, file: str) -> mmap.mmap:
        """The whole file mapped read-only (many small strided runs copied without a read call each)."""
        fd = self._fd(file)
        self._check_unchanged(file, fd)  # each time: a map of a file truncated since would fault
        with self._lock:
            if file not in self._maps:
                try:
                    self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                except OSError as exc:
                    info = self.inventory.files[file]
                    raise self._failed(file, info.data_offset, info.nbytes, exc, "mapping") from None
            return self._maps[file]

    def read_into(self, file: str, byte_offset: int, buffer: object) -> int:
        """Fill buffer with the bytes of `file` from `byte_offset` on (its data section); returns how many."""
        return self.scatter_into(file, byte_offset, [as_byte_view(buffer)])

    def _check_range(self, file: str, start: int, end: int) -> None:
        """Bytes [start, end) must lie in the data section of a file of the checkpoint."""
        info = self.inventory.files.get(file)
        if info is None:
            raise CheckpointError(Diagnostic(
                code="E341", message=f"{file} is not a file of this checkpoint", path=self.inventory.path(file),
                hint=did_you_mean(file, self.inventory.files)))
        if start < info.data_offset or end > info.nbytes:
            raise CheckpointError(Diagnostic(
                code="E340", message=f"{file}: read of bytes [{start}, {end}) leaves the data section "
                f"[{info.data_offset}, {info.nbytes})", path=self.inventory.path(file)))

    def read_runs_into(self, file: str, runs: Runs, buffer: object) -> int:
        """Fill buffer with the concatenated bytes of a strided run set of `file`; returns how many."""
        view = as_byte_view(buffer)
        if view.nbytes != runs.total:
            raise ValueError(f"the buffer has {view.nbytes} bytes, the runs {runs.total}")
        self._check_range(file, runs.first, runs.end)
        if runs.count <= MANY_RUNS:
            for i, start in enumerate(runs.starts()):
                self._read_fully(file, [view[i * runs.length:(i + 1) * runs.length]], start, runs.length)
            return view.nbytes
        shape = runs.counts + (runs.length,)
        source = np.frombuffer(self.mapped(file), dtype=np.uint8)[runs.first:]
        np.copyto(np.frombuffer(view, dtype=np.uint8).reshape(shape),
                  as_strided(source, shape, runs.strides + (1,), writeable=False))
        return view.nbytes

    def scatter_into(self, file: str, first: int, buffers: list[memoryview]) -> int:
        """Fill `buffers` in order with the bytes of `file` from `first` on, in one positioned read."""
        total = sum(b.nbytes for b in buffers)
        self._check_range(file, first, first + total)
        self._read_fully(file, buffers, first, total)
        return total

    def _read_fully(self, file: str, buffers: list[memoryview], first: int, total: int) -> None:
        """Positioned reads of `file` from `first` into `buffers` until all `total` bytes are in."""
        if not total:
            return
        fd, done, at = self._fd(file), 0, 0
        while done < total:
            try:
                got = _preadv_many(fd, buffers[at:], first + done)
            except OSError as exc:
                raise self._failed(file, first + done, first + total, exc) from None
            if got == 0:
                raise CheckpointError(Diagnostic(
                    code="E342", message=f"{file}: file ended at byte {first + done}, wanted bytes up to "
                    f"{first + total}", path=self.inventory.path(file),
                    hint="the file was truncated after the checkpoint was opened"))
            done += got
            while at < len(buffers) and got >= buffers[at].nbytes:  # drop the buffers filled whole
                got -= buffers[at].nbytes
                at += 1
            if got:  # a buffer filled in part: its rest first
                buffers = buffers[:at] + [buffers[at][got:]] + buffers[at + 1:]

    def read_tensor_into(self, ckpt_key: str, buffer: object, *, start: int = 0) -> int:
        """Fill buffer with len(buffer) bytes of tensor `ckpt_key`, from `start` bytes into the tensor."""
        tensor = self.inventory.tensors.get(ckpt_key)
        if tensor is None:
            raise CheckpointError(Diagnostic(
                code="E341", message=f"tensor `{ckpt_key}` is not in the checkpoint", path=self.inventory.root,
                hint=did_you_mean(ckpt_key, self.inventory.tensors)))
        chunks = self.inventory.chunks.get(ckpt_key)
        if chunks is not None:  # its bytes are not one range: the plans read each chunk's part
            raise CheckpointError(Diagnostic(
                code="E357", message=f"tensor `{ckpt_key}` is stored in {len(chunks)} DCP chunks "
                f"({', '.join(sorted({c.file for c in chunks})[:4])}): it has no single byte range to read",
                path=self.inventory.path(tensor.file),
                hint="load it through rules (remapdsl.load), or consolidate the checkpoint first "
                "(`remapdsl convert CKPT OUT --rules identity`)"))
        view = as_byte_view(buffer)
        if start < 0 or start + view.nbytes > tensor.nbytes:
            raise CheckpointError(Diagnostic(
                code="E340", message=f"{tensor.file}: read of bytes [{start}, {start + view.nbytes}) "
                f"of tensor `{ckpt_key}` leaves the tensor's {tensor.nbytes} bytes",
                path=self.inventory.path(tensor.file)))
        return self.read_into(tensor.file, tensor.byte_offset + start, view)

    def read_tensor(self, ckpt_key: str) -> bytearray:
        """A tensor's whole bytes, in a new bytearray (for small tensors and tests)."""
        tensor = self.inventory.tensors.get(ckpt_key)
        out = bytearray(tensor.nbytes if tensor is not None else 0)
        self.read_tensor_into(ckpt_key, out)
        return out

    def _fd(self, file: str) -> int:
        """The open descriptor of file, opened (and checked unchanged) on first use."""
        with self._lock:
            fd = self._fds.get(file)
            if fd is not None:
                return fd
            path = self.inventory.path(file)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(Diagnostic(
                    code="E301", message=f"{file}: cannot open the file ({exc.strerror})", path=path)) from None
            try:
                self._check_unchanged(file, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fds[file] = fd
            return fd

    def _check_unchanged(self, file: str, fd: int) -> None:
        """E342 unless the open file has the size and modification time recorded when its header was read."""
        st, info = os.fstat(fd), self.inventory.files[file]
        if st.st_size != info.nbytes:
            found = f"has {st.st_size} bytes, its header said {info.nbytes}"
        elif info.mtime_ns is not None and st.st_mtime_ns != info.mtime_ns:
            found = (f"was modified after its header was read (modification time {info.mtime_ns} ns, now "
                     f"{st.st_mtime_ns} ns), so its bytes may no longer be the ones its header describes")
        else:
            return
        raise CheckpointError(Diagnostic(
            code="E342", message=f"{file}: file {found}", path=self.inventory.path(file),
            hint="the file changed after the checkpoint was opened (copied over, truncated or rewritten); "
                 "open it again once nothing writes to it"))

    def _failed(self, file: str, start: int, end: int, exc: OSError, verb: str = "reading") -> CheckpointError:
        """E343: an operating-system error while reading bytes [start, end) of `file`, naming their tensors."""
        keys = [t.ckpt_key for t in sorted(self.inventory.tensors.values(), key=lambda t: t.byte_offset)
                if t.file == file and t.byte_offset < end and start < t.byte_end]  # in file order
        of = (f"tensor `{keys[0]}`" if len(keys) == 1 else
              f"tensors `{keys[0]}` to `{keys[-1]}` ({len(keys)})" if keys else "the data section")
        return CheckpointError(Diagnostic(
            code="E343", message=f"{file}: {verb} bytes [{start}, {end}) of {of} failed: {os_error(exc)}",
            path=self.inventory.path(file),
            hint="the operating system could not read the file (a failing disk, a network file system "
                 "gone, a file removed under the load); its own log (dmesg) says more"))


def os_error(exc: OSError) -> str:
    """`EIO (Input/output error)`: an OSError's errno name and text, for a message."""
    name = errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno is not None else type(exc).__name__
    return f"{name} ({exc.strerror or exc})"


def _preadv_many(fd: int, buffers: list[memoryview], offset: int) -> int:
    """One positioned read into consecutive buffers (at most IOV_MAX); without preadv, into the first."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, buffers[:IOV_MAX], offset)
    chunk = os.pread(fd, buffers[0].nbytes, offset)
    buffers[0][: len(chunk)] = chunk
    return len(chunk)
