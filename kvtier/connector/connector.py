"""``TieredOffloadingConnector``: vLLM's OffloadingConnector, with load errors.

vLLM 0.32's offloading worker asserts that every transfer succeeded. A disk
block can fail verification (torn write, bit rot, another key's slot, EIO),
so kvtier ships this subclass, which reports such a block through vLLM's
standard load-error path instead:

- models with one KV-cache group: block level
  (``get_block_ids_with_load_errors``), so vLLM keeps the valid prefix and
  recomputes from the first failed block;
- models with several groups (vLLM 0.32 and 0.33 raise on block-level
  errors there): request level (``failed_recving``), so the request is
  recomputed;
- synchronous loads (vLLM >= 0.33, ``sync_load_budget_bytes``): block level
  always, as their request already runs in the step the load feeds;
  ``kvtier.connector.compat`` refuses them where that cannot work (a disk
  tier on a model with several groups).

Either way vLLM needs ``kv_load_failure_policy: "recompute"`` (its default
``fail`` would fail the request instead); the connector refuses to start
without it when a disk tier is configured. The failed keys travel back to
the scheduler in the worker metadata, where the manager applies the disk
tier's read-failure rule when the load completes: a corrupt copy is dropped,
one whose read failed with an I/O error stays (until its reads fail too
often in a row).

A store can fail too, though only by an exception the worker contained (a
bug): vLLM (0.32, 0.33) neither carries a store's failure to the scheduler
nor calls ``complete_store(success=False)``, so the failed job's CPU rows
travel in the worker metadata as well, and kvtier's manager completes those
keys as failed (``note_worker_report``): the blocks are not offloaded, and
never read unwritten. Enable with::

    {"kv_connector": "TieredOffloadingConnector",
     "kv_connector_module_path": "kvtier.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
                                   "spec_module_path": "kvtier.connector", ...}}
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import OffloadingEvent, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier.connector.config import (
    CONNECTOR_HINT,
    TransferConfigError,
    check_kvtier_keys_are_read,
)
from kvtier.connector.identity import HASH_FIX, LORA_ON_DISK, prefix_hash_problem
from kvtier.connector.kv_events import (
    KvtierEventsTracker,
    keep_secondary_payloads,
    translate_after_reset,
)
from kvtier.connector.manager import TieredOffloadingManager
from kvtier.connector.spec import ConnectorFacts, TieredOffloadingSpec
from kvtier.connector.worker_report import CounterDeltas, WorkerReport
from kvtier.log import get_logger
from kvtier.store.runtime import SHUTDOWN_SPILL_S

logger = get_logger("connector")

# Said at start by a disk tier under vLLM's default shutdown_timeout (0):
# vllm serve's process manager then kills the engine core at SIGTERM
# without waiting, before kvtier writes the blocks only its CPU tier holds.
SHUTDOWN_TIMEOUT_ZERO = (
    "vLLM's shutdown_timeout is 0 (vllm serve --shutdown-timeout, default 0): "
    "at SIGTERM vllm serve kills the engine core at once, so the blocks only "
    "the CPU tier holds are not written to disk and a warm restart finds "
    "fewer of them; --shutdown-timeout 10 lets the engine drain its requests "
    f"and kvtier write them for up to {SHUTDOWN_SPILL_S:g} s (docs/operations.md, "
    "warm restart). An offline LLM's engine core gets 5 s at exit: nothing to "
    "do there"
)


@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus kvtier's
    :class:`~kvtier.connector.worker_report.WorkerReport` (summed over
    workers)."""

    report: WorkerReport = field(default_factory=WorkerReport)

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = super().aggregate(other)
        assert isinstance(base, OffloadingWorkerMetadata)
        report = self.report
        if isinstance(other, KvtierWorkerMetadata):
            report = report.merge(other.report)
        return KvtierWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            report=report,
        )


class KvtierConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker, tolerating failed loads (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._report = WorkerReport()  # since the last worker metadata
        self._failed_reqs: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        # Synchronous loads (vLLM >= 0.33): vLLM records them in _load_jobs
        # with no request (no finished_recving), kvtier needs it for the
        # failed keys. Their unfilled blocks are reported block level only.
        self._sync_load_reqs: dict[int, str] = {}
        self._sync_invalid_block_ids: set[int] = set()
        # This step's store jobs (prepare_store_kv), and how many steps,
        # this one included, drop theirs: a sync load of this step failed
        # (get_finished), and the scheduler planned the next
        # max_concurrent_batches - 1 steps before it read that step's output
        # (async scheduling, pipeline parallelism). See _drop_step_stores.
        self._step_stores: dict[int, Any] = {}
        batches = getattr(self.vllm_config, "max_concurrent_batches", None)
        self._steps_per_failure = max(int(batches or 1), 1)
        self._dropping_steps = 0
        self._deltas = CounterDeltas()

    @override
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM's, but the loads it flushes that still read the disk are
        given up first (``TieredOffloadingWorker.give_up_loads``).

        vLLM waits here for every job it flushes; the loads among them are
        those in flight at a connector reset. A disk read that stalls
        stalled this step, and every request in it, up to the load thread's
        batch deadline (15 s); given up, their requests recompute those
        tokens instead (tests/e2e/test_async_load_e2e.py)."""
        flushed = kv_connector_metadata.jobs_to_flush or ()
        loads = [job_id for job_id in flushed if job_id in self._load_jobs]
        give_up = getattr(self.worker, "give_up_loads", None)
        if loads and give_up is not None:
            give_up(loads)
        super().handle_preemptions(kv_connector_metadata)

    @override
    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        self._step_stores = {}
        if self._dropping_steps:
            self._dropping_steps -= 1
        for job_id, entry in metadata.load_jobs.items():
            if getattr(entry, "sync", False):
                self._sync_load_reqs[job_id] = entry.req_id
        super().start_kv_transfers(metadata)

    @override
    def prepare_store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        self._step_stores = metadata.store_jobs
        super().prepare_store_kv(metadata)
        if self._dropping_steps:  # vLLM called get_finished first
            self._drop_step_stores()

    def _drop_step_stores(self) -> None:
        """Fail this step's store jobs: a synchronous load of this step
        failed, and the step computed its tokens over the blocks it left
        unfilled.

        vLLM (0.33) builds a step's store jobs next to its synchronous loads,
        for the chunks that step computes, and submits them at the next
        step's start; on a failed load it only winds the requests back. Those
        chunks' KV was computed against the unfilled blocks (by the loading
        request, by any request sharing its blocks in the batch, and, under
        tensor parallelism, by every rank, through the all-reduce), so
        stored, it would be wrong KV under the right keys for later
        requests. No step store is submitted here; every one travels to the
        scheduler as its CPU rows (from each rank whose load failed: each
        verifies its own shard), and the manager completes a key as failed
        when any rank names its row, so the rows stay unreadable even where
        another rank wrote them: misses, only in a step whose synchronous
        load failed.

        The same goes for the steps vLLM planned after that one before it
        read its output (async scheduling: the next step; pipeline
        parallelism: up to ``max_concurrent_batches - 1``): the loading
        request computed its next prefill chunk, or decoded, over the
        unfilled blocks there too, and vLLM built those chunks' store jobs
        with the keys of a correct compute; only a step planned after the
        scheduler wound the request back recomputes them."""
        if not self._step_stores:
            return
        # vLLM's queue of (job id, source, destination), filtered in place:
        # the next step's start submits what is left of it.
        queued = self._unsubmitted_store_jobs
        queued[:] = [job for job in queued if job[0] not in self._step_stores]
        meta = self._connector_worker_meta
        for job_id, entry in self._step_stores.items():
            self._report.failed_store_rows.extend(
                int(r) for r in entry.dst_spec.block_ids
            )
            if job_id not in meta.completed_jobs:  # a non-writer's already is
                meta.mark_completed(job_id)
        logger.warning(
            "kvtier: a synchronous load failed; the %d store job(s) of its step, "
            "or of a step planned before its failure was seen, are dropped "
            "(their chunks were computed over the unfilled blocks)",
            len(self._step_stores),
        )
        self._step_stores = {}

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            job_id = result.job_id
            # Membership, not value: a sync load's entry is None.
            is_load = job_id in self._load_jobs
            req_id = self._load_jobs.pop(job_id, None)
            sync_req = self._sync_load_reqs.pop(job_id, None)
            if result.transfer_time is not None and result.transfer_size is not None:
                stats = (
                    meta.transfer_stats.load if is_load else meta.transfer_stats.store
                )
                stats.record(result.transfer_size, result.transfer_time)
            if not result.success and not is_load:
                take = getattr(self.worker, "take_store_error", None)
                rows = take(job_id) if take is not None else None
                if rows is None:
                    # A failure the scheduler cannot be told of: its rows
                    # would pass as written.
                    raise RuntimeError(f"kvtier: store job {job_id} failed")
                self._report.failed_store_rows.extend(rows)
            elif not result.success:
                take = getattr(self.worker, "take_load_error", None)
                error = take(job_id) if take is not None else None
                owner = req_id if req_id is not None else sync_req
                if owner is None or error is None:
                    raise RuntimeError(f"kvtier: load job {job_id} failed")
                report = self._report
                report.corrupt_keys.setdefault(owner, []).extend(error.corrupt)
                if error.unread:
                    report.unread_keys.setdefault(owner, []).extend(error.unread)
                if error.io_failed:
                    report.io_failed_keys.setdefault(owner, []).extend(
                        error.io_failed
                    )
                if error.whole:
                    report.failed_loads.append(owner)
                if req_id is None:  # sync: the request runs this step
                    self._sync_invalid_block_ids |= error.gpu_block_ids
                    self._dropping_steps = self._steps_per_failure
                else:
                    self._failed_reqs.add(req_id)
                    self._invalid_block_ids |= error.gpu_block_ids
            meta.mark_completed(job_id)
            if req_id is not None:
                finished_recving.add(req_id)
        if self._dropping_steps:
            self._drop_step_stores()
        return set(), finished_recving

    def take_load_errors(self) -> tuple[set[str], set[int], set[int]]:
        """Since the last call: requests whose asynchronous load failed, the
        GPU blocks those loads left unfilled, and the GPU blocks synchronous
        loads left unfilled."""
        reqs, self._failed_reqs = self._failed_reqs, set()
        blocks, self._invalid_block_ids = self._invalid_block_ids, set()
        sync, self._sync_invalid_block_ids = self._sync_invalid_block_ids, set()
        return reqs, blocks, sync

    @override
    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if meta is None:
            return None
        report, self._report = self._report, WorkerReport()
        d = self._deltas.delta
        reader = getattr(self.worker, "reader", None)
        if reader is not None:
            stats = reader.stats()
            for name in ("read_bytes", "read_seconds", "checksum_failures", "io_errors"):
                setattr(report.counters, name, d(name, getattr(stats, name)))
        exceptions = getattr(self.worker, "exceptions", None)
        if exceptions is not None:
            report.counters.exceptions = int(d("exceptions", exceptions.count))
        take_latencies = getattr(self.worker, "take_read_latencies", None)
        if take_latencies is not None:
            report.read_latencies = take_latencies()
        return KvtierWorkerMetadata(
            completed_jobs=meta.completed_jobs,
            transfer_stats=meta.transfer_stats,
            report=report,
        )


def _create_spec(config: OffloadingConfig, facts: ConnectorFacts) -> OffloadingSpec:
    """vLLM's ``OffloadingSpecFactory.create_spec``, handing kvtier's spec
    the connector's facts; any other spec is built as vLLM builds it."""
    spec_cls = OffloadingSpecFactory.get_spec_cls(config.extra_config)
    if issubclass(spec_cls, TieredOffloadingSpec):
        return spec_cls(config, facts)
    check_kvtier_keys_are_read(config.extra_config, spec_cls.__name__)
    return spec_cls(config)


