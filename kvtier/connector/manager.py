"""Scheduler-side adapter: vLLM's OffloadingManager over a TierHierarchy.

A block that is ready on disk is a hit like a CPU-resident one: ``lookup``
answers HIT, and ``prepare_load`` returns a :class:`TierLoadSpec` that names
each block's CPU row or disk slot. The worker reads and verifies the disk
slots itself (see ``kvtier.connector.worker.worker``); a block that fails comes
back through kvtier's connector (``note_worker_report``) and, when its load
completes, the disk tier's read-failure rule decides whether its copy goes
(failed verification) or stays (an I/O error), while vLLM recomputes its
tokens.
Nothing here waits for I/O: spills run on the disk runtime's threads and
are pumped from the scheduler's calls.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector import metrics as m
from kvtier.connector.load_store_specs import CpuTierSpec, TierLoadSpec
from kvtier.connector.worker_report import CounterDeltas, WorkerCounters, WorkerReport
from kvtier.log import get_logger
from kvtier.store.runtime import SHUTDOWN_SPILL_BLOCKS, DiskRuntime
from kvtier.tiers.disk_core import MAX_READ_IO_ERRORS
from kvtier.tiers.events import (
    BULK_REASONS,
    EVENT_BACKLOG_PER_STEP,
    MEDIUM_CPU,
    MEDIUM_DISK,
)
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency, SpillOrder
from kvtier.tiers.slots import BlockState

logger = get_logger("connector")

_CPU, _DISK = (MEDIUM_CPU,), (MEDIUM_DISK,)  # the metrics' tier label

# ``ownership`` of the full spec's disk events (tiering mode's tier uses its
# tier type, ``KvtierDiskTier``): tells a router which STORAGE tier it is.
DISK_OWNERSHIP = "kvtier"


@dataclass
class BulkEvent(OffloadingEvent):
    """An ``OffloadingEvent`` of a bulk event (``BULK_REASONS``: a warm
    restart's adopted blocks, a reset's removals), which goes out over the
    steps after it, as a bounded backlog.

    vLLM's event tracker drops every payload at a reset, so where a reset
    came since, the connector translates these, which it owes from before
    the reset, with the payloads the tracker held then
    (:meth:`TieredOffloadingConnector.reset_cache`), every other event
    with the tracker's own."""


class _LoadInFlight:
    """The hierarchy's id of a request's load (vLLM runs one at a time)."""

    def __init__(self, load_id: int) -> None:
        self.load_id = load_id


class _LoadFailed:
    """Marks a request whose load failed, in part or whole: its lookups
    miss from then on, so vLLM recomputes it rather than loading again.

    Why not load again: vLLM (0.32, 0.33) keeps a request whose
    asynchronous load failed with no valid token left in its set of
    in-flight prefills, so a second asynchronous load of that request
    reserves its blocks twice (``_inflight_prefill_reserved_blocks``); a
    prompt needing more than half the free KV cache is then never admitted
    and the engine spins on it for ever. A sync admission reserves nothing
    and clears that entry when its prefill ends. And a drive that just
    failed this request would likely fail it again."""


