"""POSIX disk back end: a thread pool doing preadv/pwritev, O_DIRECT if possible.

O_DIRECT keeps multi-GiB spill traffic out of the page cache (which would
otherwise evict the very DRAM the CPU tier lives in, and double-copy). Not
every file system accepts it (older tmpfs, some FUSE/overlay setups answer
EINVAL), so each directory is probed and falls back to buffered I/O with a
single warning. A probe that fails for another reason (no directory yet, a
full disk, EIO) says nothing about O_DIRECT: that file is opened buffered
and the next open probes again. Buffered I/O is still correct: the slot
format's checksums, not the page cache, guard integrity.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.safe_open import open_private
from kvtier.store.backends.base import IO_ALIGNMENT, DiskBackend

logger = get_logger("store")

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def _open_fd(path: str, flags: int, mode: int = 0o600) -> int:
    """open_private (O_NOFOLLOW | O_CLOEXEC, owner and write-bit checks on
    the opened descriptor), isolated so tests can simulate file systems rejecting
    O_DIRECT."""
    return open_private(path, flags, mode)


@dataclass(frozen=True)
class PosixHandle:
    """An open file: descriptor, path (for messages) and whether it is O_DIRECT."""

    fd: int
    path: str
    direct: bool


def _as_view(buf: Any) -> memoryview:
    if hasattr(buf, "numpy") and not isinstance(buf, memoryview):
        buf = buf.numpy()  # CPU torch tensor: share memory through numpy
    return memoryview(buf).cast("B")


class PosixBackend(DiskBackend):
    """preadv/pwritev on a thread pool (see DiskBackend for the contract).

    ``direct=False`` forces buffered I/O everywhere (no probe, no warning).
    With O_DIRECT a transfer that ends before the requested length at an
    unaligned count is reported short rather than retried, since the kernel
    only does that at end of file.
    """

    name = "posix"

    def __init__(self, threads: int = 4, *, direct: bool = True) -> None:
        self._threads = threads
        self._want_direct = direct and _O_DIRECT != 0
        self._pool = ThreadPoolExecutor(
            threads,
            thread_name_prefix="kvtier-posix",
            initializer=name_this_thread,
        )
        self._lock = threading.Lock()
        # realpath(directory) -> whether O_DIRECT works there, once a probe
        # settled it; directories whose probe failed otherwise, warned once.
        self._direct_dirs: dict[str, bool] = {}
        self._unsettled: set[str] = set()

    # -- O_DIRECT probing -------------------------------------------------

    def direct_supported(self, directory: str) -> bool:
        """Whether O_DIRECT works in ``directory``: probed until a probe
        settles it (see the module doc), then cached."""
        if not self._want_direct:
            return False
        key = os.path.realpath(directory)
        with self._lock:
            cached = self._direct_dirs.get(key)
            if cached is not None:
                return cached
            ok, reason, settled = probe_direct(key)
            if settled:
                self._direct_dirs[key] = ok
                warn = not ok
            else:
                warn = key not in self._unsettled
                self._unsettled.add(key)
        if warn:
            logger.warning(
                "O_DIRECT is not usable in %s (%s); falling back to buffered I/O "
                "%s (data goes through the page cache)",
                key,
                reason,
                "there" if settled else "until a probe there succeeds",
            )
        return ok

    # -- DiskBackend ------------------------------------------------------

    def open(self, path: str, writable: bool = True) -> PosixHandle:
        flags = os.O_RDWR if writable else os.O_RDONLY
        if self.direct_supported(os.path.dirname(os.path.abspath(path))):
            try:
                return PosixHandle(_open_fd(path, flags | _O_DIRECT), path, True)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                logger.warning(
                    "O_DIRECT open of %s failed (%s); using buffered I/O", path, exc
                )
        return PosixHandle(_open_fd(path, flags), path, False)

    def submit_read(self, handle: PosixHandle, buf: Any, offset: int) -> Future[int]:
        return self._pool.submit(_transfer, os.preadv, handle, _as_view(buf), offset)

    def submit_write(self, handle: PosixHandle, buf: Any, offset: int) -> Future[int]:
        return self._pool.submit(_transfer, os.pwritev, handle, _as_view(buf), offset)

    # Blocking variants for callers that already run on their own worker
    # threads (DiskStore under TransferEngine): skipping the pool saves a
    # thread hop per block, a large share of the time at queue depth 1.
    def read_sync(self, handle: PosixHandle, buf: Any, offset: int) -> int:
        """Like ``submit_read(...).result()`` but on the calling thread."""
        return _transfer(os.preadv, handle, _as_view(buf), offset)

    def write_sync(self, handle: PosixHandle, buf: Any, offset: int) -> int:
        """Like ``submit_write(...).result()`` but on the calling thread."""
        return _transfer(os.pwritev, handle, _as_view(buf), offset)

    def close(self, handle: PosixHandle) -> None:
        os.close(handle.fd)

    def fileno(self, handle: PosixHandle) -> int:
        return handle.fd

    def adopt(self, fd: int, path: str) -> PosixHandle:
        # An inherited descriptor shares its open file description with the
        # parent's, O_DIRECT included: the transfers follow its flag.
        direct = bool(_O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)
        return PosixHandle(fd, path, direct)

    def describe(self) -> str:
        with self._lock:
            dirs = ", ".join(
                f"{d}={'direct' if ok else 'buffered'}"
                for d, ok in self._direct_dirs.items()
            )
        mode = "O_DIRECT where supported" if self._want_direct else "buffered"
        return f"posix(threads={self._threads}, {mode}{'; ' + dirs if dirs else ''})"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _transfer(op: Any, handle: PosixHandle, view: memoryview, offset: int) -> int:
    """Run preadv/pwritev until all of ``view`` moved, 0 came back, or O_DIRECT
    returned an unaligned partial count (end of file). Returns bytes moved."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = op(handle.fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, handle.path) from exc
            raise
        if n == 0:
            break
        done += n
        if handle.direct and done % IO_ALIGNMENT:
            break
    return done


