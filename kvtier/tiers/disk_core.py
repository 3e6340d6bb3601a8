"""Placement on one disk tier: the one engine behind both disk tiers.

:class:`DiskTierCore` decides which disk slot holds which block and when a
block leaves; it is shared by the full spec's hierarchy
(:class:`~kvtier.tiers.hierarchy.TierHierarchy`, CPU -> disk spills) and by
the tiering-mode secondary tier
(:class:`~kvtier.connector.tiering.KvtierDiskTier`, vLLM's primary tier ->
disk). Both go through the same life of a disk block:

    make_room / allocate  -> WRITING (a chunk is being written)
    complete              -> READY   (event: stored, ``spill``)
    fail                  -> gone    (never readable: no event)
    pin_reads / release_reads: a read in flight pins the block; a read that
        failed verification drops the copy once nobody reads it
        (event: removed, ``corrupt``)
    make_room evicts READY, unpinned victims in policy order
        (event: removed, ``evict``); ``restore`` adopts blocks found on
        disk after a restart (event: stored, ``restore``).

Guarantees: at most ``capacity`` blocks; a WRITING or pinned block is never
a victim; every change of which keys are READY here is reported once, in
order, through ``emit(keys, removed, reason)``, one call per batch.
Bookkeeping only: no I/O, no vLLM, no locks (callers are single-threaded,
the scheduler). Every method is O(blocks passed or moved) (times log n for
the victim index), never O(capacity), except ``restore`` and ``clear``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.tiers.events import MEDIUM_DISK
from kvtier.tiers.plans import Key
from kvtier.tiers.slots import BlockState
from kvtier.tiers.tier import Tier

# emit(keys, removed, reason): keys became READY here (removed=False) or
# stopped being READY here (removed=True).
Emit = Callable[[Sequence[Key], bool, str], None]


class DiskTierCore:
    """Slots, victims, pins and residency events of one disk tier.

    ``tier`` is the underlying :class:`~kvtier.tiers.tier.Tier`, for
    queries (``get``, ``is_ready``, ``in``, ``len``, ``num_free``) and for
    a filter-free victim index; changes go through this class so that every
    one is reported."""

    def __init__(self, capacity: int, policy: Any = "lru", emit: Emit | None = None):
        self.tier = Tier(MEDIUM_DISK, capacity, policy)
        self.capacity = capacity
        self._emit = emit

    def _report(self, keys: Sequence[Key], removed: bool, reason: str) -> None:
        if keys and self._emit is not None:
            self._emit(keys, removed, reason)

    # ------------------------------------------------------------ writes

    def make_room(
        self, n: int, exclude: set[Key] | frozenset[Key] = frozenset()
    ) -> list[Key]:
        """Evict victims (READY, unpinned, not in ``exclude``, policy order)
        until ``n`` slots are free or no victim is left; returns the evicted
        keys (reported as removed, ``evict``). ``num_free`` says how much
        room there is now."""
        tier = self.tier
        need = n - tier.num_free
        if need <= 0:
            return []
        # Chosen and removed in one pass: each victim is taken out of the
        # index as it is chosen.
        victims = tier.evict(need, exclude=exclude)
        if victims:
            self._report(victims, True, "evict")
        return victims

    def allocate(self, keys: Sequence[Key]) -> list[int]:
        """Give each key (none resident) a slot in state WRITING; returns
        the slots in order. The caller made room for all of them."""
        return self.tier.allocate_many(keys, "spill")

    def complete(self, keys: Sequence[Key]) -> None:
        """The writes of ``keys`` (WRITING) finished: they become READY and
        are reported as stored (``spill``)."""
        self.tier.mark_ready_many(keys)
        self._report(keys, False, "spill")

    def fail(self, keys: Iterable[Key]) -> None:
        """The writes of ``keys`` (WRITING) failed: their slots are freed.
        They were never readable, so nothing is reported."""
        self.tier.remove_many(list(keys), False)

    # ------------------------------------------------------------- reads

    def pin_reads(self, keys: Sequence[Key]) -> list[int]:
        """Pin READY blocks for a read and mark them used (the first key
        ends up most recent); returns their slots. Raises ``KeyError`` if a
        key is not resident."""
        slots = self.tier.pin_many(keys)
        self.tier.touch_many(keys[::-1])
        return slots

    def release_reads(
        self, keys: Iterable[Key], corrupt: Iterable[Key] = ()
    ) -> list[Key]:
        """Unpin blocks read by one load. Keys in ``corrupt`` (read, and
        their bytes failed verification) are dropped once no other read
        pins them, reported as removed (``corrupt``); returns those
        dropped."""
        tier = self.tier
        tier.unpin_many([k for k in keys if k in tier])
        return self.drop_corrupt(corrupt)

    def drop_corrupt(self, keys: Iterable[Key]) -> list[Key]:
        """Drop the copies of ``keys`` that failed verification and that no
        read pins (reported as removed, ``corrupt``); returns them."""
        get = self.tier.get
        dropped = []
        for key in dict.fromkeys(keys):
            block = get(key)
            if block is not None and block.pins == 0:
                dropped.append(key)
        if dropped:
            self.tier.remove_many(dropped, False)
            self._report(dropped, True, "corrupt")
        return dropped

    # ---------------------------------------------------------- lifetime

    def restore(self, entries: list[tuple[Key, int]]) -> None:
        """Adopt READY blocks found on disk at known slots, oldest first
        (warm restart; only into an empty tier); reported as stored
        (``restore``). O(capacity)."""
        self.tier.restore(entries)
        self._report([k for k, _ in entries], False, "restore")

    def clear(self) -> list[Key]:
        """Forget every block; the READY ones are reported as removed
        (``reset``) and returned. O(blocks)."""
        ready = self.tier.clear()
        self._report(ready, True, "reset")
        return ready

    def is_ready(self, key: Key) -> bool:
        block = self.tier.get(key)
        return block is not None and block.state is BlockState.READY
