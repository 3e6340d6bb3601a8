"""Checksums used by the on-disk format.

One function per purpose so the algorithm is named in exactly one place: the
format version must change if it ever does. xxh3_64 runs at memory speed, which
matters because every spilled and promoted block is hashed on the I/O path.
"""

from __future__ import annotations

from typing import Any

import xxhash


def payload_checksum(data: Any) -> int:
    """xxh3_64 of the stored (possibly compressed) payload bytes.

    ``data`` is anything exposing the buffer protocol (bytes, memoryview,
    contiguous numpy array).
    """
    return xxhash.xxh3_64_intdigest(data)


def header_checksum(data: Any) -> int:
    """xxh3_64 of the header's fixed fields, detecting torn or flipped headers."""
    return xxhash.xxh3_64_intdigest(data)
