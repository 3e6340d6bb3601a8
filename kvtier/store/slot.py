"""One slot of a slab file: its format and how it is judged.

A slab file is an array of fixed-size slots. Each slot is a 4 KiB header
followed by the block payload, padded to 4 KiB so that every slot (and every
payload) starts on an O_DIRECT-aligned offset (see docs/on-disk-format.md):
:class:`SlotHeader` is the header, :class:`LayoutFingerprint` the identity
of the layout whose digest it carries, :func:`slot_size` the slot's bytes.

Judging a slot is the same rule for every reader (the writer's promotions,
the workers' loads, warm restart, ``kvtier inspect``/``verify``): each check
returns a :class:`SlotVerdict` whose ``detail`` says, for a rejected slot,
why in words. :func:`verify_header` (magic, version, header checksum, layout,
key, lengths) then :func:`check_payload` (the payload's xxh3) is the whole
host verification; :func:`decode_payload` decodes a verified payload and rejects one
that does not decode as the header says.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.checksum import header_checksum, payload_checksum, payload_hasher
from kvtier.store.compression import (
    Codec,
    CorruptPayloadError,
    check_decodes,
    decompress,
)

# The store layout version: part of the fingerprint digest (so it names the
# directory). Bump it on a change old readers must never see (slot geometry,
# codecs): a bump moves slabs to a fresh directory instead of misreading them.
FORMAT_VERSION = 1
# The slot header's own version (the ``version`` field). Headers evolve
# compatibly inside one FORMAT_VERSION: a reader accepts every version in
# HEADER_VERSIONS and refuses any other (a newer kvtier's slot) by name.
#   1: xxh3_64 payload checksum only.
#   2: adds ``device_checksum`` (kvtier.store.checksum.device_checksum), which
#      torch computes on the GPU for reads staged in device memory.
#   3: version 2's fields, whose reserved byte holds ``flags`` (FLAG_*).
#      Written only for a slot with a flag set: a release that reads
#      versions 1 and 2 ignores that byte, so it must refuse such a slot
#      rather than read it without its flag (``after_reset``).
HEADER_VERSION = 2
FLAGGED_HEADER_VERSION = 3
HEADER_VERSIONS = (1, 2, 3)
# The block was written after a connector reset in the engine that wrote it
# (vLLM's reset_cache: a sleep, a pause that clears the caches, a weight
# update's reset): the weights that computed it may no longer be the ones
# its store's identity names, so no warm restart adopts it. Readable while
# that engine runs, like any other block.
FLAG_AFTER_RESET = 0x01
_KNOWN_FLAGS = FLAG_AFTER_RESET
MAGIC = b"KVTIERS1"
# A whole alignment unit: the payload then starts 4 KiB-aligned for O_DIRECT.
HEADER_SIZE = 4096
MAX_KEY_LEN = 64
FINGERPRINT_LEN = 16

# Little-endian fixed fields. The first two (magic, version) must keep their
# position forever so any future reader can tell versions apart.
#   magic 8s | version I | codec B | elem_size B | key_len B | reserved B |
#   fingerprint 16s | key 64s | payload_len Q | raw_len Q | payload_checksum Q |
#   seq Q | written_at d                                     (version 1)
#   ... | written_at d | device_checksum Q                   (version 2)
#   version 2's, the reserved byte being ``flags``           (version 3)
# followed by the header checksum Q over the fields before it.
_FIELDS_V1 = struct.Struct("<8sIBBBB16s64sQQQQd")
_FIELDS_V2 = struct.Struct("<8sIBBBB16s64sQQQQdQ")
_FIELDS = {1: _FIELDS_V1, 2: _FIELDS_V2, 3: _FIELDS_V2}
_VERSION_AT = struct.Struct("<I")
_CODECS = {int(codec): codec for codec in Codec}
_HEADER_CHECKSUM = struct.Struct("<Q")
# Bytes of the header that carry meaning (the longest version's); the rest of
# HEADER_SIZE is zeros. Reading this many bytes of a slot parses any version.
FIXED_HEADER_LEN = _FIELDS_V2.size + _HEADER_CHECKSUM.size


class HeaderError(ValueError):
    """A header could not be accepted."""


class EmptySlotError(HeaderError):
    """The slot was never written or was invalidated (magic is all zeros)."""


class CorruptHeaderError(HeaderError):
    """Wrong magic, unsupported version, bad header checksum or bad fields."""


def round_up(n: int, alignment: int = IO_ALIGNMENT) -> int:
    """Smallest multiple of ``alignment`` that is >= ``n``."""
    return -(-n // alignment) * alignment


def slot_size(block_bytes: int) -> int:
    """Bytes one slot occupies on disk: header + payload, 4 KiB-aligned."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return round_up(HEADER_SIZE + block_bytes, IO_ALIGNMENT)