class TieredOffloadingManager(OffloadingManager):
    """vLLM's manager contract, answered by kvtier's cascading hierarchy."""

    def __init__(
        self,
        hierarchy: TierHierarchy,
        runtime: DiskRuntime | None,
        *,
        block_bytes: int,
        world_size: int = 1,
        enable_events: bool = False,
    ):
        self.hierarchy = hierarchy
        self.runtime = runtime
        self.block_bytes = block_bytes
        self.world_size = world_size
        self.enable_events = enable_events
        self._deltas = CounterDeltas()  # metric totals -> counter increases
        # Disk blocks the workers could not load, per request, until that
        # request's load completes.
        self._corrupt_loads: dict[str, set[bytes]] = {}
        self._io_failed_loads: dict[str, set[bytes]] = {}
        self._io_failed_logged = False
        self._unread_loads: dict[str, set[bytes]] = {}
        # Requests whose load a worker failed whole (none of its blocks
        # landed), until that load completes.
        self._failed_whole: set[str] = set()
        # Requests with a load prepared and not completed: a report for any
        # other (a job from before reset_cache, which vLLM never completes)
        # must not reach a later load of the same request.
        self._loading: set[str] = set()
        # Requests whose load failed, since the connector last took them
        # (take_failed_loads).
        self._failed_load_reqs: list[str] = []
        # CPU rows of stores a worker reported failed, until their store
        # completes (vLLM completes it as a success: complete_store).
        self._failed_store_rows: set[int] = set()
        # With ``collect_left_keys`` (the connector sets it where vLLM keeps
        # self-describing event payloads): the keys of removals and failed
        # stores since take_keys_gone last took them.
        self.collect_left_keys = False
        self._left_keys: list[OffloadKey] = []
        # Block hashes the KV events of a reset's removal of one key name
        # (the connector sets it: vLLM's self-describing events name every
        # GPU block of a chunk, one at a time). A step's share of a reset's
        # removals is EVENT_BACKLOG_PER_STEP hashes, not keys.
        self.reset_removal_hashes = 1
        # What the workers reported of their disk reads and contained
        # exceptions, cumulative, and their read batches' latencies not
        # collected yet.
        self.worker_totals = WorkerCounters()
        self.read_latencies = m.Samples()

    # ------------------------------------------------------------- plumbing

    def _pump(self) -> None:
        """Apply finished disk jobs, then hand new orders to the disk pool.

        Non-blocking: polling reads completion queues, submitting enqueues."""
        runtime = self.runtime
        if runtime is None:
            return
        self._apply_finished_spills(runtime)
        for order in self.hierarchy.take_spills():
            runtime.submit_spill(order)

    def _apply_finished_spills(self, runtime: DiskRuntime) -> None:
        """Settle the spill jobs that finished (counted in ``spills`` as
        their bytes are in ``write_bytes``)."""
        h = self.hierarchy
        for job in runtime.poll():
            assert job.spill
            h.complete_spill(job.job_id, job.lost_keys, job.cancelled_keys)

    # ------------------------------------------------------------- contract

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if req_context.get_state(_LoadFailed) is not None:
            return LookupResult.MISS
        residency = self.hierarchy.lookup(key)
        if residency.is_hit:
            # Ready on CPU or on disk: the worker reads either directly.
            return LookupResult.HIT
        if residency is Residency.PENDING:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    @override
    def get_load_source(
        self, key: OffloadKey, req_context: ReqContext
    ) -> CacheHitSource:
        if self.hierarchy.source_of(key) == MEDIUM_DISK:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    @override
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec:
        keys = list(keys)
        plan = self.hierarchy.prepare_load(keys)
        req_context.set_state(_LoadInFlight(plan.load_id))
        self._loading.add(req_context.req_id)
        return TierLoadSpec(keys, plan.locations)

    def note_worker_report(self, report: WorkerReport) -> None:
        """Apply what the workers said since the last call: per request, the
        disk blocks its load could not use (shown bad: dropped when the load
        completes), those whose read failed with an I/O error (kept,
        counted) and those it did not deliver for another reason (kept);
        the requests whose load failed whole (no block of it counts as
        loaded); the CPU rows of stores that failed (their keys are completed as
        failed, see ``complete_store``); and their counters."""
        for reported, pending in (
            (report.corrupt_keys, self._corrupt_loads),
            (report.io_failed_keys, self._io_failed_loads),
            (report.unread_keys, self._unread_loads),
        ):
            for req_id, keys in reported.items():
                if req_id in self._loading:
                    pending.setdefault(req_id, set()).update(keys)
        self._failed_whole.update(r for r in report.failed_loads if r in self._loading)
        self._failed_store_rows.update(report.failed_store_rows)
        self.worker_totals = self.worker_totals + report.counters
        self.read_latencies.extend(report.read_latencies)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        return

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.hierarchy.touch(keys)

    @override
    def complete_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> None:
        load = req_context.get_state(_LoadInFlight)
        if load is None or load.load_id < 0:
            raise RuntimeError("kvtier: complete_load without prepare_load")
        req_context.set_state(_LoadInFlight(-1))
        self._loading.discard(req_context.req_id)
        req_id = req_context.req_id
        corrupt = self._corrupt_loads.pop(req_id, ())
        io_failed = self._io_failed_loads.pop(req_id, ())
        if corrupt:
            logger.warning(
                "kvtier: %d disk block(s) of request %s failed verification; "
                "dropped from the disk tier, their tokens are recomputed",
                len(corrupt),
                req_id,
            )
        if io_failed:
            # A failing drive fails request after request: the I/O errors
            # are logged (errno, slab) by the workers; this says once what
            # it does to the blocks.
            first, self._io_failed_logged = not self._io_failed_logged, True
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "kvtier: %d disk block(s) of request %s could not be read (I/O "
                "error); their tokens are recomputed, the blocks stay on disk "
                "unless their reads failed %d times in a row%s",
                len(io_failed),
                req_id,
                MAX_READ_IO_ERRORS,
                "; repeats logged at debug" if first else "",
            )
        unread = self._unread_loads.pop(req_id, ())
        whole = req_id in self._failed_whole
        self._failed_whole.discard(req_id)
        if corrupt or io_failed or unread or whole:
            req_context.set_state(_LoadFailed())
            self._failed_load_reqs.append(req_id)
        self.hierarchy.complete_load(
            load.load_id,
            corrupt,
            unread=unread,
            io_failed=io_failed,
            whole_failed=whole,
        )

    def take_failed_loads(self) -> list[str]:
        """The requests whose load failed since the last call (their stores
        restart: ``TieredOffloadingConnector``)."""
        out, self._failed_load_reqs = self._failed_load_reqs, []
        return out

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.hierarchy.prepare_store(list(keys))
        self._pump()
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=plan.keys_to_store,
            store_spec=CpuTierSpec(plan.cpu_slots),
            evicted_keys=plan.evicted_keys,
        )

    @override
    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        """Make the stored keys readable, except where the store failed: vLLM
        says so with ``success`` (it never does, 0.32 - 0.33), a worker by
        naming the key's CPU row in ``note_worker_report``."""
        keys = list(keys)
        failed = self._failed_stores(keys) if self._failed_store_rows else []
        if failed:
            self.hierarchy.complete_store(failed, success=False)
            if self.collect_left_keys:
                self._left_keys.extend(failed)
            bad = set(failed)
            keys = [k for k in keys if k not in bad]
        self.hierarchy.complete_store(keys, success)
        self._pump()

    def _failed_stores(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The keys being stored into a row a worker reported failed."""
        failed = []
        for key in keys:
            block = self.hierarchy.cpu.get(key)
            if (
                block is not None
                and block.state is BlockState.WRITING
                and block.origin == "store"
                and block.slot in self._failed_store_rows
            ):
                self._failed_store_rows.discard(block.slot)
                failed.append(key)
        return failed

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._pump()

    @override
    def has_pending_work(self) -> bool:
        return self.runtime is not None and (
            self.hierarchy.has_pending_io or self.runtime.pending > 0
        )

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        # vLLM drains this once per engine step and translates every key in
        # the step: a warm restart's one event naming every adopted block
        # goes out over several steps instead.
        events = self.hierarchy.take_events(
            EVENT_BACKLOG_PER_STEP, {"reset": self.reset_removal_hashes}
        )
        if not self.enable_events:
            return
        for ev in events:
            if ev.removed and self.collect_left_keys:
                self._left_keys.extend(ev.keys)
            event = BulkEvent if ev.reason in BULK_REASONS else OffloadingEvent
            if ev.medium == MEDIUM_CPU:
                yield event(
                    keys=list(ev.keys),
                    medium=Medium.CPU,
                    removed=ev.removed,
                    # Every CPU block leaves with a BlockRemoved too (a
                    # reset's included): vLLM counts the new copy of a key
                    # whose old one left in the same step, and keeps its
                    # payload (kvtier.connector.kv_events).
                    removal_expected=True,
                )
            else:
                yield event(
                    keys=list(ev.keys),
                    medium=Medium.STORAGE,
                    removed=ev.removed,
                    locality=Locality.LOCAL,
                    # Every disk block leaves with a BlockRemoved: vLLM keeps
                    # its self-describing payload (all block hashes, tokens)
                    # until then, so a router can map the removal back.
                    ownership=DISK_OWNERSHIP,
                    removal_expected=True,
                )

    def take_keys_gone(self) -> list[OffloadKey]:
        """The keys that left every tier since the last call: removed from
        the last tier holding them, or their store failed (dropped without
        an event). vLLM's self-describing event tracker keeps a key's
        payload until a removal clears the last residency it saw, and it
        records a CPU residency for every hit its lookup sees (a disk-only
        hit included) and for every store it builds (a failed one
        included): the connector drops these keys' payloads
        (:meth:`TieredOffloadingConnector.take_events`). O(keys removed)."""
        holds = self.hierarchy.holds
        gone = [key for key in self._left_keys if not holds(key)]
        self._left_keys = []
        return gone

    @override
    def reset_cache(self) -> None:
        if self.runtime is not None:
            # The reset forgets every block, so a spill not started yet
            # would write the drive for nothing: cancelled, it fails without
            # I/O, and the drain waits only for the batches being written.
            # Waiting for the whole queue held the engine for as long as the
            # drive took to write it (up to a CPU tier's worth on a slow
            # disk), and past the drain's bound the disk tier stopped for
            # good. Then settle every spill in flight, and order no new one
            # (its result, dropped, would count in write_bytes but not in
            # spills).
            self.runtime.cancel_queued()
            self.runtime.drain()
            self._apply_finished_spills(self.runtime)
            # The blocks computed from now on may come from other weights
            # (a sleep, a weight update): no later engine adopts them.
            self.runtime.mark_reset()
        self.hierarchy.reset()
        self._corrupt_loads.clear()
        self._io_failed_loads.clear()
        self._unread_loads.clear()
        self._failed_whole.clear()
        self._loading.clear()  # vLLM completes no load from before the reset
        self._failed_load_reqs.clear()
        self._left_keys.clear()
        # A report arriving after this (a job vLLM no longer completes) can
        # only fail a later store into the same row: a miss, never data.
        self._failed_store_rows.clear()

    @override
    def shutdown(self) -> None:
        """Spill every block only the CPU tier holds, newest first, at most
        ``SHUTDOWN_SPILL_BLOCKS``
        (:meth:`~kvtier.tiers.hierarchy.TierHierarchy.spill_everything`),
        behind the spills queued; the runtime writes them for a bounded
        time (``SHUTDOWN_SPILL_S``) and cancels the rest. Not after a
        connector reset: what is stored since is written flagged, never
        adopted by a restart, into slots the reset freed in the index
        whose blocks from before it a restart would adopt."""
        runtime, self.runtime = self.runtime, None
        if runtime is None:
            return
        spills: list[SpillOrder] = []
        try:
            self._apply_finished_spills(runtime)
            if not any(store.after_reset for store in runtime.stores):
                self.hierarchy.spill_everything(SHUTDOWN_SPILL_BLOCKS)
                spills = self.hierarchy.take_spills()
        except Exception:  # a bug here must not keep the stores open
            logger.exception("kvtier: the shutdown's spills could not be ordered")
        finally:
            runtime.shutdown(spills)

    # --------------------------------------------------------------- stats

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        h = self.hierarchy
        stats = OffloadingConnectorStats()
        m.report_occupancy(stats, h.cpu, MEDIUM_CPU)
        if h.disk is not None:  # an empty Tier is falsy (len 0)
            m.report_occupancy(stats, h.disk, MEDIUM_DISK)

        now = h.stats
        bytes_per_block = self.block_bytes * self.world_size
        w = self.worker_totals
        checksum_failures, io_errors = w.checksum_failures, w.io_errors
        totals: list[tuple[str, tuple[str, ...], float]] = [
            (m.WRITE_BYTES, _CPU, now.stores_completed * bytes_per_block),
            (m.READ_BYTES, _CPU, now.loads_cpu * bytes_per_block),
            (m.EVICTIONS, _CPU, now.cpu_evictions),
            (m.LOADED_BLOCKS, _CPU, now.loads_cpu),
            (m.STORES_DECLINED, (), now.stores_declined),
            (m.WORKER_EXCEPTIONS, (), w.exceptions),
        ]
        if h.disk_core is not None:
            totals += [
                (m.EVICTIONS, _DISK, now.disk_evictions),
                (m.SPILLS, (), now.spills_completed),
                (m.SPILL_FAILURES, (), now.spill_failures),
                (m.PROMOTIONS, (), now.promotions_completed),
                (m.LOADED_BLOCKS, _DISK, now.loads_disk),
                (m.LOAD_ERRORS, (), now.load_failures),
                *m.read_failure_totals(h.disk_core.failures),
                (m.READ_BYTES, _DISK, w.read_bytes),
                (m.READ_SECONDS, _DISK, w.read_seconds),
            ]
        if self.runtime is not None:
            stats.set_gauge(m.DISK_STALLED, self.runtime.stalled_s(), ())
            t = self.runtime.totals
            totals.append((m.WRITE_BYTES, _DISK, t.write_bytes))
            totals.append((m.WRITE_SECONDS, _DISK, t.write_seconds))
            checksum_failures += self.runtime.checksum_failures()
            io_errors += self.runtime.io_errors()
        if h.disk_core is not None:
            totals.append((m.CHECKSUM_FAILURES, (), checksum_failures))
            totals.append((m.IO_ERRORS, (), io_errors))
        m.report_counters(stats, self._deltas, totals)
        self.read_latencies.observe(stats, m.READ_LATENCY)
        return stats
