"""One store's slab files and the raw I/O on them, shared by its two paths.

:class:`~kvtier.store.disk_store.DiskStore` (the write path) and
:class:`~kvtier.store.disk_reads.VerifiedReads` (the verified read path) work
on the same files the same way: :class:`StoreFiles` is that shared part.
It creates (or reopens) the store directories ``<path>/kvtier-<digest
hex[:16]>/`` with their lock and ``layout.json`` (:mod:`kvtier.store.store_dir`)
and one preallocated slab per path (:mod:`kvtier.store.slab`), opens them
read-write through a :class:`~kvtier.store.backends.base.DiskBackend`, and holds the
counters (:class:`DiskStoreStats`) and the log-once error reporting. It
judges no bytes: the slot checks live in :mod:`kvtier.store.layout`.

Contract:
  - ``locate(slot)`` maps a global slot to ``(slab index, byte offset)`` by
    the striping rule of :mod:`kvtier.store.layout`; it raises IndexError for a
    slot out of range and RuntimeError once the files are closed (or
    abandoned). Offsets are multiples of ``IO_ALIGNMENT``.
  - ``read``/``write``/``submit_read`` move bytes as the back end does: the
    count transferred (a short transfer is the smaller count, never padded),
    or OSError with errno. ``buf`` must meet the back end's alignment rules
    (address and length multiples of ``IO_ALIGNMENT``); ``bounce()`` is an
    aligned slot-sized buffer private to the calling thread.
  - ``write_all`` turns a short write into OSError(EIO); it and the callers of
    ``read`` report every failure with ``io_error`` (counted in
    ``io_errors``, logged at warning once per operation, slab and errno,
    repeats at debug). ``rejected`` does the same for data that failed a
    check (``checksum_failures``, once per slab).
  - Every method may be called from any thread; the counters and the log-once
    set are guarded by one lock. Callers keep one slot to one thread at a time.
  - ``close`` is idempotent: it closes the handles, shuts the back end down
    when owned, and closes the directory descriptors (releasing the store
    locks). ``abandon`` only marks the files closed (see its docstring).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import DiskBackend
from kvtier.store.format import LayoutFingerprint, aligned_empty
from kvtier.store.layout import local_slot_count, locate, slab_name
from kvtier.store.slab import SlabFile
from kvtier.store.store_dir import (
    check_same_slab,
    open_store_dir,
    store_dirname,
    write_layout,
)

logger = get_logger("store")


@dataclass
class DiskStoreStats:
    """Cumulative counters of one DiskStore (``stats()`` returns a copy)."""

    write_bytes: int = 0
    read_bytes: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    blocks_written: int = 0
    blocks_read: int = 0  # read attempts (read_block/verify), whatever the outcome
    # Reads rejected as corrupt: payload checksum, or (read/verify only) a
    # header that fails its own checksum/magic/version check.
    checksum_failures: int = 0
    # Failed I/O (any errno), including short reads and writes (as EIO).
    io_errors: int = 0


def flat_u8(arr: np.ndarray, nbytes: int, what: str) -> np.ndarray:
    """``arr`` as a flat uint8 view; ValueError unless it is a C-contiguous
    numpy array of exactly ``nbytes`` bytes."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(f"{what} has {flat.size} bytes, expected block_bytes={nbytes}")
    return flat


