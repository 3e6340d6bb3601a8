"""Loads: where each block of a request is read from, and what a finished
load changes (the copy up of verified disk blocks; what a failed read does
to a disk copy is the disk core's read-failure rule).

:class:`LoadPlanner` is the load half of
:class:`~kvtier.tiers.hierarchy.TierHierarchy`, kept apart because it is one
responsibility; it is given exactly what it reads and changes.
Single-threaded, like the hierarchy; O(keys of the load) per call, plus a
bounded victim scan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from kvtier.tiers.disk_core import DiskTierCore
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK
from kvtier.tiers.plans import BlockLocation, HierarchyStats, Key, LoadPlan
from kvtier.tiers.slots import BlockState
from kvtier.tiers.spilling import SpillQueue
from kvtier.tiers.tier import Tier

# How many eviction candidates a load may inspect to find a CPU row for a
# promotion: a promotion is an extra, so it never pays for a long scan.
PROMOTION_SCAN = 64


class LoadPlanner:
    """``prepare_load`` / ``complete_load`` of one hierarchy.

    ``loads`` holds the loads planned and not completed (load id -> plan).
    ``make_cpu_room(n, limit)`` frees up to ``n`` CPU rows and returns how
    many are free; ``disk_dropped(keys, evicted)`` is called after the disk
    core dropped copies; ``emit(keys, medium, removed, reason)`` records a
    residency event; ``new_job_id()`` numbers the loads. ``spills`` (None
    without a disk tier) is told the CPU blocks a load uses
    (:meth:`~kvtier.tiers.spilling.SpillQueue.touched`)."""

    def __init__(
        self,
        cpu: Tier,
        disk_core: DiskTierCore | None,
        stats: HierarchyStats,
        spills: SpillQueue | None,
        promoted: set[Key],
        *,
        make_cpu_room: Callable[[int, int | None], int],
        disk_dropped: Callable[[Sequence[Key], bool], None],
        emit: Callable[[Sequence[Key], str, bool, str], None],
        new_job_id: Callable[[], int],
        promote_on_hit: bool = True,
    ) -> None:
        self.cpu = cpu
        self.disk_core = disk_core
        self.disk = disk_core.tier if disk_core is not None else None
        self.stats = stats
        self.promote_on_hit = promote_on_hit
        self.loads: dict[int, LoadPlan] = {}
        self._spills = spills
        self._promoted = promoted
        self._make_cpu_room = make_cpu_room
        self._disk_dropped = disk_dropped
        self._emit = emit
        self._new_job_id = new_job_id

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Pin each key where it is ready (CPU preferred) and say where.

        With ``promote_on_hit``, a key read from disk also gets a CPU row to
        be copied into when one is free or a clean block can give its row
        up; the load never waits for one. Raises ``KeyError`` (pinning
        nothing) if a key is not ready anywhere."""
        cpu, disk = self.cpu, self.disk
        ready = BlockState.READY
        cpu_get = cpu.get
        disk_get = disk.get if disk is not None else {}.get
        # One pass sorts the keys by source, in key order; ``wanted``: disk
        # keys with no CPU block at all (one being written already has its
        # row), which may be promoted.
        slots: list[int] = []
        media: list[str] = []
        on_cpu: list[Key] = []
        on_disk: list[Key] = []
        wanted: list[Key] = []
        for key in keys:
            block = cpu_get(key)
            if block is not None and block.state is ready:
                media.append(MEDIUM_CPU)
                on_cpu.append(key)
            else:
                if block is None:
                    wanted.append(key)
                block = disk_get(key)
                if block is None or block.state is not ready:
                    raise KeyError(f"prepare_load of {key!r}, which is not ready")
                media.append(MEDIUM_DISK)
                on_disk.append(key)
            slots.append(block.slot)
        # Pin before making room for promotions: the victims must never
        # include a block this very load reads.
        cpu.pin_many(on_cpu)
        if on_disk:
            disk.pin_many(on_disk)  # type: ignore[union-attr]
        # Rows for promotions, found by a short scan: one per key (its first
        # occurrence), allocated in key order in one batch.
        rows: dict[Key, int] = {}
        if self.promote_on_hit and wanted:
            distinct = list(dict.fromkeys(wanted))
            room = self._make_cpu_room(len(distinct), PROMOTION_SCAN)
            if room:
                order = distinct[:room]
                rows = dict(zip(order, cpu.allocate_many(order, "promote")))
        # tuple.__new__ builds the NamedTuples in C (their __new__ and
        # _make are Python frames).
        rows_pop = rows.pop
        promote_slots = [rows_pop(k, None) for k in keys] if rows else repeat(None)
        locations = list(
            map(
                tuple.__new__,
                repeat(BlockLocation),
                zip(media, slots, promote_slots),
            )
        )
        # Touched tail first: the head ranks newest. The two tiers' policies
        # are independent, so one batch per tier is the same as the
        # interleaved per-key touches.
        cpu.touch_many(on_cpu[::-1])
        if on_disk:
            disk.touch_many(on_disk[::-1])  # type: ignore[union-attr]
        # Only a READY CPU block can be dirty: the keys read from disk are not.
        if self._spills is not None and on_cpu:
            self._spills.touched(on_cpu)
        plan = LoadPlan(self._new_job_id(), list(keys), locations)
        self.loads[plan.load_id] = plan
        return plan

    def complete_load(
        self,
        load_id: int,
        corrupt: Iterable[Key] = (),
        unread: Iterable[Key] = (),
        io_failed: Iterable[Key] = (),
        whole_failed: bool = False,
    ) -> None:
        """Release a load's pins and apply what it found to the disk copies
        (the disk core's read-failure rule). Keys in ``corrupt`` were read
        from disk and their bytes failed verification: the copy is dropped
        once no other load reads it. Keys in ``io_failed`` could not be read
        (an I/O error): the copy stays, counted, unless its reads failed so
        too often in a row. Keys in ``unread`` were not delivered for a
        reason that says nothing about their copy (not read, or the load
        raised or was given up): it stays as it is. None of them is loaded:
        their promotion row is given back unwritten. Other promoted keys
        become ready on CPU. ``whole_failed``: no block of the load landed
        (the job raised or was given up): its CPU-tier blocks are not
        counted as loaded, and every disk key not in ``corrupt`` or
        ``io_failed`` is treated as ``unread``."""
        plan = self.loads.pop(load_id)
        bad = set(corrupt)
        failing = set(io_failed) - bad
        skipped = set(unread)
        if whole_failed:
            skipped.update(
                k for k, loc in zip(plan.keys, plan.locations) if loc.medium != MEDIUM_CPU
            )
        skipped -= bad | failing
        if not bad and not failing and not skipped and not whole_failed:
            self._release(plan)
            return
        stats = self.stats
        promoted: list[Key] = []
        on_cpu: list[Key] = []
        on_disk: list[Key] = []
        unwritten: list[Key] = []  # promotion rows given back
        cpu = self.cpu
        for key, loc in zip(plan.keys, plan.locations):
            if loc.medium == MEDIUM_CPU:
                if cpu.get(key) is not None:
                    on_cpu.append(key)
                if not whole_failed:
                    stats.loads_cpu += 1
                continue
            on_disk.append(key)
            if key in bad or key in failing or key in skipped:
                stats.load_failures += 1
                if loc.promote_slot is not None:
                    unwritten.append(key)
                continue
            stats.loads_disk += 1
            if loc.promote_slot is not None:
                promoted.append(key)
        cpu.unpin_many(on_cpu)
        cpu.remove_many(unwritten, False)
        if self.disk_core is None:
            # A CPU tier alone: every location is a CPU row (a load the
            # worker failed whole names its keys unread; they stay).
            assert not on_disk
        else:
            dropped = self.disk_core.release_reads(
                on_disk,
                corrupt=[k for k in plan.keys if k in bad],
                io_failed=[k for k in plan.keys if k in failing],
                unread=skipped,
            )
            self._disk_dropped(dropped, False)
        if promoted:
            cpu.mark_ready_many(promoted)
            self._promoted.update(promoted)
            stats.promotions_completed += len(promoted)
            self._emit(promoted, MEDIUM_CPU, removed=False, reason="promote")

    def _release(self, plan: LoadPlan) -> None:
        """``complete_load`` of a load that delivered every key: the same
        unpins, counters and promotions as the per-key loop, one batch per
        tier. (Nothing is removed, so no key's state depends on the order
        of the CPU and disk halves.)"""
        cpu, stats = self.cpu, self.stats
        cpu_get = cpu.get
        on_cpu: list[Key] = []
        on_disk: list[Key] = []
        promoted: list[Key] = []
        n_cpu = 0
        for key, loc in zip(plan.keys, plan.locations):
            if loc.medium == MEDIUM_CPU:
                n_cpu += 1
                if cpu_get(key) is not None:
                    on_cpu.append(key)
                continue
            on_disk.append(key)
            if loc.promote_slot is not None:
                promoted.append(key)
        cpu.unpin_many(on_cpu)
        stats.loads_cpu += n_cpu
        if on_disk:
            assert self.disk_core is not None
            self.disk_core.release_reads(on_disk)  # all read and verified
            stats.loads_disk += len(on_disk)
        if promoted:
            # Their disk copies are READY (read by this load, so pinned
            # until just now): the CPU tier's filter accepts them.
            cpu.mark_ready_many(promoted, accepted=True)
            self._promoted.update(promoted)
            stats.promotions_completed += len(promoted)
            self._emit(promoted, MEDIUM_CPU, removed=False, reason="promote")
