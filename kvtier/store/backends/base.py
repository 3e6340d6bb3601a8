"""The disk I/O back-end interface.

A back end moves bytes between a buffer and a position in an open file,
asynchronously. The disk store (slab files, slot headers, checksums) sits on
top and never cares which back end serves it: POSIX threads doing
preadv/pwritev, or kvikio's CuFile (GPUDirect Storage where available).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, ClassVar

# O_DIRECT wants file offsets, lengths and buffer addresses aligned to the
# logical block size of the device; 4 KiB satisfies every NVMe we target.
IO_ALIGNMENT = 4096


class BackendUnavailableError(RuntimeError):
    """The explicitly requested back end cannot be used on this machine."""


class DiskBackend(ABC):
    """Positional, asynchronous reads and writes on files.

    Contract:
      - ``open`` returns an opaque handle for a file that already exists with
        its final size (the disk store preallocates slab files).
      - ``submit_read`` / ``submit_write`` never block on the I/O itself; they
        return a Future that resolves to the number of bytes transferred, or
        raises ``OSError`` (with errno) on failure. A short transfer is
        reported as the smaller count, never silently padded.
      - ``buf`` is a host buffer (anything exposing the buffer protocol, e.g. a
        numpy uint8 array) whose address and length are multiples of
        ``IO_ALIGNMENT`` and ``offset`` is a multiple of ``IO_ALIGNMENT``.
        The kvikio back end also accepts a CUDA tensor.
      - Methods are thread-safe; ``close`` and ``shutdown`` wait for nothing
        but the back end's own bookkeeping (callers drain their futures first).
    """

    name: ClassVar[str]

    @abstractmethod
    def open(self, path: str, writable: bool = True) -> Any:
        """Open an existing file and return a handle for submit_*."""

    @abstractmethod
    def submit_read(self, handle: Any, buf: Any, offset: int) -> Future[int]:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""

    @abstractmethod
    def submit_write(self, handle: Any, buf: Any, offset: int) -> Future[int]:
        """Write all of ``buf`` at ``offset``."""

    @abstractmethod
    def close(self, handle: Any) -> None:
        """Close a handle returned by ``open``."""

    def fileno(self, handle: Any) -> int | None:
        """The OS descriptor behind ``handle`` if there is one (used to check
        that the file opened by name is the one checked before), else None."""
        return None

    def adopt(self, fd: int, path: str) -> Any | None:
        """A handle over ``fd``, a descriptor of ``path`` this process
        inherited open (a helper process given its parent's slabs:
        :func:`kvtier.store.child_process.spawn`), which the handle then
        owns; None where this back end opens files only by name (the
        caller then opens ``path``). The default: None."""
        return None

    def size(self, handle: Any) -> int | None:
        """The current size of the file open as ``handle`` (``fstat`` of its
        descriptor), or None when there is no descriptor or ``fstat``
        fails. Readers ask it after a short read: whether the file ended
        (truncated) or the device cut the read short."""
        fd = self.fileno(handle)
        if fd is None:
            return None
        try:
            return os.fstat(fd).st_size
        except OSError:
            return None

    def describe(self) -> str:
        """One line for logs: which back end, and in which mode."""
        return self.name

    def shutdown(self) -> None:
        """Release threads and driver state."""
        return