# What a file system that refuses O_DIRECT answers.
_REFUSES_DIRECT = (errno.EINVAL, errno.EOPNOTSUPP)


def probe_direct(directory: str) -> tuple[bool, str, bool]:
    """Whether O_DIRECT works in ``directory``, why not, and whether that
    answer is settled: ``(ok, reason, settled)``. Not settled when the probe
    failed for a reason other than O_DIRECT itself (no directory, no space,
    EIO): a later probe may succeed.

    Creates a private probe file there (O_EXCL, 0600), does an aligned 4 KiB
    write and read-back with O_DIRECT, and removes it. Never raises for an
    I/O error: it is the reason."""
    if _O_DIRECT == 0:
        return False, "O_DIRECT not available on this platform", True
    path = os.path.join(
        directory, f".kvtier-odirect-probe-{os.getpid()}-{uuid.uuid4().hex}"
    )
    fd = -1
    # mmap memory is page-aligned, which O_DIRECT requires of the buffer.
    with mmap.mmap(-1, IO_ALIGNMENT) as page:
        page.write(b"kvtier-probe".ljust(IO_ALIGNMENT, b"\0"))
        try:
            fd = _open_fd(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_DIRECT)
            if os.pwritev(fd, [page], 0) != IO_ALIGNMENT:
                return False, "short O_DIRECT probe write", True
            back = mmap.mmap(-1, IO_ALIGNMENT)
            try:
                if os.preadv(fd, [back], 0) != IO_ALIGNMENT or back[:] != page[:]:
                    return False, "O_DIRECT probe read back different bytes", True
            finally:
                back.close()
            return True, "ok", True
        except OSError as exc:
            return (
                False,
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}",
                exc.errno in _REFUSES_DIRECT,
            )
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
