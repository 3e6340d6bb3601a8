"""Scheduler-side adapter: vLLM's OffloadingManager over a TierHierarchy.

Disk hits reach the GPU through the CPU tier: ``lookup`` of a disk-only
block starts an asynchronous, checksum-verified promotion into a CPU row
and answers HIT_PENDING until it lands (vLLM re-asks on a later step).
vLLM's connector treats a failed GPU load as fatal, so a block must be
proven intact *before* a load is planned; a failed promotion turns into a
clean MISS and the tokens are recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

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
from kvtier.connector.disk_runtime import SPILL, DiskRuntime
from kvtier.connector.specs import CpuTierSpec
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK
from kvtier.tiers.hierarchy import HierarchyStats, Residency, TierHierarchy

logger = logging.getLogger("kvtier.connector")

# A request whose disk hits cannot get CPU room for this long stops waiting
# and recomputes (a guard against a CPU tier wedged by other requests' pins).
# Wall-clock, not a count: vLLM re-asks on every engine step, and idle steps
# take microseconds.
PROMOTION_WAIT_S = 5.0


class _RetryBudget:
    def __init__(self) -> None:
        self.deadline = time.monotonic() + PROMOTION_WAIT_S


class _Reservations:
    """Promoted blocks pinned for one request until it loads them."""

    def __init__(self) -> None:
        self.keys: set[OffloadKey] = set()


def _state(req_context: ReqContext, cls: type):
    state = req_context.get_state(cls)
    if state is None:
        state = cls()
        req_context.set_state(state)
    return state


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
        promote_on_hit: bool = True,
    ):
        self.hierarchy = hierarchy
        self.runtime = runtime
        self.block_bytes = block_bytes
        self.world_size = world_size
        self.enable_events = enable_events
        self.promote_on_hit = promote_on_hit
        self._last_stats = HierarchyStats()
        self._last_disk_totals = (0, 0.0, 0, 0.0)
        self._last_checks = (0, 0)

    # ------------------------------------------------------------- plumbing

    def _pump(self) -> None:
        """Apply finished disk jobs, then hand new orders to the disk pool.

        Non-blocking: polling reads completion queues, submitting enqueues."""
        runtime = self.runtime
        if runtime is None:
            return
        h = self.hierarchy
        for job in runtime.poll():
            if job.kind == SPILL:
                h.complete_spill(job.job_id, job.failed_keys)
            else:
                h.complete_promotion(job.job_id, job.failed_keys)
        for order in h.take_spills():
            runtime.submit_spill(order)
        for order in h.take_promotions():
            runtime.submit_promote(order)

    # ------------------------------------------------------------- contract

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        h = self.hierarchy
        residency = h.lookup(key)
        if residency is Residency.HIT_CPU:
            return LookupResult.HIT
        if residency is Residency.PENDING:
            return LookupResult.HIT_PENDING
        if residency is Residency.MISS:
            return LookupResult.MISS
        # On disk only: it must be promoted (and verified) before loading.
        # Lookups only queue promotions; the step's end submits them as one
        # batch (on_schedule_end), keeping lookup O(1) and free of I/O calls.
        if h.is_promoting(key):
            return LookupResult.HIT_PENDING
        if h.request_promotion((key,), reserve=True):
            # Pinned for this request: a neighbour's promotion cannot evict
            # it before the load that it was promoted for.
            _state(req_context, _Reservations).keys.add(key)
            return LookupResult.HIT_PENDING
        budget = _state(req_context, _RetryBudget)
        if time.monotonic() < budget.deadline:
            return LookupResult.RETRY
        return LookupResult.MISS

    def get_load_source(
        self, key: OffloadKey, req_context: ReqContext
    ) -> CacheHitSource:
        if self.hierarchy.source_of(key) == MEDIUM_DISK:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec:
        plan = self.hierarchy.prepare_load(list(keys))
        if any(loc.medium != MEDIUM_CPU for loc in plan.locations):
            # lookup only answers HIT for CPU-resident blocks, so this is a
            # contract breach by the caller; refuse rather than load garbage.
            self.hierarchy.complete_load(plan.keys)
            raise RuntimeError("kvtier: prepare_load of a block not in the CPU tier")
        self._release(req_context, plan.keys)  # the load's own pins hold them now
        return CpuTierSpec([loc.slot for loc in plan.locations])

    def _release(self, req_context: ReqContext, keys: Iterable[OffloadKey]) -> None:
        reservations = req_context.get_state(_Reservations)
        if reservations is None or not reservations.keys:
            return
        for key in keys:
            if key in reservations.keys:
                reservations.keys.discard(key)
                self.hierarchy.release(key)

    def on_request_finished(self, req_context: ReqContext) -> None:
        reservations = req_context.get_state(_Reservations)
        if reservations is not None:
            self._release(req_context, list(reservations.keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.hierarchy.touch(keys)

    def complete_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> None:
        self.hierarchy.complete_load(keys)
        if not self.promote_on_hit:
            for key in keys:
                self.hierarchy.drop_promoted_copy(key)

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

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        self.hierarchy.complete_store(keys, success)
        self._pump()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._pump()

    def has_pending_work(self) -> bool:
        return self.runtime is not None and (
            self.hierarchy.has_pending_io or self.runtime.pending > 0
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.hierarchy.take_events()
        if not self.enable_events:
            return
        for ev in events:
            if ev.medium == MEDIUM_CPU:
                yield OffloadingEvent(
                    keys=list(ev.keys), medium=Medium.CPU, removed=ev.removed
                )
            else:
                yield OffloadingEvent(
                    keys=list(ev.keys),
                    medium=Medium.STORAGE,
                    removed=ev.removed,
                    locality=Locality.LOCAL,
                )

    def reset_cache(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()
            self._pump()
            self.runtime.drain()
            self.runtime.poll()
        self.hierarchy.reset()

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()
            self.runtime.close()
            self.runtime = None

    # --------------------------------------------------------------- stats

    def get_stats(self) -> OffloadingConnectorStats | None:
        h = self.hierarchy
        stats = OffloadingConnectorStats()
        tiers = [(MEDIUM_CPU, h.cpu)] + ([(MEDIUM_DISK, h.disk)] if h.disk else [])
        for name, tier in tiers:
            stats.set_gauge(m.TIER_BLOCKS, len(tier), (name,))
            stats.set_gauge(m.TIER_CAPACITY, tier.capacity, (name,))
            stats.set_gauge(m.TIER_USAGE, len(tier) / tier.capacity, (name,))

        now, last = h.stats, self._last_stats
        self._last_stats = HierarchyStats(**vars(now))
        bytes_per_block = self.block_bytes * self.world_size

        def counter(
            name: str, delta: int | float, labels: tuple[str, ...] = ()
        ) -> None:
            if delta:
                stats.increase_counter(name, delta, labels)

        counter(
            m.WRITE_BYTES,
            (now.stores_completed - last.stores_completed) * bytes_per_block,
            ("cpu",),
        )
        loads = (now.loads_cpu - last.loads_cpu) + (now.loads_disk - last.loads_disk)
        counter(m.READ_BYTES, loads * bytes_per_block, ("cpu",))
        counter(m.EVICTIONS, now.cpu_evictions - last.cpu_evictions, ("cpu",))
        counter(m.EVICTIONS, now.disk_evictions - last.disk_evictions, ("disk",))
        counter(m.SPILLS, now.spills_completed - last.spills_completed)
        counter(m.SPILL_FAILURES, now.spill_failures - last.spill_failures)
        counter(m.PROMOTIONS, now.promotions_completed - last.promotions_completed)
        counter(m.PROMOTION_FAILURES, now.promotion_failures - last.promotion_failures)
        counter(m.STORES_DECLINED, now.stores_declined - last.stores_declined)
        if self.runtime is not None:
            t = self.runtime.totals
            wb, ws, rb, rs = self._last_disk_totals
            self._last_disk_totals = (
                t.write_bytes,
                t.write_seconds,
                t.read_bytes,
                t.read_seconds,
            )
            counter(m.WRITE_BYTES, t.write_bytes - wb, ("disk",))
            counter(m.WRITE_SECONDS, t.write_seconds - ws, ("disk",))
            counter(m.READ_BYTES, t.read_bytes - rb, ("disk",))
            counter(m.READ_SECONDS, t.read_seconds - rs, ("disk",))
            checks = (self.runtime.checksum_failures(), self.runtime.io_errors())
            counter(m.CHECKSUM_FAILURES, checks[0] - self._last_checks[0])
            counter(m.IO_ERRORS, checks[1] - self._last_checks[1])
            self._last_checks = checks
        return stats
