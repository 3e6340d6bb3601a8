"""The disk tier's block store: fixed-size slots in slab files, one per path.

Layout (see docs/on-disk-format.md): for each configured path there is a
directory ``<path>/kvtier-<digest hex[:16]>/`` (named by the layout
fingerprint, so different models/dtypes/TP ranks never share files) holding
``layout.json`` and exactly one preallocated slab ``slab-<path index>.kvt``.
Slots are striped over the paths by :mod:`kvtier.io.layout` (global slot
``s`` in slab ``s % len(paths)``, local slot ``s // len(paths)``).

Every read is verified (magic, header checksum, fingerprint, key, payload
checksum) in a private bounce buffer before anything reaches the caller's
buffer, so a torn, stale or corrupted slot is reported, never returned.

The read path lives in :mod:`kvtier.io.disk_reads`, the store directory
(creation, lock, ``layout.json``) in :mod:`kvtier.io.store_dir`, the slot
checks and striping rule in :mod:`kvtier.io.layout`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from kvtier.io.backend import IO_ALIGNMENT, DiskBackend
from kvtier.io.backends import make_backend
from kvtier.io.checksum import device_checksum, payload_checksum
from kvtier.io.compression import compress
from kvtier.io.disk_reads import DiskReads, DiskStoreStats, flat_u8
from kvtier.io.format import (
    HEADER_SIZE,
    MAX_KEY_LEN,
    Codec,
    LayoutFingerprint,
    SlotHeader,
    aligned_empty,
    round_up,
    slot_size,
)
from kvtier.io.layout import local_slot_count, locate, slab_name
from kvtier.io.slab import SlabFile
from kvtier.io.store_dir import (
    check_same_slab,
    open_store_dir,
    store_dirname,
    write_layout,
)

logger = logging.getLogger("kvtier.io")

COMPRESSION_CHOICES = ("none", "zstd")


class DiskStore(DiskReads):
    """Fixed-size block slots on one or more paths, verified on every read.

    Contract:
      - ``write_block``/``read_block``/``invalidate``/``verify`` are
        synchronous and thread-safe for *distinct* slots (callers never touch
        one slot from two threads at once; the tier bookkeeping ensures that).
      - ``write_block`` raises OSError on failure (including a short write).
        ``read_block`` never raises for I/O or data problems: it returns a
        ReadOutcome, and writes ``out`` only when returning OK.
      - Slot contents survive process restarts; ``scan`` reports every slot's
        header so the caller can rebuild its index. ``seq`` values handed out
        by ``next_seq`` stay above any seq seen on disk by ``scan``.
      - ``backend`` given as a string is created (via make_backend) and owned,
        i.e. shut down by ``close``; a DiskBackend instance is only borrowed.
    """

    def __init__(
        self,
        paths: Sequence[str],
        num_slots: int,
        block_bytes: int,
        fingerprint: LayoutFingerprint,
        backend: DiskBackend | str = "auto",
        compression: str = "none",
        elem_size: int = 2,
        *,
        threads: int = 4,
        min_saving: float = 0.05,
    ) -> None:
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ValueError("DiskStore needs at least one path")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if block_bytes != fingerprint.block_bytes:
            raise ValueError(
                f"block_bytes={block_bytes} disagrees with fingerprint "
                f"block_bytes={fingerprint.block_bytes}"
            )
        if compression not in COMPRESSION_CHOICES:
            raise ValueError(
                f"compression must be one of {COMPRESSION_CHOICES}, got {compression!r}"
            )
        if elem_size < 1 or block_bytes % elem_size:
            raise ValueError(
                f"elem_size={elem_size} must divide block_bytes={block_bytes}"
            )

        self.paths = [os.path.abspath(p) for p in paths]
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.compression = compression
        self.elem_size = elem_size
        self.slot_size = slot_size(block_bytes)
        self._min_saving = min_saving
        self._digest = fingerprint.digest()
        # Compressed payloads are shorter than the slot: read the header first
        # and then only the stored bytes. Uncompressed stores read the whole
        # slot in one I/O.
        self._two_step_reads = compression != "none"

        self._owns_backend = isinstance(backend, str)
        self.backend: DiskBackend = (
            make_backend(backend, threads=threads)
            if isinstance(backend, str)
            else backend
        )
        # Optional blocking fast path (PosixBackend has one): the store's
        # callers are worker threads already, so a second hop only adds latency.
        self._read_sync: Callable[[Any, Any, int], int] | None = getattr(
            self.backend, "read_sync", None
        )
        self._write_sync: Callable[[Any, Any, int], int] | None = getattr(
            self.backend, "write_sync", None
        )
        self._lock = threading.Lock()
        self._stats = DiskStoreStats()
        self._logged_errors: set[tuple[str, str, int | None]] = set()
        self._tls = threading.local()
        # Wall-clock ns as the starting point keeps seq increasing across
        # restarts even before (or without) a scan; scan() raises it further.
        self._seq = time.time_ns()
        self._zero_header = aligned_empty(HEADER_SIZE)
        self._zero_header[:] = 0
        self._closed = False

        self.dirs: list[str] = []
        self.slabs: list[SlabFile] = []
        self._handles: list[Any] = []
        # One descriptor per store directory, held (with its flock) until
        # close: everything inside is opened relative to it.
        self._dir_fds: list[int] = []
        npaths = len(self.paths)
        try:
            for i, base in enumerate(self.paths):
                d = os.path.join(base, store_dirname(fingerprint))
                dir_fd = open_store_dir(d, base)
                self._dir_fds.append(dir_fd)
                write_layout(d, fingerprint, self.slot_size, dir_fd=dir_fd)
                local_slots = local_slot_count(num_slots, i, npaths)
                slab = SlabFile(
                    os.path.join(d, slab_name(i)),
                    local_slots,
                    self.slot_size,
                    dir_fd=dir_fd,
                )
                self.dirs.append(d)
                self.slabs.append(slab)
                handle = self.backend.open(slab.path, writable=True)
                self._handles.append(handle)
                check_same_slab(self.backend, handle, slab)
        except BaseException:
            self.close()
            raise
        logger.debug(
            "DiskStore %s: %d slots x %d B on %s via %s",
            fingerprint.digest().hex()[:16],
            num_slots,
            self.slot_size,
            self.paths,
            self.backend.describe(),
        )

    # -- helpers ------------------------------------------------------------

    def _locate(self, slot: int) -> tuple[int, int]:
        if self._closed:
            raise RuntimeError("DiskStore is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        idx, local = locate(slot, len(self.paths))
        return idx, self.slabs[idx].offset(local)

    def _bounce(self) -> np.ndarray:
        # One aligned slot-sized buffer per calling thread: O_DIRECT needs the
        # alignment, and verifying here keeps bad bytes away from callers.
        buf: np.ndarray | None = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = aligned_empty(self.slot_size)
        return buf

    def _read(self, idx: int, buf: np.ndarray, offset: int) -> int:
        if self._read_sync is not None:
            return int(self._read_sync(self._handles[idx], buf, offset))
        return self.backend.submit_read(self._handles[idx], buf, offset).result()

    def _write(self, idx: int, buf: np.ndarray, offset: int) -> int:
        if self._write_sync is not None:
            return int(self._write_sync(self._handles[idx], buf, offset))
        return self.backend.submit_write(self._handles[idx], buf, offset).result()

    def _note_io_error(self, op: str, idx: int, exc: OSError) -> None:
        path = self.slabs[idx].path
        key = (op, path, exc.errno)
        with self._lock:
            self._stats.io_errors += 1
            first = key not in self._logged_errors
            self._logged_errors.add(key)
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

    def _bump_seq(self, seen: int) -> None:
        with self._lock:
            self._seq = max(self._seq, seen)

    # -- public API -----------------------------------------------------------

    def next_seq(self) -> int:
        """A sequence number greater than every one handed out or scanned."""
        with self._lock:
            self._seq += 1
            return self._seq

    def write_block(
        self,
        slot: int,
        key: bytes,
        data: np.ndarray,
        seq: int,
        *,
        on_staged: Callable[[], None] | None = None,
    ) -> int:
        """Write one block (header + payload in one aligned write).

        ``data`` is a C-contiguous array of exactly ``block_bytes`` bytes.
        Returns the bytes written to disk; raises OSError on failure.
        ``on_staged`` is called once ``data`` was copied into the private
        bounce buffer, before the write: ``data`` is not read after that.
        """
        if len(key) > MAX_KEY_LEN:
            raise ValueError(f"key is {len(key)} bytes, max {MAX_KEY_LEN}")
        flat = flat_u8(data, self.block_bytes, "data")
        idx, offset = self._locate(slot)
        t0 = time.perf_counter()
        bounce = self._bounce()
        if self.compression == "zstd":
            codec, packed = compress(flat, self.elem_size, min_saving=self._min_saving)
            n = len(packed)
            bounce[HEADER_SIZE : HEADER_SIZE + n] = np.frombuffer(
                packed, dtype=np.uint8
            )
        else:
            codec, n = Codec.RAW, flat.size
            bounce[HEADER_SIZE : HEADER_SIZE + n] = flat
        payload = bounce[HEADER_SIZE : HEADER_SIZE + n]
        header = SlotHeader(
            key=bytes(key),
            fingerprint=self._digest,
            payload_len=n,
            raw_len=flat.size,
            codec=codec,
            checksum=payload_checksum(payload),
            device_checksum=device_checksum(payload),
            seq=seq,
            written_at=time.time(),
            elem_size=self.elem_size if codec is Codec.ZSTD_BYTEPLANE else 1,
        )
        bounce[:HEADER_SIZE] = np.frombuffer(header.pack(), dtype=np.uint8)
        end = round_up(HEADER_SIZE + n, IO_ALIGNMENT)
        bounce[HEADER_SIZE + n : end] = 0  # don't leak a previous block's tail
        if on_staged is not None:
            on_staged()
        self._bump_seq(seq)
        try:
            written = self._write(idx, bounce[:end], offset)
            if written != end:
                raise OSError(
                    errno.EIO,
                    f"short write ({written} of {end} bytes)",
                    self.slabs[idx].path,
                )
        except OSError as exc:
            self._note_io_error("write", idx, exc)
            raise
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats.write_bytes += written
            self._stats.write_seconds += dt
            self._stats.blocks_written += 1
        return written

    def invalidate(self, slot: int) -> None:
        """Zero the slot's header so no reader or restart scan trusts it again.

        Raises OSError if the header could not be overwritten.
        """
        idx, offset = self._locate(slot)
        try:
            n = self._write(idx, self._zero_header, offset)
            if n != HEADER_SIZE:
                raise OSError(
                    errno.EIO,
                    f"short write ({n} of {HEADER_SIZE} bytes)",
                    self.slabs[idx].path,
                )
        except OSError as exc:
            self._note_io_error("invalidate", idx, exc)
            raise

    def stats(self) -> DiskStoreStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Close slab handles and, if owned, shut the back end down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            try:
                self.backend.close(handle)
            except OSError as exc:
                logger.debug("closing slab handle failed: %s", exc)
        self._handles.clear()
        if self._owns_backend:
            self.backend.shutdown()
        for fd in self._dir_fds:  # releases the store-directory locks
            try:
                os.close(fd)
            except OSError as exc:
                logger.debug("closing store directory failed: %s", exc)
        self._dir_fds.clear()

    def abandon(self) -> None:
        """Mark closed without closing anything: for a store whose I/O threads
        may still be blocked in a read or write (a hung disk). Its descriptors
        stay open (a closed number could be reused by another file while a
        blocked write still targets it) and its locks stay held until the
        process exits."""
        self._closed = True

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
