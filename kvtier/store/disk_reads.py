"""A store's verified read path: whole blocks, single headers, and the scan.

:class:`VerifiedReads` reads the slots of the slab files held by a
:class:`~kvtier.store.slabs.SlabFiles` (which
:class:`~kvtier.store.disk_store.DiskStore` creates and shares with its write
path) and judges them with the one slot verification of
:mod:`kvtier.store.slot` (``parse_header``, ``check_header``,
``check_payload``; magic, header checksum, layout fingerprint, key, lengths,
payload xxh3). Every read lands in the calling thread's private bounce
buffer and is verified there before anything reaches the caller's buffer,
so a torn, stale or corrupted slot is reported, never returned.

Contract:
  - ``read_block``/``verify``/``read_header`` never raise for I/O or data
    problems: they return a :class:`~kvtier.store.slot.ReadOutcome`. A failed
    read (any errno) is IO_ERROR; a read that ends early is TRUNCATED when
    the slab now ends inside the slot (slabs are preallocated to full size:
    it was truncated) and IO_ERROR otherwise (the device cut it short;
    :func:`~kvtier.store.slot.short_read_outcome`), reported as an EIO.
    Both are counted in ``io_errors`` and logged once per slab and errno. Rejected bytes (bad header, payload checksum) are counted in
    ``checksum_failures`` and logged once per slab.
  - They do raise for caller errors: IndexError for a slot out of range,
    RuntimeError once the store is closed, ValueError for an ``out`` that is
    not a C-contiguous array of exactly ``block_bytes`` bytes.
  - All reads are positioned at a slot's start (a multiple of
    ``IO_ALIGNMENT``) into aligned buffers, lengths rounded up to
    ``IO_ALIGNMENT``; an uncompressed store reads a slot in one I/O, a
    compressed one reads the header first and then only the stored bytes.
  - Thread-safe for distinct slots: each thread reads into its own bounce
    buffer, and the shared counters are updated under the files' lock.
  - ``scan`` and ``read_header`` hand every intact header of this layout to
    ``on_header`` (the store raises its next ``seq`` above them).
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import numpy as np

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.slabs import SlabFiles
from kvtier.store.slot import (
    HEADER_SIZE,
    ReadOutcome,
    SlotHeader,
    SlotVerdict,
    aligned_empty,
    check_header,
    check_payload,
    decode_payload,
    parse_header,
    round_up,
    short_read_outcome,
)


def flat_u8(arr: np.ndarray, nbytes: int, what: str) -> np.ndarray:
    """``arr`` as a flat uint8 view; ValueError unless it is a C-contiguous
    numpy array of exactly ``nbytes`` bytes."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(f"{what} has {flat.size} bytes, expected block_bytes={nbytes}")
    return flat


