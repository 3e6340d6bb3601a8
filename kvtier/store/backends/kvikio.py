"""kvikio disk back end: CuFile pread/pwrite, GPUDirect Storage where available.

kvikio (RAPIDS) reads and writes files into host or device memory. With GDS
(the nvidia-fs driver plus a supported file system) device buffers go
NVMe <-> GPU without a host bounce; otherwise kvikio runs in "compat mode":
POSIX I/O on its own thread pool, staging device buffers through a pinned
bounce buffer.

Whether kvikio can run here, and with GDS, is :mod:`kvtier.store.backends.kvikio_probe`'s
question; this module is the back end, built only where the probe said yes.
kvikio is imported lazily, in the constructor.
"""

from __future__ import annotations

import errno
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.safe_open import open_private, same_file
from kvtier.store.backends.base import BackendUnavailableError, DiskBackend
from kvtier.store.backends.kvikio_probe import gds_status, usable_status

logger = get_logger("store")

# -- buffers and errors -------------------------------------------------------


def _as_target(buf: Any, for_read: bool) -> tuple[Any, int]:
    """The object to hand kvikio and its size in bytes.

    Bad arguments are caller bugs, not I/O failures, so they raise here, at
    submission, rather than through the future.
    """
    if type(buf).__module__.startswith("torch") and hasattr(buf, "is_cuda"):
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if buf.is_cuda:
            # kvikio takes CUDA tensors through __cuda_array_interface__.
            return buf, buf.numel() * buf.element_size()
        buf = buf.numpy()  # CPU tensor: share its memory through numpy
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise ValueError("device buffer must be C-contiguous")
        itemsize = int(cai["typestr"][2:])
        return buf, math.prod(cai["shape"]) * itemsize
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    if for_read and view.readonly:
        raise ValueError("cannot read into a read-only buffer")
    # A flat byte view is what kvikio's buffer-protocol path expects.
    return view.cast("B"), view.nbytes


_STRERROR_TO_ERRNO: dict[str, int] = {
    os.strerror(code): code for code in errno.errorcode
}


def _errno_of(message: str) -> int:
    """Recover errno from kvikio's message text ("... POSIX error: <strerror>").

    kvikio raises RuntimeError with strerror() text but no errno attribute;
    callers (the disk store's error logging) want a real errno.
    """
    tail = message.rsplit(": ", 1)[-1].strip()
    if tail in _STRERROR_TO_ERRNO:
        return _STRERROR_TO_ERRNO[tail]
    for text, code in sorted(_STRERROR_TO_ERRNO.items(), key=lambda kv: -len(kv[0])):
        if text in message:
            return code
    return errno.EIO


def _to_oserror(exc: Exception, op: str, path: str) -> OSError:
    if isinstance(exc, OSError):
        return exc if exc.filename else OSError(exc.errno, exc.strerror, path)
    message = str(exc)
    return OSError(_errno_of(message), f"kvikio {op} failed: {message}", path)


# -- the back end -------------------------------------------------------------


class KvikioRead:
    """A read started with :meth:`KvikioBackend.start_read`: ``done()`` never
    blocks; ``result()`` waits and gives the byte count (short at end of
    file, like ``submit_read``) or raises OSError. kvikio's IOFuture has no
    timed wait: callers poll ``done()``."""

    def __init__(self, fut: Any, path: str) -> None:
        self._fut, self._path = fut, path

    def done(self) -> bool:
        return self._fut is None or bool(self._fut.done())

    def result(self) -> int:
        if self._fut is None:
            return 0
        try:
            return int(self._fut.get())
        except Exception as exc:
            raise _to_oserror(exc, "read", self._path) from exc


@dataclass(frozen=True)
class KvikioHandle:
    """An open kvikio.CuFile plus what the back end needs around it."""

    file: Any  # kvikio.CuFile
    path: str
    writable: bool