def aligned_empty(nbytes: int, alignment: int = IO_ALIGNMENT) -> np.ndarray:
    """An uninitialised uint8 array whose address is a multiple of ``alignment``.

    numpy gives no alignment guarantee beyond 64 bytes, and O_DIRECT needs the
    buffer address aligned too, so over-allocate and slice (the slice keeps the
    allocation alive through ``.base``).
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that must match for a stored block to be meaningful.

    Contract: two stores may share slot contents iff their ``digest()`` is
    equal. The digest covers every field plus FORMAT_VERSION, is stable across
    processes, machines and Python versions (canonical JSON + blake2b), and is
    what names the on-disk directory.

    ``geometry`` is a free-form canonical string of the KV layout (layers,
    heads, head size, block tokens, ...) chosen by the connector; ``tp_rank``
    and ``tp_size`` are included because each rank stores its own shard.
    ``model_id`` identifies the model's *contents* beyond its name (a hash of
    its config and weight files' names, sizes and mtimes; see
    ``kvtier.connector.identity``), so a checkpoint replaced at the same path
    gets a new namespace; ``dp_rank`` keeps data-parallel replicas (same
    config otherwise) apart. Both enter the digest only when set, so
    fingerprints without them keep their digests.
    """

    model: str
    dtype: str
    block_bytes: int
    geometry: str
    tp_rank: int
    tp_size: int
    model_id: str = ""
    dp_rank: int = 0
    # What ``model_id`` was derived from, in words (kvtier.connector.identity
    # .describe_settings): written to layout.json for ``kvtier inspect``;
    # not part of the digest (``model_id`` already is).
    identity: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tp_rank/tp_size: {self.tp_rank}/{self.tp_size}")
        if self.dp_rank < 0:
            raise ValueError(f"bad dp_rank: {self.dp_rank}")

    def _optional(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.model_id:
            extra["model_id"] = self.model_id
        if self.dp_rank:
            extra["dp_rank"] = self.dp_rank
        return extra

    def _fields(self) -> dict[str, Any]:
        """What the digest covers."""
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "dtype": self.dtype,
            "block_bytes": self.block_bytes,
            "geometry": self.geometry,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            **self._optional(),
        }

    def _canonical(self) -> bytes:
        return json.dumps(
            self._fields(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")

    def digest(self) -> bytes:
        """16-byte identity of this layout (stored in every slot header)."""
        return hashlib.blake2b(
            self._canonical(), digest_size=FINGERPRINT_LEN, person=b"kvtier-layout"
        ).digest()

    def describe(self) -> dict[str, Any]:
        """JSON-friendly description (written next to the slabs, shown by inspect)."""
        return {
            **self._fields(),
            **({"identity": dict(self.identity)} if self.identity else {}),
            "digest": self.digest().hex(),
        }


@dataclass(frozen=True)
class SlotHeader:
    """The header at the start of every written slot.

    Contract:
      - ``pack()`` returns exactly HEADER_SIZE bytes; ``unpack(pack(h)) == h``.
      - ``unpack`` raises EmptySlotError for a zeroed (never written or
        invalidated) header and CorruptHeaderError for anything else it cannot
        trust: wrong magic, other format version, header checksum mismatch,
        out-of-range fields (a raw payload shorter or longer than the
        block included). It never returns a header whose own checksum
        failed, so a torn header write is always detected.
      - ``checksum`` is xxh3_64 of the ``payload_len`` stored bytes (i.e. after
        compression); ``raw_len`` is the decoded size. ``device_checksum``
        (version 2 headers; ``None`` in version 1) is
        :func:`kvtier.store.checksum.device_checksum` of the same bytes.
      - ``version`` 1, 2 and 3 are read; ``pack`` writes HEADER_VERSION, or
        FLAGGED_HEADER_VERSION for an ``after_reset`` header, and nothing
        else (ValueError for another ``version`` or without
        ``device_checksum``). Any other version, and a version 3 header with
        a flag this kvtier does not know, is refused by ``unpack`` with a
        message naming it.
      - ``after_reset`` (FLAG_AFTER_RESET, version 3 only): written after a
        connector reset in its engine, so never adopted by a warm restart.
      - ``seq`` grows monotonically per store (also across restarts) and
        ``written_at`` is wall-clock seconds; both order warm-restart eviction.
    """

    key: bytes
    fingerprint: bytes
    payload_len: int
    raw_len: int
    codec: Codec
    checksum: int
    seq: int
    written_at: float
    elem_size: int = 1
    magic: bytes = MAGIC
    version: int = HEADER_VERSION
    device_checksum: int | None = None
    after_reset: bool = False

    def pack(self) -> bytes:
        if len(self.key) > MAX_KEY_LEN:
            raise ValueError(f"key is {len(self.key)} bytes, max {MAX_KEY_LEN}")
        if len(self.fingerprint) != FINGERPRINT_LEN:
            raise ValueError(f"fingerprint must be {FINGERPRINT_LEN} bytes")
        expected = FLAGGED_HEADER_VERSION if self.after_reset else HEADER_VERSION
        if self.version != expected:
            raise ValueError(
                f"cannot write header version {self.version} (a header with "
                f"after_reset={self.after_reset} is version {expected})"
            )
        if self.device_checksum is None:
            raise ValueError(f"a version {HEADER_VERSION} header needs device_checksum")
        fixed = _FIELDS_V2.pack(
            self.magic,
            self.version,
            int(self.codec),
            self.elem_size,
            len(self.key),
            FLAG_AFTER_RESET if self.after_reset else 0,
            self.fingerprint,
            self.key,
            self.payload_len,
            self.raw_len,
            self.checksum,
            self.seq,
            self.written_at,
            self.device_checksum,
        )
        fixed += _HEADER_CHECKSUM.pack(header_checksum(fixed))
        return fixed + bytes(HEADER_SIZE - len(fixed))

    @classmethod
    def unpack(cls, buf: Any) -> SlotHeader:
        """Parse the first FIXED_HEADER_LEN bytes of ``buf`` (buffer protocol)."""
        view = memoryview(buf).cast("B")
        if len(view) < FIXED_HEADER_LEN:
            raise CorruptHeaderError(f"header too short: {len(view)} bytes")
        fixed = bytes(view[:FIXED_HEADER_LEN])
        if fixed[: len(MAGIC)] == bytes(len(MAGIC)):
            raise EmptySlotError("empty slot")
        version = header_version(fixed, len(fixed))
        if version is None:
            raise CorruptHeaderError(f"bad magic {fixed[: len(MAGIC)]!r}")
        fields = _FIELDS.get(version)
        if fields is None:
            # A bit flipped in the version field reads as an unknown version
            # too: only a header whose checksum holds (over this release's
            # newest layout) is called another release's.
            newest = _FIELDS[max(HEADER_VERSIONS)]
            (stored,) = _HEADER_CHECKSUM.unpack_from(fixed, newest.size)
            if stored != header_checksum(fixed[: newest.size]):
                raise CorruptHeaderError(
                    f"header checksum mismatch (its version field reads "
                    f"{version}, which this kvtier does not read: a corrupt "
                    "header, or one of another kvtier release)"
                )
            raise CorruptHeaderError(
                f"unsupported slot header version {version} (this kvtier reads "
                f"versions {', '.join(map(str, HEADER_VERSIONS))}): the slot was "
                "written by another kvtier release; it is never read. Upgrade "
                "kvtier or give this one an empty disk path"
            )
        values = fields.unpack_from(fixed)
        device_checksum = values[13] if version >= 2 else None
        (
            magic,
            version,
            codec,
            elem_size,
            key_len,
            flags,
            fingerprint,
            key,
            payload_len,
            raw_len,
            checksum,
            seq,
            written_at,
        ) = values[:13]
        (stored,) = _HEADER_CHECKSUM.unpack_from(fixed, fields.size)
        if stored != header_checksum(fixed[: fields.size]):
            raise CorruptHeaderError("header checksum mismatch")
        if key_len > MAX_KEY_LEN:
            raise CorruptHeaderError(f"key length {key_len} > {MAX_KEY_LEN}")
        if version < FLAGGED_HEADER_VERSION:
            flags = 0  # a reserved byte then, never interpreted
        elif flags & ~_KNOWN_FLAGS:
            raise CorruptHeaderError(
                f"slot header flags {flags:#04x} include one this kvtier does not "
                "know: the slot was written by another kvtier release; it is "
                "never read. Upgrade kvtier or give this one an empty disk path"
            )
        codec_enum = _CODECS.get(codec)
        if codec_enum is None:
            raise CorruptHeaderError(f"unknown codec {codec}")
        if elem_size == 0 or payload_len > raw_len:
            raise CorruptHeaderError("inconsistent lengths or element size")
        if codec_enum is Codec.RAW and payload_len != raw_len:
            # The checksum covers payload_len bytes only: a reader using
            # raw_len bytes of a raw slot would take the rest unverified.
            raise CorruptHeaderError(
                f"raw payload_len {payload_len} != raw_len {raw_len}"
            )
        # Every field set at once, not through the frozen dataclass's
        # __init__ (one object.__setattr__ a field: 5 of the 7 us a parse
        # took, and a warm restart parses a header a slot).
        hdr = object.__new__(cls)
        hdr.__dict__.update(
            key=key[:key_len],
            fingerprint=fingerprint,
            payload_len=payload_len,
            raw_len=raw_len,
            codec=codec_enum,
            checksum=checksum,
            seq=seq,
            written_at=written_at,
            elem_size=elem_size,
            magic=magic,
            version=version,
            device_checksum=device_checksum,
            after_reset=bool(flags & FLAG_AFTER_RESET),
        )
        return hdr


def header_version(buf: Any, nread: int) -> int | None:
    """The header version of a slot whose first ``nread`` bytes (in ``buf``)
    start with kvtier's magic, even a version this kvtier refuses; None
    when they do not."""
    view = memoryview(buf).cast("B")
    if nread < len(MAGIC) + _VERSION_AT.size or bytes(view[: len(MAGIC)]) != MAGIC:
        return None
    return int(_VERSION_AT.unpack_from(view, len(MAGIC))[0])


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


class SlotVerdict(NamedTuple):
    """What a check found: the outcome, the header when it parsed (also for
    some rejections, e.g. another key or layout), and why, in words. A
    named tuple: a warm restart's scan makes one a slot."""

    outcome: ReadOutcome
    header: SlotHeader | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is ReadOutcome.OK


def verify_header(
    buf: Any, *, key: bytes | None, digest: bytes | str | None, block_bytes: int
) -> SlotVerdict:
    """Judge the header of a slot read whole (at least its fixed part is in
    ``buf``): EMPTY, BAD_HEADER (magic, unknown version, header checksum,
    fields), or whether it belongs here: to the layout ``digest`` (bytes:
    the full digest; str: a hex prefix, as in a store directory's name;
    None: any), to ``key`` (None: any key) and to blocks of ``block_bytes``
    (a parsed header's payload is never longer than its ``raw_len``, so it
    then fits the slot). OK carries the header."""
    try:
        hdr = SlotHeader.unpack(buf)
    except EmptySlotError:
        return SlotVerdict(ReadOutcome.EMPTY)
    except CorruptHeaderError as exc:
        return SlotVerdict(ReadOutcome.BAD_HEADER, detail=f"bad header ({exc})")
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
    if hdr.raw_len != block_bytes:
        return SlotVerdict(
            ReadOutcome.BAD_HEADER,
            detail=f"raw_len {hdr.raw_len} != block_bytes {block_bytes}",
        )
    return SlotVerdict(ReadOutcome.OK, hdr)


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
            "payload checksum mismatch",
        )
    return SlotVerdict(ReadOutcome.OK, hdr)


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


def check_payload_in_pieces(
    hdr: SlotHeader, read: Callable[[int, np.ndarray], int], buf: np.ndarray
) -> SlotVerdict:
    """:func:`check_payload`'s and then :func:`decode_payload`'s verdict
    (TRUNCATED, CHECKSUM_MISMATCH, BAD_HEADER, in that order) on a payload
    read piece by piece, never whole: ``read(pos, view)`` fills ``view`` (a
    slice of ``buf`` from its start, a multiple of IO_ALIGNMENT long; give
    an aligned ``buf`` for O_DIRECT) with the payload's bytes from ``pos``
    and returns the count read (fewer: the file ends there); its OSError
    propagates. Memory is ``buf`` and
    :func:`~kvtier.store.compression.check_decodes`'s, whatever the header
    claims: the tools check stores whose block size (up to 4 GiB) they do
    not choose."""
    hasher = payload_hasher()
    total = hdr.payload_len
    got = 0  # payload bytes read and hashed

    def pieces() -> Iterator[memoryview]:
        # Each piece is a view of buf, read again only when the consumer
        # asks for the next one (check_decodes holds one piece at a time).
        nonlocal got
        while got < total:
            need = total - got
            want = min(len(buf), round_up(need))
            n = read(got, buf[:want])
            use = min(max(n, 0), need)
            if use:
                view = memoryview(buf[:use])
                hasher.update(view)
                got += use
                yield view
            if use < min(want, need):
                return  # the slab ends inside the payload

    stream = pieces()
    problem = ""
    try:
        check_decodes(hdr.codec, stream, hdr.raw_len, out_piece=min(len(buf), 1 << 20))
    except (CorruptPayloadError, ValueError) as exc:
        problem = str(exc)
    for _ in stream:  # the rest, for the checksum (a frame may end early)
        pass
    if got < total:
        return SlotVerdict(
            ReadOutcome.TRUNCATED, hdr, f"payload: read {got} of {total} bytes"
        )
    if hasher.intdigest() != hdr.checksum:
        return SlotVerdict(
            ReadOutcome.CHECKSUM_MISMATCH, hdr, "payload checksum mismatch"
        )
    if problem:
        return SlotVerdict(
            ReadOutcome.BAD_HEADER, hdr, f"payload does not decode ({problem})"
        )
    return SlotVerdict(ReadOutcome.OK, hdr)