class StoreFiles:
    """The slab files of one store, read-write (see the module doc)."""

    def __init__(
        self,
        paths: Sequence[str],
        num_slots: int,
        fingerprint: LayoutFingerprint,
        slot_size: int,
        backend: DiskBackend,
        *,
        owns_backend: bool,
    ) -> None:
        """Create or reopen the store on ``paths`` (absolute). On any failure
        whatever was opened is closed (the back end too, when owned) and the
        exception propagates (OSError from the file system, or the store
        directory's lock/layout errors)."""
        self.paths = list(paths)
        self.num_slots = num_slots
        self.slot_size = slot_size
        self.backend = backend
        self._owns_backend = owns_backend
        # Optional blocking fast paths (PosixBackend has them): the store's
        # callers are worker threads already, so a second hop only adds latency.
        self._read_sync: Callable[[Any, Any, int], int] | None = getattr(
            backend, "read_sync", None
        )
        self._write_sync: Callable[[Any, Any, int], int] | None = getattr(
            backend, "write_sync", None
        )
        self._lock = threading.Lock()
        self._stats = DiskStoreStats()
        self._logged: set[tuple[str, str, int | None]] = set()
        self._tls = threading.local()
        self._closed = False

        self.dirs: list[str] = []
        self.slabs: list[SlabFile] = []
        self.handles: list[Any] = []
        # One descriptor per store directory, held (with its flock) until
        # close: everything inside is opened relative to it.
        self._dir_fds: list[int] = []
        npaths = len(self.paths)
        try:
            for i, base in enumerate(self.paths):
                d = os.path.join(base, store_dirname(fingerprint))
                dir_fd = open_store_dir(d, base)
                self._dir_fds.append(dir_fd)
                write_layout(d, fingerprint, slot_size, dir_fd=dir_fd)
                slab = SlabFile(
                    os.path.join(d, slab_name(i)),
                    local_slot_count(num_slots, i, npaths),
                    slot_size,
                    dir_fd=dir_fd,
                )
                self.dirs.append(d)
                self.slabs.append(slab)
                handle = backend.open(slab.path, writable=True)
                self.handles.append(handle)
                check_same_slab(backend, handle, slab)
        except BaseException:
            self.close()
            raise

    # -- where and how bytes move -----------------------------------------

    def locate(self, slot: int) -> tuple[int, int]:
        """``(slab index, byte offset)`` of global ``slot``."""
        if self._closed:
            raise RuntimeError("DiskStore is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        idx, local = locate(slot, len(self.paths))
        return idx, self.slabs[idx].offset(local)

    def bounce(self) -> np.ndarray:
        """This thread's aligned slot-sized buffer (O_DIRECT needs the
        alignment; verifying in it keeps bad bytes away from callers)."""
        buf: np.ndarray | None = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = aligned_empty(self.slot_size)
        return buf

    def read(self, idx: int, buf: np.ndarray, offset: int) -> int:
        """Blocking positioned read from slab ``idx``: the count read."""
        if self._read_sync is not None:
            return int(self._read_sync(self.handles[idx], buf, offset))
        return self.backend.submit_read(self.handles[idx], buf, offset).result()

    def submit_read(self, idx: int, buf: np.ndarray, offset: int) -> Future[int]:
        """Asynchronous positioned read from slab ``idx`` (the back end's)."""
        return self.backend.submit_read(self.handles[idx], buf, offset)

    def write(self, idx: int, buf: np.ndarray, offset: int) -> int:
        """Blocking positioned write to slab ``idx``: the count written."""
        if self._write_sync is not None:
            return int(self._write_sync(self.handles[idx], buf, offset))
        return self.backend.submit_write(self.handles[idx], buf, offset).result()

    def write_all(self, op: str, idx: int, buf: np.ndarray, offset: int) -> int:
        """``write`` all of ``buf`` or raise OSError (a short write as EIO);
        a failure is reported with ``io_error(op, ...)`` before it is raised."""
        try:
            n = self.write(idx, buf, offset)
            if n != len(buf):
                raise OSError(
                    errno.EIO,
                    f"short write ({n} of {len(buf)} bytes)",
                    self.slabs[idx].path,
                )
        except OSError as exc:
            self.io_error(op, idx, exc)
            raise
        return n

    # -- counters and reports ---------------------------------------------

    def count_write(self, nbytes: int, seconds: float) -> None:
        """One block written."""
        with self._lock:
            self._stats.write_bytes += nbytes
            self._stats.write_seconds += seconds
            self._stats.blocks_written += 1

    def count_read(self, nbytes: int, seconds: float = 0.0, blocks: int = 0) -> None:
        """Bytes read; ``blocks`` read attempts (header-only reads count none)."""
        with self._lock:
            self._stats.read_bytes += nbytes
            self._stats.read_seconds += seconds
            self._stats.blocks_read += blocks

    def stats(self) -> DiskStoreStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def io_error(self, op: str, idx: int, exc: OSError) -> None:
        """``op`` on slab ``idx`` failed with ``exc``: counted and logged."""
        path = self.slabs[idx].path
        key = (op, path, exc.errno)
        with self._lock:
            self._stats.io_errors += 1
            first = key not in self._logged
            self._logged.add(key)
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if first:
            logger.warning(
                "kvtier disk %s failed on %s: errno %s (%s): %s; repeats logged at debug",
                op,
                path,
                exc.errno,
                name,
                exc.strerror,
            )
        else:
            logger.debug(
                "kvtier disk %s failed on %s: errno %s (%s)", op, path, exc.errno, name
            )

    def rejected(self, idx: int, slot: int, what: str) -> None:
        """The bytes read from ``slot`` (in slab ``idx``) failed a check:
        counted as a checksum failure and logged."""
        path = self.slabs[idx].path
        key = ("corrupt", path, None)
        with self._lock:
            self._stats.checksum_failures += 1
            first = key not in self._logged
            self._logged.add(key)
        log = logger.warning if first else logger.debug
        log(
            "kvtier disk read of slot %d on %s rejected: %s (corrupt or torn "
            "block, treated as a miss)%s",
            slot,
            path,
            what,
            "; repeats logged at debug" if first else "",
        )

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Close slab handles, the back end when owned, and the directory
        descriptors (releasing the store locks). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self.handles:
            try:
                self.backend.close(handle)
            except OSError as exc:
                logger.debug("closing slab handle failed: %s", exc)
        self.handles.clear()
        if self._owns_backend:
            self.backend.shutdown()
        for fd in self._dir_fds:  # releases the store-directory locks
            try:
                os.close(fd)
            except OSError as exc:
                logger.debug("closing store directory failed: %s", exc)
        self._dir_fds.clear()

    def abandon(self) -> None:
        """Mark closed without closing anything: for files whose I/O threads
        may still be blocked in a read or write (a hung disk). The descriptors
        stay open (a closed number could be reused by another file while a
        blocked write still targets it) and the locks stay held until the
        process exits."""
        self._closed = True
