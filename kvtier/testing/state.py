"""Reads and moves of the plugin's inner state that only tests and
benchmarks need, and the slot headers an older kvtier wrote (imports no
vLLM).

Each helper reaches the state the way the plugin itself does (the same
readers, the same private bookkeeping), so what a test asserts through it is
what the plugin would see.
"""

from __future__ import annotations

import dataclasses

from kvtier.store.slot import (
    _FIELDS_V1,
    _HEADER_CHECKSUM,
    HEADER_SIZE,
    HEADER_VERSION,
    MAGIC,
    ReadOutcome,
    SlotHeader,
    header_checksum,
)
from kvtier.store.store import DiskStore
from kvtier.tiers.disk_core import DiskTierCore
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Key
from kvtier.tiers.slots import BlockState, TierBlock
from kvtier.tiers.tier import Tier


def verify(store: DiskStore, slot: int) -> ReadOutcome:
    """Read ``slot`` of ``store`` whole, no key expected, and check header,
    layout and payload checksum (what ``kvtier verify`` does per slot).
    Counts in the store's stats like any read; IndexError for a slot out of
    range."""
    (got,) = store._reader().read([(slot, None)])
    return got.outcome


def read_header(store: DiskStore, slot: int) -> tuple[SlotHeader | None, ReadOutcome]:
    """``slot``'s header and outcome as the store's own restart ``scan``
    reports them (which also raises ``next_seq`` above every intact seq)."""
    for at, header, outcome in store.scan():
        if at == slot:
            return header, outcome
    raise IndexError(f"slot {slot} out of range")


def evictable(block: TierBlock) -> bool:
    """``block`` may be chosen as a victim: READY and read by nobody."""
    return block.state is BlockState.READY and block.pins == 0


def allocate(tier: Tier, key: Key, origin: str = "store") -> TierBlock:
    """Give ``key`` a free slot of ``tier`` in state WRITING (a batch of
    one); returns its block. The caller checked room."""
    tier.allocate_many((key,), origin)
    block = tier.get(key)
    assert block is not None
    return block


def pin(tier: Tier, key: Key) -> None:
    """Add a reader to ``key``'s block (a batch of one): no longer a victim."""
    tier.pin_many((key,))


def evict_clean(h: TierHierarchy, key: Key) -> bool:
    """Drop ``key``'s CPU copy if it is idle and also ready on disk (the
    disk copy stays), as CPU-tier pressure would. True if dropped."""
    if h.disk is None or not h.disk.is_ready(key):
        return False
    block = h.cpu.get(key)
    if block is None or not evictable(block):
        return False
    h._drop_from_cpu([key])
    return True


def num_loads(h: TierHierarchy) -> int:
    """Loads ``h`` planned and has not seen complete."""
    return len(h._loads)


def io_error_count(core: DiskTierCore, key: Key) -> int:
    """How many reads of ``key``'s block failed with an I/O error in a row
    (0 after a good read)."""
    return core._io_errors.get(key, 0)


def pack_version_1(header: SlotHeader) -> bytes:
    """``header`` as the version 1 header an older kvtier wrote: the version
    2 fields less ``device_checksum``, under their own header checksum,
    zero-padded to HEADER_SIZE."""
    current = dataclasses.replace(header, version=HEADER_VERSION, device_checksum=0)
    fixed = bytearray(current.pack()[: _FIELDS_V1.size])
    fixed[len(MAGIC) : len(MAGIC) + 4] = (1).to_bytes(4, "little")
    fixed += _HEADER_CHECKSUM.pack(header_checksum(bytes(fixed)))
    return bytes(fixed) + bytes(HEADER_SIZE - len(fixed))