class KvikioBackend(DiskBackend):
    """kvikio CuFile I/O (see DiskBackend for the contract).

    Each submit runs ``CuFile.pread/pwrite(...).get()`` on a small thread
    pool: kvikio's IOFuture is not a concurrent.futures.Future, and calling
    kvikio from the pool also keeps submission non-blocking where kvikio
    would run small or deferred transfers in the caller's thread. ``.get()``
    releases the GIL, and kvikio splits each transfer over its own thread
    pool, which is raised to ``threads`` unless KVIKIO_NTHREADS is set
    (kvikio defaults to a single thread, serialising all I/O).

    Reads are clamped to the file's size (:func:`_start_read`).
    """

    name = "kvikio"

    def __init__(self, threads: int = 4) -> None:
        usable, why = usable_status()
        if not usable:
            raise BackendUnavailableError(f"kvikio cannot be used here: {why}")
        import kvikio
        import kvikio.defaults

        self._kvikio: Any = kvikio
        self._threads = threads
        if "KVIKIO_NTHREADS" not in os.environ:
            try:
                if int(kvikio.defaults.get("num_threads")) < threads:
                    # Process-wide setting; only ever raised, never lowered,
                    # so another kvikio user in the process loses nothing.
                    kvikio.defaults.set("num_threads", threads)
            except Exception as exc:  # a tuning knob must not block I/O
                logger.warning("could not raise kvikio's thread count: %r", exc)
        self._gds, self._gds_why = gds_status()
        self._pool = ThreadPoolExecutor(
            threads,
            thread_name_prefix="kvtier-kvikio",
            initializer=name_this_thread,
        )

    def open(self, path: str, writable: bool = True) -> KvikioHandle:
        # kvikio opens by name: check the name first (no symlink, our own
        # regular file, not group/other-writable), then make sure kvikio
        # opened that very inode.
        checked = open_private(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            try:
                # "r+" never creates or truncates: the disk store preallocates.
                cufile = self._kvikio.CuFile(path, "r+" if writable else "r")
            except Exception as exc:
                raise _to_oserror(exc, "open", path) from exc
            try:
                same = same_file(checked, cufile.fileno())
            except Exception:
                same = True  # no descriptor to compare (a stub); name was checked
            if not same:
                cufile.close()
                raise PermissionError(
                    errno.EPERM,
                    "kvtier refuses the file: it was replaced while being opened",
                    path,
                )
        finally:
            os.close(checked)
        return KvikioHandle(cufile, path, writable)

    def fileno(self, handle: KvikioHandle) -> int | None:
        try:
            return int(handle.file.fileno())
        except Exception:
            return None

    def submit_read(self, handle: KvikioHandle, buf: Any, offset: int) -> Future[int]:
        target, nbytes = _as_target(buf, for_read=True)
        return self._pool.submit(
            lambda: _start_read(handle, target, nbytes, offset).result()
        )

    def start_read(self, handle: KvikioHandle, buf: Any, offset: int) -> KvikioRead:
        """Start ``len(buf)`` bytes at ``offset`` with kvikio's own
        asynchronous ``CuFile.pread`` (an IOFuture that kvikio splits over its
        thread pool; device buffers go NVMe -> GPU under GDS). Bad arguments
        raise here; so does a failure to start (as OSError)."""
        target, nbytes = _as_target(buf, for_read=True)
        return _start_read(handle, target, nbytes, offset)

    def submit_write(self, handle: KvikioHandle, buf: Any, offset: int) -> Future[int]:
        target, nbytes = _as_target(buf, for_read=False)
        if not handle.writable:
            # kvikio would fail with a misleading EPERM; say what happened.
            fut: Future[int] = Future()
            fut.set_exception(
                OSError(errno.EBADF, "handle opened read-only", handle.path)
            )
            return fut
        return self._pool.submit(_write, handle, target, nbytes, offset)

    def close(self, handle: KvikioHandle) -> None:
        try:
            handle.file.close()
        except Exception as exc:
            raise _to_oserror(exc, "close", handle.path) from exc

    @property
    def gds(self) -> bool:
        """Whether reads go through GPUDirect Storage (else compat mode)."""
        return bool(self._gds)

    def describe(self) -> str:
        version = getattr(self._kvikio, "__version__", "?")
        mode = "GDS" if self._gds else f"compat mode, POSIX I/O: {self._gds_why}"
        try:
            kthreads = int(self._kvikio.defaults.get("num_threads"))
        except Exception:
            kthreads = -1
        return f"kvikio {version} ({mode}; threads={self._threads}, kvikio_threads={kthreads})"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _start_read(
    handle: KvikioHandle, target: Any, nbytes: int, offset: int
) -> KvikioRead:
    """``CuFile.pread`` clamped to the file's size (kvikio raises for a read
    across the end; the contract wants it short); failures as OSError."""
    try:
        size = os.fstat(handle.file.fileno()).st_size
        count = min(nbytes, max(0, size - offset))
        fut = handle.file.pread(target, count, offset) if count else None
    except Exception as exc:
        raise _to_oserror(exc, "read", handle.path) from exc
    return KvikioRead(fut, handle.path)


def _write(handle: KvikioHandle, target: Any, nbytes: int, offset: int) -> int:
    if nbytes == 0:
        return 0
    try:
        return int(handle.file.pwrite(target, nbytes, offset).get())
    except Exception as exc:
        raise _to_oserror(exc, "write", handle.path) from exc
