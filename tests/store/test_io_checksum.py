"""xxh3_64, as the on-disk format stores it (kvtier.store.checksum): equal to
xxhash's for every buffer kind, from several threads at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from kvtier.store.checksum import header_checksum, payload_checksum


@pytest.mark.parametrize("size", [0, 1, 3, 4095, 4096, 65537, 1 << 20])
def test_it_equals_xxhash_for_every_buffer_kind(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(data.tobytes())
    assert payload_checksum(data) == want
    assert payload_checksum(memoryview(data)) == want
    assert payload_checksum(data.tobytes()) == want
    assert payload_checksum(bytearray(data.tobytes())) == want
    assert header_checksum(data.tobytes()) == want
    rows = np.zeros((2, size + 8), dtype=np.uint8)
    rows[1, 8:] = data  # a row's tail: contiguous, at an unaligned address
    assert payload_checksum(rows[1, 8:]) == want


def test_a_changed_byte_changes_it():
    data = np.arange(1 << 16, dtype=np.uint32).view(np.uint8).copy()
    before = payload_checksum(data)
    data[12345] ^= 0x10
    assert payload_checksum(data) != before


def test_threads_hashing_at_once_agree():
    blocks = [np.full(1 << 18, i, dtype=np.uint8) for i in range(8)]
    want = [xxhash.xxh3_64_intdigest(b) for b in blocks]
    got: list[list[int]] = []

    def run() -> None:
        got.append([payload_checksum(b) for b in blocks])

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == [want] * 4