class TieredOffloadingConnector(OffloadingConnector):
    """OffloadingConnector that turns failed disk loads into recomputation."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise TransferConfigError(
                "kv_load_failure_policy",
                f"is {transfer.kv_load_failure_policy!r}: a failed disk block "
                "would fail its request instead of being recomputed; " + CONNECTOR_HINT,
            )
        if role == KVConnectorRole.SCHEDULER:
            algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
            problem = prefix_hash_problem(algo, os.environ.get("PYTHONHASHSEED"))
            if problem:
                logger.warning(
                    "kvtier: --prefix-caching-hash-algo %s: %s; fix: %s",
                    algo,
                    problem,
                    HASH_FIX,
                )
        # vLLM's OffloadingConnector.__init__, statement for statement
        # (tests/compat fails by name when vLLM changes it), but for the
        # spec, built with what only the connector knows, and the worker.
        super(OffloadingConnector, self).__init__(vllm_config, role, kv_cache_config)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        facts = ConnectorFacts.of(vllm_config, len(kv_cache_config.kv_cache_groups))
        spec = _create_spec(offloading_config, facts)
        if (
            role == KVConnectorRole.SCHEDULER
            and isinstance(spec, TieredOffloadingSpec)
            and spec.kvtier.disk_enabled
        ):
            if getattr(vllm_config, "lora_config", None) is not None:
                logger.warning("kvtier: %s", LORA_ON_DISK)
            if getattr(vllm_config, "shutdown_timeout", None) == 0:
                logger.warning("kvtier: %s", SHUTDOWN_TIMEOUT_ZERO)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = sched = OffloadingConnectorScheduler(
                spec, vllm_config, kv_cache_config
            )
            # Removals named as their stores were (a warm restart's blocks).
            sched._events_tracker = KvtierEventsTracker.taking_over(
                sched._events_tracker
            )
            manager = sched.manager
            if (
                isinstance(manager, TieredOffloadingManager)
                and sched._events_tracker.self_describing_enabled
            ):
                # take_events drops the payloads of keys gone from kvtier.
                manager.collect_left_keys = True
                manager.reset_removal_hashes = max(
                    group.tokens_per_chunk // group.tokens_per_block
                    for group in sched.config.kv_group_configs
                )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvtierConnectorWorker(
                spec, vllm_config, kv_cache_config
            )
        # vLLM (0.32, 0.33) accepts block-level errors only for one group.
        self._request_level_errors = len(kv_cache_config.kv_cache_groups) > 1
        self._invalid_block_ids: set[int] = set()
        # KV events a connector reset translated (reset_cache), sent first
        # by the next take_events.
        self._reset_events: list[Any] = []
        # With self-describing events: the payloads vLLM's tracker held at
        # the last reset, while its removals are still owed (reset_cache).
        self._reset_tracker: OffloadingEventsTracker | None = None

    @override
    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        worker = self.connector_worker
        assert isinstance(worker, KvtierConnectorWorker)
        sending, recving = self.get_finished(finished_req_ids)
        failed_reqs, failed_blocks, sync_blocks = worker.take_load_errors()
        results = KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ())
        )
        if self._request_level_errors:
            results.failed_recving = failed_reqs
        else:
            self._invalid_block_ids |= failed_blocks
        # A sync load's request is running, not waiting: request-level
        # failed_recving does not apply (sync_load_budget_bytes is refused
        # where block level cannot be used: compat.check_sync_load_budget).
        self._invalid_block_ids |= sync_blocks
        return results

    @override
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's, but a request that ``reset_prefix_cache(
        reset_running_requests=True)`` preempted and the same step readmitted
        with a load is not taken for a request with store jobs to flush.

        vLLM 0.32 flushes the jobs of each preempted request and asserts
        they are stores; a request preempted by that reset (between steps)
        and readmitted with a CPU or disk hit has only its new load, not
        yet submitted, so the assertion would stop the engine. vLLM 0.33
        leaves such loads out of the flush; so does this: those requests
        leave the preempted set that vLLM's connector scheduler reads (the
        worker still gets vLLM's own scheduler output). A load is only
        issued when a request has no other job in flight, so nothing of
        theirs needs a flush."""
        sched = self.connector_scheduler
        assert sched is not None
        preempted = scheduler_output.preempted_req_ids
        fresh = sched._current_batch_load_jobs.keys()
        if preempted and fresh:
            readmitted = {
                req_id
                for req_id in preempted
                if (status := sched._req_status.get(req_id)) is not None
                and status.transfer_jobs
                and status.transfer_jobs <= fresh
            }
            if readmitted:
                scheduler_output = copy.copy(scheduler_output)
                scheduler_output.preempted_req_ids = preempted - readmitted
        return super().build_connector_meta(scheduler_output)

    @override
    def reset_cache(self) -> bool | None:
        """vLLM's connector reset, but requests still in the scheduler keep
        their store progress instead of storing again from their first
        chunk.

        vLLM restarts active requests' stores from chunk 0 after a reset,
        from the GPU block ids it recorded for them. On a model with a
        sliding-window group, reset while requests run (the GPU cache then
        keeps its blocks), those re-stores leave a copy whose bytes are not
        its chunk's KV, which later requests load
        (tests/e2e/test_engine_fuzz_e2e.py, Gemma-2). With the progress
        kept, the chunks they stored before the reset are forgotten like
        every other block: a miss, never a copy of unknown bytes.

        A reset's removals (one per block the tiers held) go out over the
        steps after it (``EVENT_BACKLOG_PER_STEP``); a reset that comes
        while an earlier one's are still owed, and forgets blocks, hands
        those out first, with what else is owed (:meth:`_hand_out_backlog`):
        what the steps owe stays within one reset's worth, however often
        resets come. One that forgets none (back to back) leaves them to
        the steps.

        With ``self_describing_kv_events``, each removal must name every
        block hash its store named, so a subscriber keeps none of them on
        CPU or STORAGE for ever; but vLLM's reset drops the payloads
        (``OffloadingEventsTracker.reset``; its own CPU manager announces no
        removal then). The payloads move, before vLLM's reset, to a tracker
        of the reset's own, which translates the events owed from before
        it (:class:`BulkEvent`: the reset's removals, a warm restart's
        adoptions not announced yet) as they go out: one engine step's
        drain here, the rest over the next steps, about
        ``EVENT_BACKLOG_PER_STEP`` block hashes each (:meth:`take_events`;
        it took seconds inside the reset at a million blocks). vLLM's
        tracker then describes only what is stored after the reset: a
        removal owed by the reset never takes a new copy's payload with it
        where a step stores the same block again."""
        sched = self.connector_scheduler
        assert sched is not None
        progress = {
            req_id: [group.next_stored_chunk_idx for group in status.group_states]
            for req_id, status in sched._req_status.items()
        }
        tracker = sched._events_tracker
        manager = sched.manager
        tiered = isinstance(manager, TieredOffloadingManager)
        owing = tiered and manager.hierarchy.owes_events_of("reset")
        back_to_back = owing and manager.hierarchy.empty
        if back_to_back:
            # This reset forgets no block (vLLM's sleep resets twice, with no
            # step between): the earlier one's removals go on going out over
            # the steps, with its payloads; what is pending goes now, with
            # vLLM's payloads, before its reset drops them.
            self._reset_events.extend(self._step_events())
        elif owing:
            self._hand_out_backlog()
        payloads = None
        if tracker.self_describing_enabled and not back_to_back:
            # Moved, not copied: O(1) whatever the tiers hold.
            payloads = tracker._pending_event_metadata
            tracker._pending_event_metadata = {}
        try:
            done = super().reset_cache()
        except BaseException:
            if payloads is not None:  # as vLLM's failed reset left them
                tracker._pending_event_metadata = payloads
            raise
        if payloads is not None and tiered:
            kept = self._reset_tracker = copy.copy(tracker)  # its config, specs
            kept._pending_event_metadata = payloads
            # Everything pending now predates the reset: the stores and
            # spills its drain completed, then the reset's removals.
            self._reset_events.extend(
                translate_after_reset(
                    self._drain_manager(), kept, kept, manager.hierarchy.event_owed
                )
            )
            manager.take_keys_gone()  # vLLM's tracker holds none of them
        elif payloads:
            # vLLM's manager (tiering mode): what is pending predates the
            # reset, so it is translated with the payloads from before it.
            tracker._pending_event_metadata = payloads
            self._reset_events.extend(tracker.take_events(self._drain_manager()))
            keep_secondary_payloads(payloads)
        for req_id, status in sched._req_status.items():
            for group, stored in zip(status.group_states, progress.get(req_id, ())):
                group.next_stored_chunk_idx = stored
        return done

    def _drain_manager(self) -> list[OffloadingEvent]:
        """The manager's pending events, drained as vLLM's scheduler drains
        them for its ``take_events``: at once, and under vLLM 0.33 inside
        its manager region (``_manager_locked``: a tier's poll thread may
        enter the manager too, as a p2p tier's in tiering mode); 0.32 has
        none. Called outside ``schedule()`` only, as vLLM's hooks that take
        the region are."""
        sched = self.connector_scheduler
        assert sched is not None
        region = getattr(sched, "_manager_locked", None)
        with region() if region is not None else contextlib.nullcontext():
            return list(sched.manager.take_events())

    def _hand_out_backlog(self) -> None:
        """Translate every event owed (an earlier reset's removals, what
        else is pending), sent first by the next :meth:`take_events`: the
        steps since that reset did not hand them all out (resets more often
        than the steps drain them). O(keys owed), at most one reset's
        worth."""
        sched = self.connector_scheduler
        assert sched is not None
        hierarchy = sched.manager.hierarchy
        while hierarchy.has_event_backlog:
            self._reset_events.extend(self._step_events())

    @override
    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's, after the events a reset translated; the events owed from
        before a reset are translated with the payloads from before it;
        then, with ``self_describing_kv_events``, the payloads vLLM's
        tracker keeps of keys gone from every tier are dropped.

        vLLM's tracker holds a key's payload (token ids, block hashes) until
        a removal clears the last residency it recorded, and it records a
        CPU residency for every hit its lookup sees and every store it
        builds: vLLM's own managers answer hits from the CPU tier only and
        announce a failed store (0.33: a metadata-only removal). kvtier also
        answers disk hits, of which a block may never reach the CPU tier,
        and fails stores a worker reported, so those payloads would stay
        for the engine's lifetime: one per such block, a leak of the
        scheduler process. Only keys in no tier are dropped: a key stored
        again keeps the payload its new store recorded."""
        if self._reset_events:
            events, self._reset_events = self._reset_events, []
            yield from events
        yield from self._step_events()

    def _step_events(self) -> Iterable[KVCacheEvent]:
        """One drain of the manager's events, translated (see
        :meth:`take_events`)."""
        sched = self.connector_scheduler
        manager = sched.manager if sched is not None else None
        reset_tracker = self._reset_tracker
        if reset_tracker is None:
            yield from super().take_events()
        else:
            assert isinstance(manager, TieredOffloadingManager)
            yield from translate_after_reset(
                self._drain_manager(),
                sched._events_tracker,
                reset_tracker,
                manager.hierarchy.event_owed,
            )
            if not manager.hierarchy.has_event_backlog:
                self._reset_tracker = None  # nothing from before the reset owed
        if isinstance(manager, TieredOffloadingManager) and manager.collect_left_keys:
            payloads = sched._events_tracker._pending_event_metadata
            for key in manager.take_keys_gone():
                payloads.pop(key, None)

    def _restart_stores_after_failed_loads(self) -> None:
        """Start the stores of each request whose load just failed over from
        its first chunk, so the chunks it recomputes are offloaded again.

        vLLM sets a request's store progress to the end of its planned load
        (the loaded chunks need no store) and keeps it there when the load
        fails, so otherwise the recomputed chunks are never stored: a
        corrupt block dropped from the disk tier stays a miss for every
        later request. From chunk 0, as a new request's stores start (and
        as vLLM 0.33 starts every request it looks up), the tiers skip the
        chunks they hold and store the others from the request's GPU
        blocks, once they are computed (the failed ones recomputed).

        Only while the request has no GPU block id recorded, as an
        asynchronous load leaves it (vLLM clears them at its lookup and
        records them again when it schedules the request): every block id a
        store then uses is recorded after the restart, and vLLM's check for
        sliding-window blocks freed and reused covers every position from
        the store progress on. A restart over recorded ids could store a
        sliding-window block reused since (the connector reset's failure,
        see :meth:`reset_cache`); such a request keeps vLLM's progress: a
        miss."""
        sched = self.connector_scheduler
        assert sched is not None
        take = getattr(sched.manager, "take_failed_loads", None)
        for req_id in take() if take is not None else ():
            status = sched._req_status.get(req_id)
            if status is None or any(g.block_ids for g in status.group_states):
                continue
            for group in status.group_states:
                group.next_stored_chunk_idx = 0

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    @override
    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            report = getattr(self.scheduler.manager, "note_worker_report", None)
            if report is None and meta.report.failed_store_rows:
                # Before vLLM completes the store as a success: a manager
                # that cannot be told would serve the rows unwritten.
                raise RuntimeError(
                    "kvtier: a store failed and this manager cannot take it "
                    f"back (rows {meta.report.failed_store_rows})"
                )
            if report is not None:
                report(meta.report)
        super().update_connector_output(connector_output)
        self._restart_stores_after_failed_loads()
