"""Write-back of dirty CPU blocks to disk: the spill half of the hierarchy.

"Dirty" means the CPU copy is the only copy. :class:`SpillQueue` keeps the
dirty CPU blocks in spill order (oldest use first), turns the excess over
the watermark into :class:`~kvtier.tiers.plans.SpillOrder` s (disk victims
evicted, disk slots allocated, CPU slots pinned for reading), and settles
finished spill jobs. It also owns what decides whether a CPU block may be
dropped (:meth:`droppable`, the CPU tier's victim filter): a block is
droppable when its disk copy is READY or when the disk refused or gave up
its copy (*unspillable*), so it never wedges the CPU tier.

Single-threaded, like the hierarchy that owns it; every call is
O(blocks queued, settled or passed) plus the disk tier's victim choice.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier.tiers.disk_core import DiskTierCore
from kvtier.tiers.plans import HierarchyStats, Key, SpillOrder, TransferItem
from kvtier.tiers.slots import BlockState, TierBlock
from kvtier.tiers.tier import Tier

READY, WRITING = BlockState.READY, BlockState.WRITING


class SpillQueue:
    """Dirty CPU blocks of one hierarchy and the spills in flight.

    ``dirty``: READY CPU keys with no READY/WRITING disk copy and no spill
    in flight, oldest use first. ``unspillable``: CPU keys the disk refused
    (spill failed) or evicted. ``spilling``: key -> job id of the spill in
    flight. Every change to what :meth:`droppable` reads is followed by a
    refresh of that key in the CPU tier's victim index."""

    def __init__(
        self,
        cpu: Tier,
        disk_core: DiskTierCore,
        stats: HierarchyStats,
        *,
        watermark: float,
        batch: int,
        new_job_id: Callable[[], int],
    ) -> None:
        self.cpu = cpu
        self.core = disk_core
        self.disk = disk_core.tier
        self.stats = stats
        self.watermark = watermark
        self.batch = max(1, batch)
        self._new_job_id = new_job_id
        self.dirty: OrderedDict[Key, None] = OrderedDict()
        self.unspillable: set[Key] = set()
        self.spilling: dict[Key, int] = {}
        self.jobs: dict[int, list[Key]] = {}  # job id -> its keys, in order
        self.new_orders: list[SpillOrder] = []

    def droppable(self, key: Key, block: TierBlock) -> bool:
        """May this evictable CPU block leave the CPU tier right now? (The
        CPU tier's filter.)"""
        if key in self.unspillable:
            return True
        on_disk = self.disk.get(key)
        return on_disk is not None and on_disk.state is READY

    def touched(self, keys: Sequence[Key]) -> None:
        """``keys`` were used, in prefix order: the dirty ones move to the
        newest end of the spill order, the first key newest (a prefix's
        head serves every request that shares it, so it spills last).
        O(len(keys))."""
        dirty = self.dirty
        if dirty:
            for key in reversed(keys):
                if key in dirty:
                    dirty.move_to_end(key)

    def stored(self, keys: Iterable[Key]) -> list[Key]:
        """A store of ``keys`` finished: mark those that are WRITING CPU
        blocks of a store READY, dirty unless already on disk, in order (a
        key given twice is marked once: the second time it is READY);
        returns them. Equal to ``cpu.mark_ready_many`` of those keys then
        queueing each as dirty unless it is READY on disk or spilling, minus
        the index work for the keys the filter rejects (a WRITING block was
        never eligible, so only its state changes). O(len(keys))."""
        cpu_get, disk_get = self.cpu.get, self.disk.get
        dirty, spilling, unspillable = self.dirty, self.spilling, self.unspillable
        stored: list[Key] = []
        clean: list[Key] = []
        for key in keys:
            block = cpu_get(key)
            if block is None or block.state is not WRITING or block.origin != "store":
                continue
            stored.append(key)
            block.state = READY
            on_disk = disk_get(key)
            on_disk_ready = on_disk is not None and on_disk.state is READY
            if on_disk_ready or key in unspillable:
                # The filter accepts it: index it (READY already, unpinned
                # as every block being written).
                clean.append(key)
            if not on_disk_ready and key not in spilling:
                dirty[key] = None
        if clean:
            self.cpu.mark_ready_many(clean, accepted=True)
        return stored

    def maybe_spill(self) -> None:
        """Keep at most ``watermark`` of the CPU tier dirty, so at least the
        rest is free or clean and a store finds room without waiting."""
        excess = len(self.dirty) - math.floor(self.watermark * self.cpu.capacity)
        if excess > 0:
            self.queue(excess)

    def queue(self, n: int, newest_first: bool = False) -> None:
        """Order spills of up to ``n`` dirty blocks, oldest use first (or
        ``newest_first``), as far as the disk has (or can make) room."""
        dirty, core, disk = self.dirty, self.core, self.disk
        # No more than the disk can take now (its free slots and its
        # victims): the rest would be listed only to be left dirty, and a
        # disk full of spills in flight would have every step walk the
        # whole excess over the watermark (a slow disk behind a large CPU
        # tier: O(CPU tier) per step).
        n = min(n, disk.num_free + disk.num_eligible)
        if n <= 0:
            return
        candidates = list(
            itertools.islice(reversed(dirty) if newest_first else dirty, n)
        )
        # One victim choice for the whole batch: per-key choices would pay
        # for the same pinned prefix again and again.
        self.disk_dropped(core.make_room(len(candidates)), evicted=True)
        spilled = candidates[: self.disk.num_free]
        if not spilled:
            return
        disk_slots = core.allocate(spilled)
        # The spills read these CPU slots (READY: dirty blocks are).
        cpu_slots = self.cpu.pin_many(spilled)
        # The spilled keys are the oldest dirty ones (or the newest).
        for key in spilled:
            del dirty[key]
        # tuple.__new__ builds the NamedTuples in C (their __new__ and
        # _make are Python frames).
        items = list(
            map(
                tuple.__new__,
                itertools.repeat(TransferItem),
                zip(spilled, cpu_slots, disk_slots),
            )
        )
        spilling, batch, jobs = self.spilling, self.batch, self.jobs
        for i in range(0, len(items), batch):
            job_id = self._new_job_id()
            jobs[job_id] = keys = spilled[i : i + batch]
            spilling.update(dict.fromkeys(keys, job_id))
            self.new_orders.append(SpillOrder(job_id, tuple(items[i : i + batch])))
        self.stats.spills_started += len(items)

    def take(self) -> list[SpillOrder]:
        """Spill orders decided since the last call."""
        self.maybe_spill()
        orders, self.new_orders = self.new_orders, []
        return orders

    def complete(
        self,
        job_id: int,
        lost_keys: Iterable[Key] = (),
        cancelled_keys: Iterable[Key] = (),
    ) -> None:
        """A spill job finished; keys in ``lost_keys`` did not reach disk,
        those of them in ``cancelled_keys`` because the job was cancelled
        before they were written (a reset), not counted as failures."""
        keys = self.jobs.pop(job_id)
        failed = set(lost_keys)
        cpu, core, spilling_pop = self.cpu, self.core, self.spilling.pop
        # One pass: out of flight, and those still on CPU (all of them
        # unless a reset came in between).
        cpu_get = cpu.get
        on_cpu: list[Key] = []
        for key in keys:
            spilling_pop(key, None)
            if cpu_get(key) is not None:
                on_cpu.append(key)
        done = [k for k in keys if k not in failed] if failed else keys
        if failed:
            lost = [k for k in keys if k in failed]
            core.fail(lost)
            cancelled = failed.intersection(cancelled_keys)
            self.stats.spill_failures += len(lost) - len(cancelled)
            for key in lost:
                if cpu.is_ready(key):
                    # Let the tier drop it later instead of retrying.
                    self.unspillable.add(key)
        core.complete(done)  # reported as stored on disk (spill)
        # Unpinned after the disk side changed, so that each block is now
        # droppable: READY on disk, or unspillable (a failed one still on
        # CPU is READY there, as it was pinned). The filter is not asked.
        cpu.unpin_many(on_cpu, accepted=True)
        self.stats.spills_completed += len(done)

    def disk_dropped(self, keys: Sequence[Key], evicted: bool) -> None:
        """The disk core dropped ``keys``' disk copies (``evicted``: the disk
        chose them as victims; else a load found them corrupt or
        unreadable): update the CPU side. O(len(keys))."""
        if not keys:
            return
        cpu = self.cpu
        cpu_get = cpu.get
        if evicted:
            # The disk judged these blocks its least valuable: respilling
            # one would evict a better one. A READY CPU copy may now be
            # dropped like a clean block (unspillable: the filter accepts
            # it), and stays out of the spill queue, where it would hold a
            # stale position.
            unspillable = self.unspillable
            on_cpu: list[Key] = []
            for key in keys:
                block = cpu_get(key)
                if block is not None:
                    on_cpu.append(key)
                    if block.state is READY:
                        unspillable.add(key)
            cpu.refresh_many(on_cpu, accepted=True)
            self.stats.disk_evictions += len(keys)
            return
        # Their disk copies are gone: a READY CPU copy is the only copy
        # again (dirty), unless a spill of it is in flight.
        refresh, dirty, spilling = cpu.refresh, self.dirty, self.spilling
        for key in keys:
            block = cpu_get(key)
            if block is None:
                continue
            if block.state is READY and key not in spilling:
                dirty[key] = None
            refresh(key)

    def forget(self, keys: Sequence[Key]) -> None:
        """``keys`` left the CPU tier."""
        dirty, unspillable = self.dirty, self.unspillable
        for key in keys:
            dirty.pop(key, None)
        if unspillable:
            unspillable.difference_update(keys)

    def clear(self) -> None:
        self.dirty.clear()
        self.unspillable.clear()
        self.spilling.clear()
        self.jobs.clear()
        self.new_orders.clear()
