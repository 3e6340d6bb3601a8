"""Endless spill writer for test_crash_consistency (run as a script, killed
with SIGKILL at a random moment).

    python _spill_writer.py PATH NUM_SLOTS BLOCK_BYTES SEED DIRECT(0|1)

Opens a DiskStore on PATH and, forever (at most ``MAX_SECONDS``), writes
blocks whose content is ``block_for(key)`` to random slots, overwriting them
again and again, and now and then invalidates a slot. Keys are unique
(seed + counter). Prints ``ready`` once every slot has been written at least
once on average, so the test knows the kill lands on a busy, populated store.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time

import numpy as np

from kvtier.store.backends.posix import PosixBackend
from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore

MAX_SECONDS = 60.0  # a safety net only: the test kills the writer long before


def crash_fingerprint(block_bytes: int) -> LayoutFingerprint:
    return LayoutFingerprint(
        model="test/crash",
        dtype="bfloat16",
        block_bytes=block_bytes,
        geometry="crash-consistency",
        tp_rank=0,
        tp_size=1,
    )


def block_for(key: bytes, nbytes: int) -> np.ndarray:
    """Content derived from ``key`` only; every 4 KiB page differs (so a page
    from another write is never mistaken for this one) and it is cheap
    enough that the writer spends its time writing."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    page = np.frombuffer(np.random.default_rng(list(seed)).bytes(4096), dtype=np.uint64)
    pages = nbytes // 4096
    out = np.tile(page, pages).reshape(pages, 512)
    out ^= np.arange(pages, dtype=np.uint64)[:, None]
    return out.reshape(-1).view(np.uint8)


def key_for(seed: int, counter: int) -> bytes:
    return b"crash" + seed.to_bytes(4, "little") + counter.to_bytes(8, "little")


def main(argv: list[str]) -> int:
    path, num_slots, block_bytes, seed, direct = (
        argv[0],
        int(argv[1]),
        int(argv[2]),
        int(argv[3]),
        argv[4] == "1",
    )
    rng = random.Random(seed)
    store = DiskStore(
        [path],
        num_slots,
        block_bytes,
        crash_fingerprint(block_bytes),
        backend=PosixBackend(threads=1, direct=direct),
    )
    counter = 0
    deadline = time.monotonic() + MAX_SECONDS
    while time.monotonic() < deadline:
        slot = rng.randrange(num_slots)
        if rng.random() < 0.1:
            store.invalidate(slot)
            continue
        key = key_for(seed, counter)
        store.write_block(slot, key, block_for(key, block_bytes), store.next_seq())
        counter += 1
        if counter == num_slots:
            print("ready", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
