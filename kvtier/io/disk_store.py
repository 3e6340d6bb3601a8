"""The disk tier's block store: fixed-size slots in slab files, one per path.

Layout (see docs/on-disk-format.md): for each configured path there is a
directory ``<path>/kvtier-<digest hex[:16]>/`` (named by the layout
fingerprint, so different models/dtypes/TP ranks never share files) holding
``layout.json`` and exactly one preallocated slab ``slab-<path index>.kvt``.
Global slot ``s`` lives in path ``s % len(paths)`` at local slot
``s // len(paths)``, striping consecutive slots over devices.

Every read is verified (magic, header checksum, fingerprint, key, payload
checksum) in a private bounce buffer before anything reaches the caller's
buffer, so a torn, stale or corrupted slot is reported, never returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any

import numpy as np

from kvtier.io.backend import IO_ALIGNMENT, DiskBackend
from kvtier.io.backends import make_backend
from kvtier.io.checksum import payload_checksum
from kvtier.io.compression import CorruptPayloadError, compress, decompress
from kvtier.io.format import (
    HEADER_SIZE,
    MAX_KEY_LEN,
    Codec,
    CorruptHeaderError,
    EmptySlotError,
    LayoutFingerprint,
    SlotHeader,
    aligned_empty,
    round_up,
    slot_size,
)
from kvtier.io.safe_open import (
    InUseError,
    flock_exclusive,
    open_private,
    open_private_dir,
)
from kvtier.io.slab import SlabFile

logger = logging.getLogger("kvtier.io")

COMPRESSION_CHOICES = ("none", "zstd")
LAYOUT_FILE = "layout.json"


class ReadOutcome(Enum):
    """Result of reading a slot. Only OK means the caller's buffer was written."""

    OK = "ok"
    EMPTY = "empty"  # never written or invalidated
    KEY_MISMATCH = "key_mismatch"  # slot holds another block
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # written by another layout
    CHECKSUM_MISMATCH = "checksum_mismatch"  # payload corrupted or torn
    BAD_HEADER = "bad_header"  # magic/version/header checksum/fields wrong
    TRUNCATED = "truncated"  # file ends inside the slot
    IO_ERROR = "io_error"  # the read itself failed (errno logged)


def check_header(
    hdr: SlotHeader,
    key: bytes | None,
    digest: bytes,
    block_bytes: int,
    slot_bytes: int,
) -> ReadOutcome:
    """Whether a parsed header belongs to this layout, this key (``None``:
    any key) and a slot of ``slot_bytes`` holding ``block_bytes`` blocks.

    The one header check shared by the disk store and the workers' slot
    reader (``kvtier.io.slot_reader``)."""
    if hdr.fingerprint != digest:
        return ReadOutcome.FINGERPRINT_MISMATCH
    if key is not None and hdr.key != key:
        return ReadOutcome.KEY_MISMATCH
    if hdr.raw_len != block_bytes or HEADER_SIZE + hdr.payload_len > slot_bytes:
        return ReadOutcome.BAD_HEADER
    return ReadOutcome.OK


@dataclass
class DiskStoreStats:
    """Cumulative counters of one DiskStore (``stats()`` returns a copy)."""

    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    blocks_written: int = 0
    blocks_read: int = 0  # read attempts (read_block/verify), whatever the outcome
    # Reads rejected as corrupt: payload checksum, or (read/verify only) a
    # header that fails its own checksum/magic/version check.
    checksum_failures: int = 0
    # Failed I/O (any errno), including short reads and writes (as EIO).
    io_errors: int = 0


def store_dirname(fingerprint: LayoutFingerprint) -> str:
    """Name of the per-layout directory created under each path."""
    return f"kvtier-{fingerprint.digest().hex()[:16]}"


