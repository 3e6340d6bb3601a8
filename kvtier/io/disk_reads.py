"""DiskStore's verified read path: its counters and the reads.

Every read is verified (magic, header checksum, fingerprint, key, payload
checksum; the checks of :mod:`kvtier.io.layout`) in a private bounce buffer
before anything reaches the caller's buffer, so a torn, stale or corrupted
slot is reported, never returned.
:class:`DiskReads` holds ``read_block``/``verify``/``read_header``/``scan``
of :class:`kvtier.io.disk_store.DiskStore`, which sets up the state they use.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.io.backend import IO_ALIGNMENT, DiskBackend
from kvtier.io.compression import CorruptPayloadError, decompress
from kvtier.io.format import HEADER_SIZE, SlotHeader, aligned_empty, round_up
from kvtier.io.layout import (
    ReadOutcome,
    SlotVerdict,
    check_header,
    check_payload,
    locate,
    parse_header,
)

if TYPE_CHECKING:
    from kvtier.io.slab import SlabFile

logger = logging.getLogger("kvtier.io")


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
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(f"{what} has {flat.size} bytes, expected block_bytes={nbytes}")
    return flat


class DiskReads:
    """The read/verify/scan methods of :class:`~kvtier.io.disk_store.DiskStore`
    (a mixin: the store's ``__init__`` sets the state declared below)."""

    if TYPE_CHECKING:
        paths: list[str]
        num_slots: int
        block_bytes: int
        slot_size: int
        backend: DiskBackend
        slabs: list[SlabFile]
        _digest: bytes
        _two_step_reads: bool
        _handles: list[Any]
        _lock: threading.Lock
        _stats: DiskStoreStats
        _logged_errors: set[tuple[str, str, int | None]]

        def _locate(self, slot: int) -> tuple[int, int]: ...
        def _bounce(self) -> np.ndarray: ...
        def _read(self, idx: int, buf: np.ndarray, offset: int) -> int: ...
        def _bump_seq(self, seen: int) -> None: ...
        def _note_io_error(self, op: str, idx: int, exc: OSError) -> None: ...

    def _check_header(self, hdr: SlotHeader, key: bytes | None) -> SlotVerdict:
        return check_header(
            hdr,
            key=key,
            digest=self._digest,
            block_bytes=self.block_bytes,
            slot_bytes=self.slot_size,
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
                verdict = parse_header(bounce, n)
                if verdict.outcome is ReadOutcome.TRUNCATED:
                    self._note_short_read(idx, n, first)
                    return ReadOutcome.TRUNCATED, None, None
                if verdict.outcome is ReadOutcome.BAD_HEADER:
                    self._note_corrupt(idx, slot, verdict.detail)
                if not verdict.ok:
                    return verdict.outcome, None, None
                assert verdict.header is not None
                hdr = verdict.header
                verdict = self._check_header(hdr, key)
                if not verdict.ok:
                    return verdict.outcome, hdr, None
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
            payload = bounce[HEADER_SIZE:end]
            verdict = check_payload(hdr, payload, n - HEADER_SIZE)
            if verdict.outcome is ReadOutcome.TRUNCATED:
                self._note_short_read(idx, n, end)
                return ReadOutcome.TRUNCATED, hdr, None
            if not verdict.ok:
                self._note_corrupt(idx, slot, "payload checksum mismatch")
                return verdict.outcome, hdr, None
            return ReadOutcome.OK, hdr, payload
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._stats.read_bytes += nread
                self._stats.read_seconds += dt
                self._stats.blocks_read += 1

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
        flat_out = flat_u8(out, self.block_bytes, "out")
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
        idx, _ = locate(slot, len(self.paths))
        try:
            n = fut.result()
        except OSError as exc:
            self._note_io_error("read", idx, exc)
            return slot, None, ReadOutcome.IO_ERROR
        with self._lock:
            self._stats.read_bytes += n
        verdict = parse_header(buf, n)
        if verdict.outcome is ReadOutcome.TRUNCATED:
            self._note_short_read(idx, n, HEADER_SIZE)
        if not verdict.ok:
            return slot, None, verdict.outcome
        assert verdict.header is not None
        hdr = verdict.header
        outcome = self._check_header(hdr, None).outcome
        if outcome is ReadOutcome.OK:
            self._bump_seq(hdr.seq)
            return slot, hdr, outcome
        if outcome is ReadOutcome.FINGERPRINT_MISMATCH:
            return slot, hdr, outcome
        return slot, None, outcome
