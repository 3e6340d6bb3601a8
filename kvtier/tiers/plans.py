"""What the hierarchy hands out: lookup answers, load and store plans, and
the transfer orders that the I/O side executes. Plain data, no behaviour."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

Key = Hashable


class Residency(Enum):
    """Answer of :meth:`TierHierarchy.lookup` for one key."""

    HIT_CPU = "hit_cpu"  # ready on CPU
    HIT_DISK = "hit_disk"  # ready on disk (and not ready on CPU)
    PENDING = "pending"  # only being written (a store in flight)
    MISS = "miss"

    @property
    def is_hit(self) -> bool:
        return self in (Residency.HIT_CPU, Residency.HIT_DISK)


class BlockLocation(NamedTuple):
    """Where one block of a load is read from. ``promote_slot`` is a CPU
    row the loader also copies a verified disk block into (``None``: no
    copy up, or the block is read from the CPU tier)."""

    medium: str
    slot: int
    promote_slot: int | None = None


@dataclass(slots=True)
class LoadPlan:
    """Where to read each key from; the blocks stay pinned until
    :meth:`TierHierarchy.complete_load` of ``load_id``."""

    load_id: int
    keys: list[Key]
    locations: list[BlockLocation]


@dataclass(slots=True)
class StorePlan:
    """CPU slots to write ``keys_to_store`` into (same order), and the keys
    that left the CPU tier to make room (their disk copy, if any, stays)."""

    keys_to_store: list[Key]
    cpu_slots: list[int]
    evicted_keys: list[Key]


class TransferItem(NamedTuple):
    """Copy slot ``src_slot`` of the source medium to ``dst_slot`` of the
    destination, for ``key``. A tuple: one is built per block moved, and a
    frozen dataclass costs several times more to build."""

    key: Key
    src_slot: int
    dst_slot: int


@dataclass(frozen=True, slots=True)
class SpillOrder:
    """Copy CPU slot ``src_slot`` to disk slot ``dst_slot`` for each item."""

    job_id: int
    items: tuple[TransferItem, ...]


@dataclass(frozen=True, slots=True)
class PromoteOrder:
    """Copy disk slot ``src_slot`` into CPU slot ``dst_slot`` for each item
    (used by the tiering-mode disk tier, whose primary tier is vLLM's)."""

    job_id: int
    items: tuple[TransferItem, ...]


@dataclass
class HierarchyStats:
    """Monotonic counters since construction (the metrics layer diffs them)."""

    stores_completed: int = 0
    stores_failed: int = 0
    stores_declined: int = 0
    # Blocks of offers larger than the whole CPU tier that were left out
    # (the head that fit was stored).
    store_blocks_skipped: int = 0
    cpu_evictions: int = 0
    disk_evictions: int = 0
    spills_started: int = 0
    spills_completed: int = 0
    spill_failures: int = 0
    # Verified disk blocks that a load also copied into a CPU row.
    promotions_completed: int = 0
    # Loads completed per source medium (a failed disk read is not a load).
    loads_cpu: int = 0
    loads_disk: int = 0
    # Disk blocks a load could not use (I/O error, failed verification, or
    # the load given up). What that did to the disk copies is counted by
    # the disk core (DiskTierCore.failures).
    load_failures: int = 0
