"""Placement on one disk tier: the one engine behind both disk tiers.

:class:`DiskTierCore` decides which disk slot holds which block and when a
block leaves; it is shared by the full spec's hierarchy
(:class:`~kvtier.tiers.hierarchy.TierHierarchy`, CPU -> disk spills) and by
the tiering-mode secondary tier
(:class:`~kvtier.connector.tiering.KvtierDiskTier`, vLLM's primary tier ->
disk). Both go through the same life of a disk block:

    make_room / allocate  -> WRITING (a block is being written)
    complete              -> READY   (event: stored, ``spill``)
    fail                  -> gone    (never readable: no event)
    pin_reads / release_reads: a read in flight pins the block; what the
        read found decides what happens to it once nobody reads it (the
        read-failure rule below)
    make_room evicts READY, unpinned victims in policy order
        (event: removed, ``evict``); ``restore`` adopts blocks found on
        disk after a restart (event: stored, ``restore``).

The read-failure rule, the one both disk tiers follow: a read whose bytes
fail verification (header, key, layout, checksum, decoding) drops the block
at once (event: removed, ``corrupt``); a read that fails with an I/O error
(any errno, a stalled read, a device's short read) fails its load and keeps
the block, counted, unless that block's reads have now failed so
``MAX_READ_IO_ERRORS`` times in a row: then it is dropped (event: removed,
``unreadable``). A read that succeeds starts the count again.
:class:`ReadFailures` counts what the rule did.

Guarantees: at most ``capacity`` blocks; a WRITING or pinned block is never
a victim; every change of which keys are READY here is reported once, in
order, through ``emit(keys, removed, reason)``, one call per batch.
Bookkeeping only: no I/O, no vLLM, no locks (callers are single-threaded,
the scheduler). Every method is O(blocks passed or moved) (times log n for
the victim index), never O(capacity), except ``restore`` and ``clear``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.events import MEDIUM_DISK
from kvtier.tiers.plans import Key
from kvtier.tiers.tier import Tier

# emit(keys, removed, reason): keys became READY here (removed=False) or
# stopped being READY here (removed=True).
Emit = Callable[[Sequence[Key], bool, str], None]

# Reads of one disk block that may fail with an I/O error in a row before
# the block is dropped. A transient error (a link reset, a sector the drive
# reads on a retry) costs one failed load and the block stays; a block that
# can no longer be read (a dead sector) would otherwise cost a failed load,
# and a recompute, to every request that finds it.
MAX_READ_IO_ERRORS = 3


@dataclass
class ReadFailures:
    """What the read-failure rule did on one disk tier, cumulative (the
    metrics diff them). One failed read of a block counts once per load."""

    # Reads that failed with an I/O error; the block stayed.
    io_errors_kept: int = 0
    # Blocks dropped because their bytes failed verification.
    corrupt: int = 0
    # Blocks dropped after MAX_READ_IO_ERRORS I/O errors in a row.
    unreadable: int = 0


class DiskTierCore:
    """Slots, victims, pins and residency events of one disk tier.

    ``tier`` is the underlying :class:`~kvtier.tiers.tier.Tier`, for
    queries (``get``, ``is_ready``, ``in``, ``len``, ``num_free``) and for
    a filter-free victim index; changes go through this class so that every
    one is reported."""

    def __init__(self, capacity: int, policy: Any = "lru", emit: Emit | None = None):
        self.tier = Tier(MEDIUM_DISK, capacity, policy)
        self._emit = emit
        self.failures = ReadFailures()
        # Resident keys whose last reads failed with an I/O error, and how
        # many in a row; an entry leaves with its block or its next good
        # read, so it holds at most the blocks currently failing.
        self._io_errors: dict[Key, int] = {}

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
            self._forget_errors(victims)
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
        self,
        keys: Sequence[Key],
        *,
        corrupt: Collection[Key] = (),
        io_failed: Collection[Key] = (),
        unread: Collection[Key] = (),
    ) -> list[Key]:
        """Unpin the blocks one load pinned (``keys``, as passed to
        ``pin_reads``) and apply the read-failure rule (module doc) to what
        the load found: keys in ``corrupt`` were read and their bytes failed
        verification; keys in ``io_failed`` could not be read (an I/O
        error); keys in ``unread`` were not delivered for a reason that says
        nothing about their copies (not read, or the load raised or was
        given up): they stay as they are. Every other key was read and
        verified. A block is dropped only once no other read pins it.
        Returns the dropped keys, reported as removed (``corrupt``, then
        ``unreadable``). O(len(keys))."""
        tier = self.tier
        get = tier.get  # the dict's own: no Python frame per key
        tier.unpin_many([k for k in keys if get(k) is not None])
        errors = self._io_errors
        if not (corrupt or io_failed or errors):
            return []  # every load's case while no block is failing
        bad = dict.fromkeys(corrupt)  # ordered: the events follow the load
        failing = [k for k in dict.fromkeys(io_failed) if k not in bad]
        if errors:
            done = {*failing, *unread}
            for key in keys:
                if key not in done:
                    errors.pop(key, None)  # read and verified: counts again
        if not bad and not failing:
            return []
        dropped = self._drop([k for k in bad if self._idle(get(k))], "corrupt")
        self.failures.corrupt += len(dropped)
        unreadable = []
        for key in failing:
            block = get(key)
            if block is None:
                continue
            count = errors.get(key, 0) + 1
            if count >= MAX_READ_IO_ERRORS and block.pins == 0:
                unreadable.append(key)
            else:
                errors[key] = count
                self.failures.io_errors_kept += 1
        unreadable = self._drop(unreadable, "unreadable")
        self.failures.unreadable += len(unreadable)
        return dropped + unreadable

    @staticmethod
    def _idle(block: Any) -> bool:
        return block is not None and block.pins == 0

    def _drop(self, keys: list[Key], reason: str) -> list[Key]:
        """Remove resident, unpinned ``keys`` (reported as removed)."""
        if keys:
            self.tier.remove_many(keys, False)
            self._forget_errors(keys)
            self._report(keys, True, reason)
        return keys

    def _forget_errors(self, keys: Iterable[Key]) -> None:
        errors = self._io_errors
        if errors:
            for key in keys:
                errors.pop(key, None)

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
        self._io_errors.clear()
        self._report(ready, True, "reset")
        return ready
