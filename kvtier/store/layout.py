"""How a slot is judged: the rules every reader of a slot shares (pure: no
I/O, no torch; see docs/on-disk-format.md).

Judging a slot: :func:`short_read_outcome` is the one rule for a read that
came back short; :func:`verify_slot` (header and payload, xxh3) is the one
verification of the host paths; :func:`verify_header` and
:func:`check_payload` are its two halves for readers that fetch the header
and the payload separately. Each returns a :class:`SlotVerdict` whose
``detail`` says, for a rejected slot, why in words. :func:`decode_payload`
decodes a verified payload (zstd or raw) and rejects one that does not
decode as the header says.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier.store.checksum import payload_checksum
from kvtier.store.compression import CorruptPayloadError, decompress
from kvtier.store.format import (
    HEADER_SIZE,
    CorruptHeaderError,
    EmptySlotError,
    SlotHeader,
)


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
    # Intact, but without what a device read needs (a version 1 header has no
    # device checksum; a compressed payload decodes on the host only): read
    # it through the host path. Only the device staging reader reports it.
    HOST_ONLY = "host_only"


def short_read_outcome(file_size: int | None, slot_end: int) -> ReadOutcome:
    """What a read of a slot that returned fewer bytes than asked means.

    Slabs are preallocated to their full size, so a slab that now ends
    before ``slot_end`` (the slot's end offset) was truncated: TRUNCATED,
    the slot's block is gone for good (structural, like a bad checksum). A
    slab long enough (or of unknown size) had the read cut short by the
    device: IO_ERROR, transient like an errno (the block may read whole
    next time)."""
    if file_size is not None and file_size < slot_end:
        return ReadOutcome.TRUNCATED
    return ReadOutcome.IO_ERROR


@dataclass(frozen=True)
class SlotVerdict:
    """What a check found: the outcome, the header when it parsed (also for
    some rejections, e.g. another key or layout), and why, in words."""

    outcome: ReadOutcome
    header: SlotHeader | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is ReadOutcome.OK


def parse_header(buf: Any, nread: int) -> SlotVerdict:
    """Parse the header at the start of ``buf`` of which ``nread`` bytes were
    read: TRUNCATED, EMPTY, BAD_HEADER (magic, unknown version, header
    checksum, fields) or OK with the header."""
    if nread < HEADER_SIZE:
        return SlotVerdict(
            ReadOutcome.TRUNCATED, detail=f"read {nread} of {HEADER_SIZE} bytes"
        )
    try:
        hdr = SlotHeader.unpack(memoryview(buf).cast("B")[:HEADER_SIZE])
    except EmptySlotError:
        return SlotVerdict(ReadOutcome.EMPTY)
    except CorruptHeaderError as exc:
        return SlotVerdict(ReadOutcome.BAD_HEADER, detail=f"bad header ({exc})")
    return SlotVerdict(ReadOutcome.OK, hdr)


def check_header(
    hdr: SlotHeader,
    *,
    key: bytes | None,
    digest: bytes | str | None,
    block_bytes: int | None,
    slot_bytes: int,
) -> SlotVerdict:
    """Whether a parsed header belongs here: to the layout ``digest`` (bytes:
    the full digest; str: a hex prefix, as in a store directory's name; None:
    any), to ``key`` (None: any key) and to a slot of ``slot_bytes`` holding
    blocks of ``block_bytes`` (None: unknown, not checked)."""
    if isinstance(digest, bytes):
        fp_ok = hdr.fingerprint == digest
    else:
        fp_ok = digest is None or hdr.fingerprint.hex().startswith(digest)
    if not fp_ok:
        return SlotVerdict(
            ReadOutcome.FINGERPRINT_MISMATCH,
            hdr,
            f"header fingerprint {hdr.fingerprint.hex()}",
        )
    if key is not None and hdr.key != key:
        return SlotVerdict(
            ReadOutcome.KEY_MISMATCH, hdr, f"slot holds key {hdr.key.hex()}"
        )
    if block_bytes is not None and hdr.raw_len != block_bytes:
        return SlotVerdict(
            ReadOutcome.BAD_HEADER,
            detail=f"raw_len {hdr.raw_len} != block_bytes {block_bytes}",
        )
    if HEADER_SIZE + hdr.payload_len > slot_bytes:
        return SlotVerdict(
            ReadOutcome.BAD_HEADER,
            detail=f"payload_len {hdr.payload_len} overflows the slot",
        )
    return SlotVerdict(ReadOutcome.OK, hdr)


def verify_header(
    buf: Any,
    nread: int,
    *,
    key: bytes | None,
    digest: bytes | str | None,
    block_bytes: int | None,
    slot_bytes: int,
) -> SlotVerdict:
    """:func:`parse_header` then :func:`check_header`."""
    verdict = parse_header(buf, nread)
    if not verdict.ok:
        return verdict
    assert verdict.header is not None
    return check_header(
        verdict.header,
        key=key,
        digest=digest,
        block_bytes=block_bytes,
        slot_bytes=slot_bytes,
    )


def check_payload(hdr: SlotHeader, payload: Any, available: int) -> SlotVerdict:
    """Whether the stored payload is intact: ``payload`` holds (at least the
    first ``available`` of) the ``hdr.payload_len`` bytes after the header.
    TRUNCATED when fewer were read, CHECKSUM_MISMATCH when xxh3 differs."""
    if available < hdr.payload_len:
        return SlotVerdict(
            ReadOutcome.TRUNCATED,
            hdr,
            f"payload: read {max(available, 0)} of {hdr.payload_len} bytes",
        )
    view = memoryview(payload).cast("B")[: hdr.payload_len]
    if payload_checksum(view) != hdr.checksum:
        return SlotVerdict(
            ReadOutcome.CHECKSUM_MISMATCH,
            hdr,
            "payload checksum does not match the header",
        )
    return SlotVerdict(ReadOutcome.OK, hdr)


def verify_slot(
    buf: Any,
    nread: int,
    *,
    key: bytes | None,
    digest: bytes | str | None,
    block_bytes: int | None,
    slot_bytes: int,
) -> SlotVerdict:
    """The host verification of one slot read into ``buf`` (``nread`` bytes
    from the slot's start): header (magic, version, header checksum), layout,
    key, lengths, then the payload's xxh3. OK only when all hold."""
    verdict = verify_header(
        buf,
        nread,
        key=key,
        digest=digest,
        block_bytes=block_bytes,
        slot_bytes=slot_bytes,
    )
    if not verdict.ok:
        return verdict
    assert verdict.header is not None
    view = memoryview(buf).cast("B")
    return check_payload(
        verdict.header, view[HEADER_SIZE:], min(nread, len(view)) - HEADER_SIZE
    )


def decode_payload(hdr: SlotHeader, stored: Any, out: Any) -> SlotVerdict:
    """Decode a slot's stored payload (``stored``: its ``hdr.payload_len``
    bytes, already checked by :func:`check_payload`) into ``out`` (a
    C-contiguous array of ``hdr.raw_len`` bytes); a raw payload is copied.
    BAD_HEADER when it does not decode to exactly ``hdr.raw_len`` bytes (the
    header's codec or lengths lie although both checksums matched); ``out``
    is then left untouched. ``stored`` and ``out`` must not overlap."""
    try:
        decompress(hdr.codec, stored, hdr.raw_len, hdr.elem_size, out)
    except (CorruptPayloadError, ValueError) as exc:
        return SlotVerdict(
            ReadOutcome.BAD_HEADER, hdr, f"payload does not decode ({exc})"
        )
    return SlotVerdict(ReadOutcome.OK, hdr)
