"""The cascading hierarchy: a CPU tier over an optional disk tier.

This is the scheduler-side brain of kvtier. It decides where every block
lives and hands out *plans* and *orders* (GPU->CPU stores, CPU->disk spills,
loads from either tier) that the worker side executes asynchronously; it
never performs or waits for I/O itself, so every call here is O(blocks
touched).

The life of a block (store, spill, drop, load from either tier, copy up)
is drawn in docs/architecture.md ("A block's life").

A disk block is loaded straight from its slot: a load never waits for CPU
room. When a CPU row can be had without waiting (a free row or a clean
victim), the load also copies the verified block into it ("promotion"). A
disk block that failed is not promoted (its row is given back), and the
disk core's read-failure rule decides at ``complete_load`` whether its copy
stays (an I/O error) or goes (failed verification, or I/O errors too many
times in a row: a miss next time).

Keys passed together (a request's blocks, in prefix order) are ranked in
*reverse*: a prompt's first block becomes the most recently used, so its
tail is evicted before its head. A tail without its head is unreachable by
prefix lookup; a head without its tail is still a hit.

"Dirty" means the CPU copy is the only copy. Spilling is *write-back ahead
of need*: when more than ``spill_watermark`` of the CPU tier is dirty, the
least valuable dirty blocks are copied to disk while staying readable on
CPU. When a store needs room, clean blocks are dropped from CPU at once
(their disk copy stays), so a GPU->CPU store never waits for the disk. A
dirty victim is never dropped while a disk tier exists: it is spilled first
and its slot reused only after the spill completed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvtier.tiers.disk_core import DiskTierCore
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK, EventLog, TierEvent
from kvtier.tiers.loading import LoadPlanner
from kvtier.tiers.plans import (
    HierarchyStats,
    Key,
    LoadPlan,
    Residency,
    SpillOrder,
    StorePlan,
)
from kvtier.tiers.slots import BlockState
from kvtier.tiers.spilling import SpillQueue
from kvtier.tiers.tier import Tier

READY, WRITING = BlockState.READY, BlockState.WRITING


# ``get`` of a tier that does not exist: always None, at the cost of a C
# call (no Python frame).
_absent = {}.get
_HIT_CPU, _HIT_DISK = Residency.HIT_CPU, Residency.HIT_DISK
_PENDING, _MISS = Residency.PENDING, Residency.MISS


class TierHierarchy:
    """A CPU tier over an optional disk tier, with cascade and promotion.

    Contract (what the property tests check):
      - capacities are never exceeded; a WRITING or pinned block is never
        evicted or overwritten;
      - ``lookup`` reports only READY blocks as hits;
      - every residency change appends exactly one event, in order, and
        replaying all events from an empty state gives the READY keys of
        each tier;
      - with a disk tier, a block leaves the CPU tier only when it is also
        ready on disk, or when the disk refused it (spill failed), or on
        ``reset``;
      - ``prepare_store`` returns ``None`` (declines) when room cannot be
        made without waiting; it never blocks.
    """

    def __init__(
        self,
        cpu_blocks: int,
        disk_blocks: int = 0,
        *,
        cpu_policy: str = "lru",
        disk_policy: str = "lru",
        spill_watermark: float = 0.75,
        spill_batch: int = 64,
        promote_on_hit: bool = True,
        record_events: bool = True,
    ):
        if cpu_blocks <= 0:
            raise ValueError(f"cpu_blocks must be > 0, got {cpu_blocks}")
        if not 0.0 <= spill_watermark <= 1.0:
            raise ValueError(
                f"spill_watermark must be within [0, 1], got {spill_watermark}"
            )
        self.cpu = Tier(MEDIUM_CPU, cpu_blocks, cpu_policy)
        self.spill_watermark = spill_watermark
        self.stats = HierarchyStats()
        self._next_job_id = 1
        # Without a disk tier: no disk core and no write-back of dirty CPU
        # blocks (``_spills``).
        self.disk_core: DiskTierCore | None = None
        self.disk: Tier | None = None
        self._spills: SpillQueue | None = None
        if disk_blocks > 0:
            # The disk tier's placement (slots, victims, pins, events) is the
            # same engine as the tiering-mode disk tier's; ``disk`` is its
            # Tier.
            self.disk_core = DiskTierCore(disk_blocks, disk_policy, self._emit_disk)
            self.disk = self.disk_core.tier
            self._spills = spills = SpillQueue(
                self.cpu,
                self.disk_core,
                self.stats,
                watermark=spill_watermark,
                batch=spill_batch,
                new_job_id=self._new_job_id,
            )
            # Victims of the CPU tier are only blocks it may drop now; the
            # tier indexes them, so a tier full of dirty or in-flight
            # blocks costs nothing to ask. The spill queue refreshes a key
            # whenever what the filter reads changes.
            self.cpu.set_filter(spills.droppable)
        # The tiers' block lookups, bound once for the hottest query.
        self._cpu_get = self.cpu.get
        self._disk_get = self.disk.get if self.disk is not None else _absent
        # Keys whose CPU copy came from disk, so hits keep reporting "disk"
        # as their source until the block is stored again.
        self._promoted: set[Key] = set()
        # Without a consumer (KV events off) nothing drains the events, so
        # none are recorded: an undrained log would grow without bound.
        self._events = EventLog(record_events)
        self._emit = self._events.record
        self._planner = LoadPlanner(
            self.cpu,
            self.disk_core,
            self.stats,
            self._spills,
            self._promoted,
            make_cpu_room=self._make_cpu_room,
            disk_dropped=self._disk_dropped,
            emit=self._emit,
            new_job_id=self._new_job_id,
            promote_on_hit=promote_on_hit,
        )
        # Loads planned and not completed yet: what each pinned where.
        self._loads: dict[int, LoadPlan] = self._planner.loads

    # ------------------------------------------------------------------ lookup

    def lookup(self, key: Key) -> Residency:
        """Hit if READY in some tier (CPU first); PENDING if only being
        written (a store in flight); else MISS."""
        block = self._cpu_get(key)
        if block is not None and block.state is READY:
            return _HIT_CPU
        on_disk = self._disk_get(key)
        if on_disk is not None and on_disk.state is READY:
            return _HIT_DISK
        return _PENDING if block is not None else _MISS

    @property
    def empty(self) -> bool:
        """Whether no tier holds a block, in any state. O(1)."""
        return not self.cpu and (self.disk is None or not self.disk)

    def holds(self, key: Key) -> bool:
        """Whether some tier has ``key``, in any state (a store or a spill in
        flight included). O(1)."""
        return key in self.cpu or (self.disk is not None and key in self.disk)

    def source_of(self, key: Key) -> str:
        """Medium a hit on ``key`` is credited to (disk if its CPU copy was
        promoted from disk)."""
        if self.cpu.is_ready(key):
            return MEDIUM_DISK if key in self._promoted else MEDIUM_CPU
        return MEDIUM_DISK

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark keys used; the first key ends up most recent (prefix order)."""
        order = list(keys)
        if self._spills is not None:
            self._spills.touched(order)
        order.reverse()
        self.cpu.touch_many(order)
        if self.disk is not None:
            self.disk.touch_many(order)

    # -------------------------------------------------------------------- load

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """See :meth:`kvtier.tiers.loading.LoadPlanner.prepare_load`."""
        return self._planner.prepare_load(keys)

    def complete_load(
        self,
        load_id: int,
        corrupt: Iterable[Key] = (),
        unread: Iterable[Key] = (),
        io_failed: Iterable[Key] = (),
        whole_failed: bool = False,
    ) -> None:
        """See :meth:`kvtier.tiers.loading.LoadPlanner.complete_load`."""
        self._planner.complete_load(load_id, corrupt, unread, io_failed, whole_failed)

    # ------------------------------------------------------------------- store

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        """Allocate CPU slots for the keys present in no tier.

        Room is made by dropping clean CPU blocks (still on disk) or, without
        a disk tier, any evictable block. Returns ``None`` when that is not
        enough right now; dirty victims are then queued for spilling so a
        later call succeeds.
        """
        present = set()
        new_keys: list[Key] = []
        cpu = self.cpu
        cpu_get = cpu.get
        disk_get = self._disk_get
        touched: list[Key] = []
        for key in keys:
            if cpu_get(key) is not None or disk_get(key) is not None:
                present.add(key)
                touched.append(key)
            elif key not in present:
                present.add(key)
                new_keys.append(key)
        if touched:
            # Used again, in offer order (the last ends up most recent): one
            # batch per tier equals a touch of each key in turn (the tiers'
            # policies are independent and nothing above read them).
            touched.reverse()
            self.touch(touched)
        if not new_keys:
            return StorePlan([], [], [])

        need = len(new_keys) - cpu.num_free
        evicted: list[Key] = []
        if need > 0:
            # Victims are the eligible (droppable) keys not offered here:
            # counting them says whether room can be made before any is
            # chosen, so a declined store changes nothing.
            available = cpu.num_eligible - cpu.count_eligible(present)
            if available >= need:
                # O(blocks touched): the tier walks only droppable blocks.
                evicted = cpu.evict(need, exclude=present)
                self._dropped_from_cpu(evicted)
            else:
                room = cpu.num_free + available
                if len(new_keys) <= cpu.capacity or room == 0:
                    self._queue_spills(need - available)
                    # All or nothing: dropping some blocks now would lose
                    # them for a store that is declined anyway; vLLM offers
                    # the same keys again on a later step.
                    self.stats.stores_declined += 1
                    return None
                # An offer larger than the whole CPU tier can never be taken
                # at once: store the head that fits now (a head without its
                # tail is still a hit) rather than decline it forever. The
                # victims are chosen before spills are queued (which may
                # make more blocks droppable) and dropped after.
                evicted = cpu.take_victims(need, exclude=present)
                self._queue_spills(need - available)
                self.stats.store_blocks_skipped += len(new_keys) - room
                new_keys = new_keys[:room]
                self._drop_from_cpu(evicted)

        # Allocated tail first: the head of the prefix ranks newest.
        slots = cpu.allocate_many(new_keys[::-1], "store")
        slots.reverse()
        promoted, spills = self._promoted, self._spills
        if promoted:
            promoted.difference_update(new_keys)
        if spills is not None and spills.unspillable:
            spills.unspillable.difference_update(new_keys)
        return StorePlan(new_keys, slots, evicted)

    def complete_store(self, keys: Iterable[Key], success: bool = True) -> None:
        """Make stored keys readable, or forget them if the store failed."""
        # Tail first: with a disk tier, the dirty queue then spills a
        # prompt's tail before its head.
        order = list(keys)
        order.reverse()
        spills = self._spills
        if success and spills is not None:
            # One pass checks, marks and queues each block.
            stored = spills.stored(order)
        else:
            cpu_get = self.cpu.get
            stored = []
            for key in order:
                block = cpu_get(key)
                if (
                    block is not None
                    and block.state is WRITING
                    and block.origin == "store"
                ):
                    stored.append(key)
            if len(set(stored)) != len(stored):
                stored = list(dict.fromkeys(stored))  # a key offered twice
            if not success:
                self.cpu.remove_many(stored, False)
                self.stats.stores_failed += len(stored)
                stored = []
            elif stored:
                self.cpu.mark_ready_many(stored)
        if stored:
            stored.reverse()
            self.stats.stores_completed += len(stored)
            self._emit(stored, MEDIUM_CPU, removed=False, reason="store")
        if spills is not None:
            spills.maybe_spill()

    # ------------------------------------------------------------------- spill

    def spill_everything(self, most: int | None = None) -> None:
        """At shutdown: order spills of every dirty block (at most ``most``),
        as far as the disk has (or can make) room, most recently used first.
        A block only on CPU is lost with the engine, and the spills queued at
        shutdown run for a bounded time: newest first, a prompt's head is
        written before its tail (ranked newer, :meth:`prepare_store`), so
        what does reach the disk is reachable by a prefix lookup after a
        restart, where the oldest-first order of the watermark's spills
        would leave the tails written and their heads lost. ``most`` bounds
        the work, O(blocks ordered), to what the shutdown can write (each
        spill ordered also makes a disk victim)."""
        spills = self._spills
        if spills is not None and spills.dirty:
            n = len(spills.dirty) if most is None else min(most, len(spills.dirty))
            spills.queue(n, newest_first=True)

    def take_spills(self) -> list[SpillOrder]:
        """Spill orders decided since the last call, for the I/O side."""
        return self._spills.take() if self._spills is not None else []

    def complete_spill(
        self,
        job_id: int,
        lost_keys: Iterable[Key] = (),
        cancelled_keys: Iterable[Key] = (),
    ) -> None:
        """A spill job finished; keys in ``lost_keys`` did not reach disk
        (those in ``cancelled_keys`` as the job was cancelled: no failure)."""
        assert self._spills is not None
        self._spills.complete(job_id, lost_keys, cancelled_keys)

    def _queue_spills(self, n: int) -> None:
        if self._spills is not None:
            self._spills.queue(n)

    def _make_cpu_room(self, n: int, limit: int | None = None) -> int:
        """Free CPU rows for up to ``n`` new blocks by dropping droppable
        victims, inspecting at most ``limit`` candidates when given; returns
        how many rows are now free (<= n)."""
        cpu = self.cpu
        need = n - cpu.num_free
        if need > 0:
            self._drop_from_cpu(cpu.victims(need, limit=limit))
        return min(n, cpu.num_free)

    # ----------------------------------------------------------------- restore

    def restore_disk(self, entries: list[tuple[Key, int]]) -> None:
        """Warm restart: adopt blocks found on disk (oldest first)."""
        if self.disk_core is None:
            raise RuntimeError("no disk tier to restore into")
        self.disk_core.restore(entries)
        # What the CPU tier's filter reads (the disk state) changed.
        self.cpu.refresh_many([key for key, _ in entries])

    def reset(self) -> None:
        """Forget every block (vLLM's reset_cache); emits the removals.

        Callers drain in-flight transfers first."""
        cpu_ready = self.cpu.clear()
        if cpu_ready:
            self._emit(cpu_ready, MEDIUM_CPU, removed=True, reason="reset")
        if self.disk_core is not None:
            self.disk_core.clear()  # reported as removed (reset)
        if self._spills is not None:
            self._spills.clear()
        self._promoted.clear()
        self._loads.clear()

    def take_events(
        self, backlog: int | None = None, weights: Mapping[str, int] | None = None
    ) -> list[TierEvent]:
        """Drain the residency events since the last call, in order; with
        ``backlog``, at most that many keys of those left pending by earlier
        calls, a key of a reason in ``weights`` counting as that many (see
        :meth:`EventLog.take`)."""
        return self._events.take(backlog, weights)

    @property
    def has_event_backlog(self) -> bool:
        """Whether a bulk event (a warm restart's, a reset's) still owes
        keys to later :meth:`take_events` calls. O(1)."""
        return self._events.has_backlog

    def owes_events_of(self, reason: str) -> bool:
        """Whether a bulk event of ``reason`` (``restore``, ``reset``) still
        owes keys to later :meth:`take_events` calls."""
        return self._events.owes_reason(reason)

    def event_owed(self, key: Key) -> bool:
        """Whether a bulk event still owes ``key`` an event, which a later
        :meth:`take_events` hands out. O(1)."""
        return self._events.owes(key)

    @property
    def has_pending_io(self) -> bool:
        spills = self._spills
        return spills is not None and bool(spills.jobs or spills.new_orders)

    # ----------------------------------------------------------------- helpers

    def _new_job_id(self) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    def _drop_from_cpu(self, keys: Sequence[Key]) -> None:
        """Evict ``keys`` (evictable CPU blocks) from the CPU tier; one
        event for the batch. O(len(keys))."""
        if keys:
            self.cpu.remove_many(keys, True)
            self._dropped_from_cpu(keys)

    def _dropped_from_cpu(self, keys: Sequence[Key]) -> None:
        """``keys`` were just evicted from the CPU tier: forget them here,
        count them and report them (one event). O(len(keys))."""
        if not keys:
            return
        if self._spills is not None:
            self._spills.forget(keys)
        if self._promoted:
            self._promoted.difference_update(keys)
        self.stats.cpu_evictions += len(keys)
        self._emit(keys, MEDIUM_CPU, removed=True, reason="evict")

    def _disk_dropped(self, keys: Sequence[Key], evicted: bool) -> None:
        """The disk core dropped ``keys``' disk copies: see
        :meth:`SpillQueue.disk_dropped`."""
        if self._spills is not None:
            self._spills.disk_dropped(keys, evicted)

    def _emit_disk(self, keys: Sequence[Key], removed: bool, reason: str) -> None:
        self._events.record(keys, MEDIUM_DISK, removed, reason)