class VerifiedReads:
    """The verified reads of one store's slab files (see the module doc).

    ``block_bytes`` and ``digest`` are the layout's (the fingerprint's block
    size and digest); ``compressed`` says whether payloads may be shorter
    than the slot (then a read fetches the header first); ``on_header`` is
    called with each intact header of this layout that ``scan`` or
    ``read_header`` sees.
    """

    def __init__(
        self,
        files: SlabFiles,
        *,
        block_bytes: int,
        digest: bytes,
        compressed: bool,
    ) -> None:
        self._files = files
        self._block_bytes = block_bytes
        self._digest = digest
        self._two_step = compressed
        self._tls = threading.local()

    def _bounce(self) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = aligned_empty(self._files.slot_size)
        return buf

    def read_block(
        self, slot: int, key: bytes, out: np.ndarray, *, guard: Any = None
    ) -> ReadOutcome:
        """Read the block stored under ``key`` in ``slot`` into ``out``.

        ``out`` is a C-contiguous array of exactly ``block_bytes`` bytes and is
        written only when the result is OK. Never raises for I/O or data errors.
        ``guard`` (e.g. :class:`kvtier.store.engine.RowGuard`): ``out`` is written
        only between a successful ``guard.enter()`` and ``guard.leave()``; when
        ``enter()`` refuses (the caller gave ``out`` away meanwhile), ``out``
        is left alone and IO_ERROR is returned.
        """
        flat_out = flat_u8(out, self._block_bytes, "out")
        outcome, hdr, payload = self._load(slot, key)
        if outcome is not ReadOutcome.OK:
            return outcome
        assert hdr is not None and payload is not None
        if guard is not None and not guard.enter():
            return ReadOutcome.IO_ERROR
        try:
            # Checks the decoded size before writing ``out``; BAD_HEADER when
            # the checksums matched but the header's codec/lengths lie.
            return decode_payload(hdr, payload, flat_out).outcome
        finally:
            if guard is not None:
                guard.leave()

    def verify(self, slot: int) -> ReadOutcome:
        """Read the full slot and check header, fingerprint and payload checksum."""
        outcome, _, _ = self._load(slot, None)
        return outcome

    # -- the checks ----------------------------------------------------------

    def _check_header(self, hdr: SlotHeader, key: bytes | None) -> SlotVerdict:
        return check_header(
            hdr,
            key=key,
            digest=self._digest,
            block_bytes=self._block_bytes,
            slot_bytes=self._files.slot_size,
        )

    def _short_read(self, slot: int, got: int, wanted: int) -> ReadOutcome:
        # Reported like write_block reports a short write (EIO, counted,
        # logged once); TRUNCATED if the slab now ends inside the slot, else
        # IO_ERROR (the device cut it short: short_read_outcome).
        idx, offset = self._files.locate(slot)
        files = self._files
        outcome = short_read_outcome(
            files.size(idx), offset + files.slot_size
        )
        cause = "truncated slab" if outcome is ReadOutcome.TRUNCATED else "not EOF"
        files.io_error(
            "read",
            idx,
            OSError(
                errno.EIO,
                f"short read ({got} of {wanted} bytes, {cause})",
                files.slabs[idx].path,
            ),
        )
        return outcome

    def _load(
        self, slot: int, key: bytes | None
    ) -> tuple[ReadOutcome, SlotHeader | None, np.ndarray | None]:
        """Read and verify a slot into this thread's bounce buffer.

        Returns the outcome, the header when it parsed, and (for OK only) the
        verified stored payload as a view into the bounce buffer.
        """
        idx, offset = self._files.locate(slot)
        bounce = self._bounce()
        first = HEADER_SIZE if self._two_step else self._files.slot_size
        t0 = time.perf_counter()
        nread = 0
        try:
            try:
                n = nread = self._files.read(idx, bounce[:first], offset)
                verdict = parse_header(bounce, n)
                if verdict.outcome is ReadOutcome.TRUNCATED:
                    return self._short_read(slot, n, first), None, None
                if verdict.outcome is ReadOutcome.BAD_HEADER:
                    self._files.rejected(slot, verdict.detail)
                    self._files.count_read(0, bad=1)
                if not verdict.ok:
                    return verdict.outcome, None, None
                assert verdict.header is not None
                hdr = verdict.header
                verdict = self._check_header(hdr, key)
                if not verdict.ok:
                    return verdict.outcome, hdr, None
                end = HEADER_SIZE + hdr.payload_len
                if self._two_step and hdr.payload_len:
                    more = round_up(hdr.payload_len, IO_ALIGNMENT)
                    got = self._files.read(
                        idx,
                        bounce[HEADER_SIZE : HEADER_SIZE + more],
                        offset + HEADER_SIZE,
                    )
                    nread += got
                    n = HEADER_SIZE + got
            except OSError as exc:
                self._files.io_error("read", idx, exc)
                return ReadOutcome.IO_ERROR, None, None
            payload = bounce[HEADER_SIZE:end]
            verdict = check_payload(hdr, payload, n - HEADER_SIZE)
            if verdict.outcome is ReadOutcome.TRUNCATED:
                return self._short_read(slot, n, end), hdr, None
            if not verdict.ok:
                self._files.rejected(slot, "payload checksum mismatch")
                self._files.count_read(0, bad=1)
                return verdict.outcome, hdr, None
            return ReadOutcome.OK, hdr, payload
        finally:
            self._files.count_read(nread, time.perf_counter() - t0, blocks=1)
