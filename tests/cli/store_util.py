"""Real disk stores for the ``kvtier inspect`` / ``verify`` tests."""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore

BLOCK_BYTES = 64 * 1024


def fingerprint(block_bytes: int = BLOCK_BYTES) -> LayoutFingerprint:
    return LayoutFingerprint(
        model="test/model",
        dtype="bfloat16",
        block_bytes=block_bytes,
        geometry="layers=2,kv=2,heads=8,head=128,tokens=16",
        tp_rank=0,
        tp_size=1,
    )


def key_of(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() + b"\x00\x00\x00\x00"


def write_store(
    paths: list[str],
    n: int,
    slots: int = 8,
    compression: str = "none",
    block_bytes: int = BLOCK_BYTES,
) -> DiskStore:
    """A closed store of ``slots`` slots whose first ``n`` hold blocks."""
    store = DiskStore(
        paths,
        slots,
        block_bytes,
        fingerprint(block_bytes),
        backend="posix",
        compression=compression,
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        # Low-entropy data so zstd really compresses (shorter payloads).
        data = (rng.integers(0, 4, block_bytes) * (i + 1)).astype(np.uint8)
        store.write_block(i, key_of(i), data, store.next_seq())
    store.close()
    return store