def _flat_u8(arr: np.ndarray, nbytes: int, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(f"{what} has {flat.size} bytes, expected block_bytes={nbytes}")
    return flat


class DiskStore:
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
                dir_fd = _open_store_dir(d, base)
                self._dir_fds.append(dir_fd)
                _write_layout(d, fingerprint, self.slot_size, dir_fd=dir_fd)
                local_slots = (num_slots - i + npaths - 1) // npaths
                slab = SlabFile(
                    os.path.join(d, f"slab-{i}.kvt"),
                    local_slots,
                    self.slot_size,
                    dir_fd=dir_fd,
                )
                self.dirs.append(d)
                self.slabs.append(slab)
                handle = self.backend.open(slab.path, writable=True)
                self._handles.append(handle)
                _check_same_slab(self.backend, handle, slab)
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
        n = len(self.paths)
        idx = slot % n
        return idx, self.slabs[idx].offset(slot // n)

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

    def _note_short_read(self, idx: int, got: int, wanted: int) -> None:
        # A slab is preallocated to full size, so a read that ends early means
        # the file was truncated or the device misbehaved: report it like
        # write_block reports a short write (EIO, counted, logged once).
        self._note_io_error(
            "read",
            idx,
            OSError(
                errno.EIO,
                f"short read ({got} of {wanted} bytes)",
                self.slabs[idx].path,
            ),
        )

    def _note_corrupt(self, idx: int, slot: int, what: str) -> None:
        # Rejected data used to be silent (or only counted): log the first
        # one per slab with its path, as I/O errors are, and count it.
        path = self.slabs[idx].path
        key = ("corrupt", path, None)
        with self._lock:
            self._stats.checksum_failures += 1
            first = key not in self._logged_errors
            self._logged_errors.add(key)
        log = logger.warning if first else logger.debug
        log(
            "kvtier disk read of slot %d on %s rejected: %s (corrupt or torn "
            "block, treated as a miss)%s",
            slot,
            path,
            what,
            "; repeats logged at debug" if first else "",
        )

    def _check_header(self, hdr: SlotHeader, key: bytes | None) -> ReadOutcome:
        return check_header(hdr, key, self._digest, self.block_bytes, self.slot_size)

    def _bump_seq(self, seen: int) -> None:
        with self._lock:
            self._seq = max(self._seq, seen)

    def _load(
        self, slot: int, key: bytes | None
    ) -> tuple[ReadOutcome, SlotHeader | None, np.ndarray | None]:
        """Read and verify a slot into this thread's bounce buffer.

        Returns the outcome, the header when it parsed, and (for OK only) the
        verified stored payload as a view into the bounce buffer.
        """
        idx, offset = self._locate(slot)
        bounce = self._bounce()
        first = HEADER_SIZE if self._two_step_reads else self.slot_size
        t0 = time.perf_counter()
        nread = 0
        try:
            try:
                n = nread = self._read(idx, bounce[:first], offset)
                if n < HEADER_SIZE:
                    self._note_short_read(idx, n, first)
                    return ReadOutcome.TRUNCATED, None, None
                try:
                    hdr = SlotHeader.unpack(bounce[:HEADER_SIZE])
                except EmptySlotError:
                    return ReadOutcome.EMPTY, None, None
                except CorruptHeaderError as exc:
                    self._note_corrupt(idx, slot, f"bad header ({exc})")
                    return ReadOutcome.BAD_HEADER, None, None
                outcome = self._check_header(hdr, key)
                if outcome is not ReadOutcome.OK:
                    return outcome, hdr, None
                end = HEADER_SIZE + hdr.payload_len
                if self._two_step_reads and hdr.payload_len:
                    more = round_up(hdr.payload_len, IO_ALIGNMENT)
                    got = self._read(
                        idx,
                        bounce[HEADER_SIZE : HEADER_SIZE + more],
                        offset + HEADER_SIZE,
                    )
                    nread += got
                    n = HEADER_SIZE + got
            except OSError as exc:
                self._note_io_error("read", idx, exc)
                return ReadOutcome.IO_ERROR, None, None
            if n < end:
                self._note_short_read(idx, n, end)
                return ReadOutcome.TRUNCATED, hdr, None
            payload = bounce[HEADER_SIZE:end]
            if payload_checksum(payload) != hdr.checksum:
                self._note_corrupt(idx, slot, "payload checksum mismatch")
                return ReadOutcome.CHECKSUM_MISMATCH, hdr, None
            return ReadOutcome.OK, hdr, payload
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._stats.bytes_read += nread
                self._stats.read_seconds += dt
                self._stats.blocks_read += 1

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
        flat = _flat_u8(data, self.block_bytes, "data")
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
        header = SlotHeader(
            key=bytes(key),
            fingerprint=self._digest,
            payload_len=n,
            raw_len=flat.size,
            codec=codec,
            checksum=payload_checksum(bounce[HEADER_SIZE : HEADER_SIZE + n]),
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
            self._stats.bytes_written += written
            self._stats.write_seconds += dt
            self._stats.blocks_written += 1
        return written

    def read_block(
        self, slot: int, key: bytes, out: np.ndarray, *, guard: Any = None
    ) -> ReadOutcome:
        """Read the block stored under ``key`` in ``slot`` into ``out``.

        ``out`` is a C-contiguous array of exactly ``block_bytes`` bytes and is
        written only when the result is OK. Never raises for I/O or data errors.
        ``guard`` (e.g. :class:`kvtier.io.engine.RowGuard`): ``out`` is written
        only between a successful ``guard.enter()`` and ``guard.leave()``; when
        ``enter()`` refuses (the caller gave ``out`` away meanwhile), ``out``
        is left alone and IO_ERROR is returned.
        """
        flat_out = _flat_u8(out, self.block_bytes, "out")
        outcome, hdr, payload = self._load(slot, key)
        if outcome is not ReadOutcome.OK:
            return outcome
        assert hdr is not None and payload is not None
        if guard is not None and not guard.enter():
            return ReadOutcome.IO_ERROR
        try:
            # decompress validates the decoded size before writing ``out``.
            decompress(hdr.codec, payload, hdr.raw_len, hdr.elem_size, flat_out)
        except (CorruptPayloadError, ValueError):
            # Checksum matched but the header's codec/lengths lie: treat the
            # header as untrustworthy.
            return ReadOutcome.BAD_HEADER
        finally:
            if guard is not None:
                guard.leave()
        return ReadOutcome.OK

    def verify(self, slot: int) -> ReadOutcome:
        """Read the full slot and check header, fingerprint and payload checksum."""
        outcome, _, _ = self._load(slot, None)
        return outcome

    def read_header(self, slot: int) -> tuple[SlotHeader | None, ReadOutcome]:
        """Read one slot's header only (the same classification as ``scan``)."""
        idx, offset = self._locate(slot)
        buf = self._bounce()[:HEADER_SIZE]
        fut = self.backend.submit_read(self._handles[idx], buf, offset)
        _, hdr, outcome = self._classify_header(slot, buf, fut)
        return hdr, outcome

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

    def scan(
        self, window: int = 64
    ) -> Iterator[tuple[int, SlotHeader | None, ReadOutcome]]:
        """Yield ``(slot, header, outcome)`` for every slot, in slot order.

        Reads headers only (``window`` reads in flight). OK means the header is
        intact and ours; the payload is not verified (use ``verify``). The header
        is returned for OK and for FINGERPRINT_MISMATCH (so ``kvtier inspect``
        can show foreign slots), otherwise ``None``.
        """
        window = max(1, window)
        bufs = aligned_empty(window * HEADER_SIZE).reshape(window, HEADER_SIZE)
        inflight: deque[tuple[int, np.ndarray, Future[int]]] = deque()
        for slot in range(self.num_slots):
            if len(inflight) == window:
                yield self._classify_header(*inflight.popleft())
            idx, offset = self._locate(slot)
            buf = bufs[slot % window]
            inflight.append(
                (slot, buf, self.backend.submit_read(self._handles[idx], buf, offset))
            )
        while inflight:
            yield self._classify_header(*inflight.popleft())

    def _classify_header(
        self, slot: int, buf: np.ndarray, fut: Future[int]
    ) -> tuple[int, SlotHeader | None, ReadOutcome]:
        try:
            n = fut.result()
        except OSError as exc:
            self._note_io_error("read", slot % len(self.paths), exc)
            return slot, None, ReadOutcome.IO_ERROR
        with self._lock:
            self._stats.bytes_read += n
        if n < HEADER_SIZE:
            self._note_short_read(slot % len(self.paths), n, HEADER_SIZE)
            return slot, None, ReadOutcome.TRUNCATED
        try:
            hdr = SlotHeader.unpack(buf)
        except EmptySlotError:
            return slot, None, ReadOutcome.EMPTY
        except CorruptHeaderError:
            return slot, None, ReadOutcome.BAD_HEADER
        outcome = self._check_header(hdr, None)
        if outcome is ReadOutcome.OK:
            self._bump_seq(hdr.seq)
            return slot, hdr, outcome
        if outcome is ReadOutcome.FINGERPRINT_MISMATCH:
            return slot, hdr, outcome
        return slot, None, outcome

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


def _open_store_dir(path: str, base: str) -> int:
    """Create or open a store directory, check it and lock it; returns its fd.

    Refused: a symbolic link, a non-directory, a directory of another owner,
    one writable by group or others (see kvtier.io.safe_open), and one locked
    by another live store (two engines on one ``disk_path`` would adopt each
    other's blocks and evict each other's slots)."""
    try:
        os.makedirs(base, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(
            errno.ENOTDIR, "kvtier disk_path exists but is not a directory", base
        ) from exc
    fd = open_private_dir(path)
    try:
        if not flock_exclusive(fd):
            raise InUseError(
                f"kvtier disk store {path!r} (disk_path {base!r}) is in use by "
                "another running kvtier engine with the same model and layout "
                "(another process, or another engine in this process). Give each "
                "engine its own disk_path, or stop the other engine first",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_same_slab(backend: DiskBackend, handle: Any, slab: SlabFile) -> None:
    """The back end opened the slab by name: make sure it is the inode that
    was checked through the locked directory (no swap in between)."""
    fd = backend.fileno(handle)
    if fd is not None and not slab.matches(fd):
        raise PermissionError(
            errno.EPERM,
            "kvtier refuses the slab: the file opened by name is not the one "
            "checked a moment earlier (the directory was swapped?)",
            slab.path,
        )


def _write_layout(
    directory: str, fingerprint: LayoutFingerprint, slot_bytes: int, *, dir_fd: int
) -> None:
    """Write ``layout.json`` (human/inspect aid; never trusted for reads)."""
    doc = dict(fingerprint.describe(), header_size=HEADER_SIZE, slot_size=slot_bytes)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        fd = open_private(LAYOUT_FILE, os.O_RDONLY, dir_fd=dir_fd, private=True)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # A link, or not private to us: it is only an aid, so replace it
        # (rename replaces the name itself, never a link's target).
        logger.info("replacing %s: %s", path, exc)
    else:
        with os.fdopen(fd, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = f"{LAYOUT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)  # a crashed run's leftover
    fd = open_private(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd, private=True
    )
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, LAYOUT_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
