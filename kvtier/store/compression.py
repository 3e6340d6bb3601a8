"""Optional lossless compression of KV blocks (zstd over byte planes).

KV values are 16-bit floats whose high bytes (sign + exponent) are highly
repetitive while the low (mantissa) bytes look random. Splitting each block
into byte planes (all byte 0s, then all byte 1s, ...) puts the compressible
bytes next to each other, which is what lets zstd level 1 win anything at all.
When the win is below ``min_saving`` the block is stored raw: decompression
costs CPU on the promote path and a few percent of bandwidth is not worth it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from enum import IntEnum

import numpy as np
import zstandard

# Bytes per element of the KV cache's dtype names: the width of the byte
# planes compression splits a block into (2 where a name is not known).
_ELEMENT_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def element_bytes(dtype: object) -> int:
    """Bytes per element of the dtype named ``str(dtype)`` (vLLM's names,
    e.g. ``"bfloat16"``), 2 where the name is not known."""
    return _ELEMENT_BYTES.get(str(dtype).lower(), 2)


LEVEL = 1
DEFAULT_MIN_SAVING = 0.05
# disk_compression's values: stored as is, or zstd over byte planes.
COMPRESSION_CHOICES = ("none", "zstd")


class Codec(IntEnum):
    """How a payload is stored."""

    RAW = 0
    ZSTD_BYTEPLANE = 1


class CorruptPayloadError(ValueError):
    """A compressed payload did not decode to exactly the expected bytes."""


# zstd contexts are not thread-safe but are expensive to create per block:
# keep one pair per thread.
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    cctx = getattr(_local, "c", None)
    if cctx is None:
        cctx = _local.c = zstandard.ZstdCompressor(level=LEVEL)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "d", None)
    if dctx is None:
        dctx = _local.d = zstandard.ZstdDecompressor()
    return dctx


def _flat_u8(data: np.ndarray) -> np.ndarray:
    if not data.flags.c_contiguous:
        raise ValueError("data must be C-contiguous")
    return data.reshape(-1).view(np.uint8)


def to_byte_planes(data: np.ndarray, elem_size: int) -> np.ndarray:
    """Reorder ``elem_size``-byte elements into byte planes (a copy)."""
    flat = _flat_u8(data)
    if elem_size == 1:
        return flat
    if flat.size % elem_size:
        raise ValueError(
            f"{flat.size} bytes is not a multiple of elem_size={elem_size}"
        )
    return np.ascontiguousarray(flat.reshape(-1, elem_size).T)


def from_byte_planes(planes: np.ndarray, elem_size: int, out: np.ndarray) -> None:
    """Inverse of ``to_byte_planes``, writing into ``out`` (uint8, same size)."""
    flat_out = _flat_u8(out)
    if elem_size == 1:
        flat_out[:] = planes
        return
    flat_out.reshape(-1, elem_size)[:] = planes.reshape(elem_size, -1).T


def compress(
    data: np.ndarray, elem_size: int, *, min_saving: float = DEFAULT_MIN_SAVING
) -> tuple[Codec, bytes]:
    """Encode one block; returns the codec used and the bytes to store.

    Contract: ``decompress(codec, payload, data.nbytes, elem_size, out)``
    restores ``data`` byte for byte. Returns ``(Codec.RAW, bytes(data))``
    when compression would save less than ``min_saving`` of the size.
    ``elem_size`` >= 1 (the store checks it).
    """
    flat = _flat_u8(data)
    packed = _compressor().compress(to_byte_planes(flat, elem_size))
    if len(packed) <= flat.size * (1.0 - min_saving):
        return Codec.ZSTD_BYTEPLANE, packed
    return Codec.RAW, flat.tobytes()


def decompress(
    codec: Codec | int,
    payload: bytes | memoryview | np.ndarray,
    raw_len: int,
    elem_size: int,
    out: np.ndarray,
) -> None:
    """Decode ``payload`` into ``out`` (uint8-viewable, ``raw_len`` bytes).

    Raises CorruptPayloadError (before touching ``out``) if the payload does
    not decode to exactly ``raw_len`` bytes, and ValueError for an unknown codec.
    Memory is bounded by ``raw_len`` whatever the payload: a frame is decoded
    only when its header declares exactly ``raw_len`` bytes (``compress``
    always writes the size), because the decoder allocates the declared size
    and decodes all of it before its length could be compared (a few KiB of
    frame can declare and hold gigabytes).
    """
    flat_out = _flat_u8(out)
    if flat_out.size != raw_len:
        raise ValueError(f"out has {flat_out.size} bytes, expected {raw_len}")
    codec = Codec(codec)
    if codec is Codec.RAW:
        src = np.frombuffer(payload, dtype=np.uint8)
        if src.size != raw_len:
            raise CorruptPayloadError(
                f"raw payload is {src.size} bytes, expected {raw_len}"
            )
        flat_out[:] = src
        return
    try:
        _check_frame_header(payload, raw_len)
        decoded = _decompressor().decompress(payload, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise CorruptPayloadError(f"zstd: {exc}") from exc
    if len(decoded) != raw_len:
        raise CorruptPayloadError(f"decoded {len(decoded)} bytes, expected {raw_len}")
    from_byte_planes(np.frombuffer(decoded, dtype=np.uint8), elem_size, flat_out)


def check_decodes(
    codec: Codec | int,
    pieces: Iterator[bytes | memoryview],
    raw_len: int,
    *,
    out_piece: int,
) -> None:
    """Raise CorruptPayloadError where :func:`decompress` would, for a
    payload given as consecutive ``pieces`` and decoded without being kept:
    the frame's header (:func:`_check_frame_header`), its decoding to
    exactly ``raw_len`` bytes, and the frame whole, through its last block
    (:class:`_FrameEnd`; bytes after it are ignored, as a load ignores them).

    Memory: the piece at hand, ``out_piece`` bytes of output and the
    decoder's window (zstd's default limit, 128 MiB), whatever ``raw_len``
    claims: for the tools, which check stores whose block size (up to
    4 GiB) they do not choose. ``pieces`` is read to its end; errors raised
    by it propagate. ValueError for an unknown codec.
    """
    codec = Codec(codec)
    if codec is Codec.RAW:
        size = sum(len(c) for c in pieces)
        if size != raw_len:
            raise CorruptPayloadError(
                f"raw payload is {size} bytes, expected {raw_len}"
            )
        return
    head = next(pieces, b"")
    try:
        _check_frame_header(head, raw_len)
        end = _FrameEnd(head)
    except zstandard.ZstdError as exc:
        raise CorruptPayloadError(f"zstd: {exc}") from exc

    def fed() -> Iterator[bytes | memoryview]:
        for piece in pieces:
            end.feed(piece)  # before the reader sees it (pieces are reused)
            yield piece

    rest = fed()
    reader = _decompressor().stream_reader(_PieceSource(head, rest))
    decoded = 0
    try:
        while decoded < raw_len:
            n = len(reader.read(min(out_piece, raw_len - decoded)))
            if not n:
                break
            decoded += n
    except zstandard.ZstdError as exc:
        raise CorruptPayloadError(f"zstd: {exc}") from exc
    for _ in rest:  # the frame's last blocks, where the reader stopped short
        pass
    if decoded != raw_len:
        raise CorruptPayloadError(f"decoded {decoded} bytes, expected {raw_len}")
    end.check()


def _check_frame_header(head: bytes | memoryview | np.ndarray, raw_len: int) -> None:
    """A frame kvtier's :func:`compress` could have written: it declares
    exactly ``raw_len`` bytes and carries no content checksum (kvtier never
    writes one; the payload's xxh3 covers it). CorruptPayloadError
    otherwise; zstandard.ZstdError for no frame header at all."""
    declared = zstandard.frame_content_size(head)
    if declared != raw_len:
        size = "no size" if declared < 0 else f"{declared} bytes"
        raise CorruptPayloadError(f"zstd frame declares {size}, expected {raw_len}")
    if zstandard.get_frame_parameters(head).has_checksum:
        raise CorruptPayloadError(
            "zstd frame carries a content checksum, which kvtier never writes"
        )


class _FrameEnd:
    """Where a zstd frame ends, read from its block headers as the payload
    goes by (3 bytes each: last-block flag, type, size): whether the
    payload holds the frame whole, as a load's one-shot decode requires.
    ``feed`` each piece after ``head`` in order; ``check`` at the end."""

    def __init__(self, head: bytes | memoryview | np.ndarray) -> None:
        self.next = zstandard.frame_header_size(head)  # the next block header
        self.seen = 0  # payload bytes fed
        self.partial = b""  # a block header cut by a piece's end
        self.end: int | None = None  # the frame's length, once known
        self.problem = ""
        self.feed(head)

    def feed(self, piece: bytes | memoryview | np.ndarray) -> None:
        start, data = self.seen, memoryview(piece).cast("B")
        self.seen += len(data)
        while self.end is None and not self.problem and self.next < self.seen:
            at = self.next + len(self.partial) - start
            self.partial += bytes(data[at : at + 3 - len(self.partial)])
            if len(self.partial) < 3:
                return
            word, self.partial = int.from_bytes(self.partial, "little"), b""
            last, kind, size = word & 1, (word >> 1) & 3, word >> 3
            if kind == 3:
                self.problem = "a block of the reserved type"
                return
            self.next += 3 + (1 if kind == 1 else size)  # kind 1: one byte, repeated
            if last:
                self.end = self.next

    def check(self) -> None:
        if self.problem:
            raise CorruptPayloadError(f"zstd frame holds {self.problem}")
        if self.end is None or self.end > self.seen:
            raise CorruptPayloadError(
                f"zstd frame is cut short ({self.seen} bytes given)"
            )


class _PieceSource:
    """``read(size)`` over ``head`` then ``pieces``, for zstd's stream reader."""

    def __init__(
        self, head: bytes | memoryview, pieces: Iterator[bytes | memoryview]
    ) -> None:
        self._pending = memoryview(head)
        self._pieces = pieces

    def read(self, size: int = -1) -> bytes:
        while not self._pending:
            nxt = next(self._pieces, None)
            if nxt is None:
                return b""
            self._pending = memoryview(nxt)
        if size < 0:
            size = len(self._pending)
        out, self._pending = self._pending[:size], self._pending[size:]
        return bytes(out)
