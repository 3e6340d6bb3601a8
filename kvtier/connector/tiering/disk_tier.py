"""``KvtierDiskTier``: kvtier's disk tier as a secondary tier of vLLM's
``TieringOffloadingSpec`` (the subpackage's doc has the config).

A :class:`~vllm.v1.kv_offload.tiering.base.SecondaryTierManager` for
``secondary_tiers``: bounded capacity with any registered eviction policy, a
checksummed slot per block (kvtier's on-disk format, so ``kvtier inspect`` /
``verify`` read it), warm restart and optional zstd. It is the same code as
the full spec's disk tier, not a second copy: the placement (slots,
victims, pins, WRITING/READY, the read-failure rule, warm restart, events)
is a :class:`kvtier.tiers.disk_core.DiskTierCore`, the one the full spec's
hierarchy uses, and the data path is :class:`kvtier.store.runtime.DiskRuntime`
(one :class:`~kvtier.store.store.DiskStore` per TP rank and one transfer
engine) pointed at the rows of the primary tier's memoryview instead of
kvtier's own CPU buffer.

Row layout. vLLM's primary tier is one ``SharedOffloadRegion`` mmap of
``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes (page aligned)::

    | rank 0 page | rank 1 page | ... | rank W-1 page | padding |

Each rank page (``cpu_page_size_per_worker`` = KV bytes of one offloaded
block of one rank) is what kvtier's full spec calls one block: it goes to
that rank's own slab, under that rank's layout fingerprint (model, dtype,
block geometry, TP rank/size, plus ``host_layout=vllm-tiering`` because
vLLM orders a rank's page per KV tensor, which differs from the full spec's
per-group rows on hybrid models). A key is on disk iff every rank's slot is.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.connector import metrics as m
from kvtier.connector.config import (
    CANONICAL_LAYOUT_REFUSAL,
    DISK_TIER_TYPE,
    ConfigError,
    as_tier_error,
    blocks_in_budget,
    check_one_disk_tier,
    parse_tier_config,
)
from kvtier.connector.identity import layout_fingerprints
from kvtier.connector.preflight import check_disk_paths
from kvtier.connector.tiering.pull import PullBack
from kvtier.connector.worker_report import CounterDeltas
from kvtier.log import get_logger
from kvtier.store.compression import element_bytes
from kvtier.store.runtime import DiskRuntime
from kvtier.store.slabs import store_dirname
from kvtier.store.slot import slot_size
from kvtier.store.store import open_stores
from kvtier.store.transfers import ArrayRows
from kvtier.tiers.disk_core import DiskTierCore
from kvtier.tiers.events import EVENT_BACKLOG_PER_STEP, MEDIUM_DISK, EventLog
from kvtier.tiers.plans import PromoteOrder, SpillOrder, TransferItem

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec


logger = get_logger("connector")

HOST_LAYOUT = "vllm-tiering"

# vLLM 0.33's tiering manager holds promotions after a reset until the
# workers reported every job the reset flushed (``on_reset_flushed``);
# vLLM 0.32's does not, so this tier holds its own lookups then
# (KvtierDiskTier.drain_jobs).
VLLM_HOLDS_PROMOTIONS_AFTER_RESET = hasattr(OffloadingManager, "on_reset_flushed")

# kvtier's metric series this tier feeds, the full spec's where the concept
# exists (tier label "disk"). vLLM's tiering manager also exports read and
# write bytes and time per tier type (vllm:kv_offload_tiering_*).
DISK_TIER_METRICS = (
    m.TIER_USAGE,
    m.TIER_BLOCKS,
    m.TIER_CAPACITY,
    m.READ_BYTES,
    m.READ_SECONDS,
    m.WRITE_BYTES,
    m.WRITE_SECONDS,
    m.EVICTIONS,
    m.SPILLS,
    m.SPILL_FAILURES,
    m.PROMOTIONS,
    m.PROMOTION_FAILURES,
    m.LOADED_BLOCKS,
    m.LOAD_ERRORS,
    m.LOAD_IO_ERRORS,
    m.CORRUPT_BLOCKS,
    m.UNREADABLE_BLOCKS,
    m.CHECKSUM_FAILURES,
    m.IO_ERRORS,
    m.STORES_DECLINED,
    m.READ_LATENCY,
    m.DISK_STALLED,
)
_DISK = (MEDIUM_DISK,)


@dataclass
class DiskTierStats:
    """The tier's monotonic counters (``get_stats`` reports their growth)."""

    stores_completed: int = 0
    store_failures: int = 0
    stores_skipped_full: int = 0
    promotions_completed: int = 0
    # Keys of load jobs not promoted: unreadable, failed verification, or
    # gone from the tier when the job came.
    promotion_failures: int = 0
    # Of those, the keys whose read failed (an I/O error or verification).
    load_errors: int = 0
    evictions: int = 0
    restored: int = 0
    # Blocks another secondary tier supplied, stored here too (pull.py).
    pulled: int = 0


# ------------------------------------------------------------------- tier


@dataclass
class _TierJob:
    """A vLLM ``TransferJob`` of this tier while in flight: what it holds."""

    is_store: bool
    keys: list[OffloadKey]
    # Store: keys given a slot (WRITING). Load: keys pinned for the read.
    moved: list[OffloadKey] = field(default_factory=list)
    # Load: keys no longer on disk when the load was submitted.
    missing: list[OffloadKey] = field(default_factory=list)


# The settings that change KV values which the full spec's store identity
# holds (kvtier.connector.identity.settings_identity) and a secondary tier's
# cannot: vLLM gives the tier an OffloadingConfig, not the VllmConfig.
UNCOMPARED_SETTINGS = (
    "hf_overrides, quantization, revision, download_dir, the loader "
    "(load_format: dummy weights, model_loader_extra_config, "
    "ignore_patterns), the KV-scale settings (calculate_kv_scales, "
    "kv_cache_dtype_skip_layers), the Mamba and indexer cache dtypes, "
    "max_model_len (LongRoPE), a speculative draft model, Llama 4's "
    "temperature tuning, an Engram model's tokenizer, context parallelism's "
    "KV interleave, LoRA's target modules and the rest of vLLM's model hash "
    "factors (runner, model_impl, code_revision, ...)"
)


class KvtierDiskTier(SecondaryTierManager):
    """kvtier's checksummed, bounded disk tier behind vLLM's tiering manager.

    Scheduler-side and non-blocking: ``submit_store``/``submit_load`` do the
    bookkeeping (slot allocation, eviction, pins) and enqueue the transfer on
    the disk runtime's threads; ``get_finished_jobs`` applies completions.

    Invariants: at most ``capacity`` blocks are resident, so the slab files
    never exceed ``disk_bytes_to_use``; a block is HIT only once every rank's
    slot was written; a block being read (pinned) or written is never
    evicted; a read that fails is a miss (the primary row is not written,
    vLLM marks the key failed) and the block's fate is the disk core's
    read-failure rule: dropped when its bytes failed verification, kept after
    an I/O error unless its reads failed so too often in a row. A load job
    with no keys succeeds, as a store job with none does.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **tier_config: Any,
    ) -> None:
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        self.locality = Locality.LOCAL
        # Paths are checked below, once the layout (and so the directory a
        # warm restart may reuse) is known.
        check_one_disk_tier(offloading_spec.extra_config.get("secondary_tiers"))
        self.settings = parse_tier_config(tier_config)
        cfg = self.settings
        config = offloading_spec.config
        if config.canonical_layout:
            # A key of kv_connector_extra_config, not of this entry.
            raise ConfigError("canonical_layout", CANONICAL_LAYOUT_REFUSAL)
        world = max(config.parallel.world_size, 1)
        replicated = bool(getattr(offloading_spec, "replicated_layout", False))
        self.num_ranks = 1 if replicated else world
        self.block_bytes = int(
            getattr(offloading_spec, "cpu_page_size_per_worker", 0)
            or config.worker_kv_bytes_per_block * offloading_spec.blocks_per_chunk
        )
        rows = np.asarray(primary_kv_view).view(np.uint8)
        if rows.ndim != 2 or self.num_ranks * self.block_bytes > rows.shape[1]:
            raise ValueError(
                f"{DISK_TIER_TYPE}: primary rows of {rows.shape} cannot hold "
                f"{self.num_ranks} rank page(s) of {self.block_bytes} B"
            )
        host_layout = HOST_LAYOUT + ("-replicated" if replicated else "")
        fingerprints = layout_fingerprints(
            config, self.block_bytes, world, host_layout
        )[: self.num_ranks]
        try:
            self.capacity = blocks_in_budget(
                cfg.disk_bytes_to_use,
                slot_size(self.block_bytes),
                self.num_ranks,
                "disk_bytes_to_use",
                "disk slot",
            )
            check_disk_paths(cfg, reusable=[store_dirname(fp) for fp in fingerprints])
        except ConfigError as exc:
            raise as_tier_error(exc) from None
        self._events = EventLog(
            offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self.core = DiskTierCore(
            self.capacity, cfg.disk_eviction_policy, emit=self._emit
        )
        self.tier = self.core.tier  # queries (get, is_ready, in, len)
        self.stats = DiskTierStats()
        self._jobs: dict[JobId, _TierJob] = {}
        self._done: list[JobResult] = []
        self._pull = PullBack()
        # Keys this tier answered HIT since its last on_schedule_end: vLLM
        # submits their promotions at the end of that step, after
        # serve_external_requests, whose store must not evict them first.
        self._hit_this_step: set[OffloadKey] = set()
        # Scheduler steps whose lookups still miss after a reset (vLLM 0.32:
        # see drain_jobs), and how many a reset holds: every batch that can
        # be in flight (pp_size with pipeline parallelism, 2 with async
        # scheduling) has run the workers' flush of the reset's jobs by then.
        self._held_steps = 0
        self.reset_hold_steps = 1 + max(2, config.parallel.pp_size)
        # get_stats: counter totals as last reported, and the read latencies
        # observed since (one per promotion job).
        self._deltas = CounterDeltas()
        self._read_latencies = m.Samples()
        # The data path's totals as last seen: a shut-down tier (no runtime)
        # keeps reporting them, so no counter goes backwards.
        self._io: list[tuple[str, tuple[str, ...], float]] = []
        stores = open_stores(
            cfg.disk_path,
            fingerprints,
            self.capacity,
            self.block_bytes,
            backend=cfg.disk_io,
            compression=cfg.disk_compression,
            elem_size=element_bytes(config.model.dtype),
            threads=cfg.disk_io_threads,
        )
        self.runtime: DiskRuntime | None = DiskRuntime(
            stores,
            [  # each rank's page of every row, a view into vLLM's mmap
                ArrayRows(
                    rows[:, r * self.block_bytes : (r + 1) * self.block_bytes],
                    self.block_bytes,
                )
                for r in range(self.num_ranks)
            ],
            threads=cfg.disk_io_threads,
        )
        try:
            self._warm_restart()
        except BaseException:
            # Its threads, slab files and store locks go with it.
            self.runtime.close()
            raise
        logger.info(
            "kvtier %s: %d blocks of %d B x %d rank(s) (%s, %s) on %s",
            tier_type,
            self.capacity,
            self.block_bytes,
            self.num_ranks,
            cfg.disk_eviction_policy,
            cfg.disk_compression,
            list(cfg.disk_path),
        )

    # ------------------------------------------------------------ helpers

    def _warm_restart(self) -> None:
        assert self.runtime is not None
        restored = self.runtime.scan_restore()  # oldest first
        if not restored:
            return
        self.core.restore(restored)  # reported as stored
        self.stats.restored = len(restored)
        # vLLM hands a secondary tier no VllmConfig: the identity that named
        # this store holds the model's contents and the KV geometry only
        # (docs/tiering-mode.md), so the start-up says what was not
        # compared. INFO, as the adoption itself: it is every warm
        # restart's, not a fault.
        logger.info(
            "kvtier %s: warm restart adopted %d disk blocks, matched by the "
            "model's contents, KV dtype and geometry only: vLLM hands a "
            "secondary tier no VllmConfig, so %s were not compared. If this "
            "engine changed any of them, its blocks are wrong for it: give it "
            "its own disk_path (docs/tiering-mode.md)",
            self.tier_type,
            len(restored),
            UNCOMPARED_SETTINGS,
        )

    def _emit(self, keys: Sequence[Any], removed: bool, reason: str = "") -> None:
        """The core's event hook: recorded, one vLLM event per batch at
        ``take_events`` (``reason`` is kvtier's, not part of vLLM's event)."""
        self._events.record(keys, MEDIUM_DISK, removed, reason)

    # ----------------------------------------------------------- contract

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # A block still being written is a MISS here: its bytes are in the
        # primary tier anyway (the cascade reads them from there, pinned).
        # A stopped disk (a drain timed out) can only fail a promotion.
        runtime = self.runtime
        if runtime is None or runtime.broken or self._held_steps:
            return LookupResult.MISS
        if self.tier.is_ready(key):
            self._hit_this_step.add(key)
            return LookupResult.HIT
        if key not in self.tier:
            self._pull.note(key)  # a later tier may supply it: keep it then
        return LookupResult.MISS

    @override
    def serve_external_requests(self, parent: ParentManager) -> None:
        # Blocks a later secondary tier promoted into the primary tier are
        # stored here too (kvtier.connector.tiering.pull).
        if self.runtime is None:
            return
        job = self._pull.serve(parent, self.tier.__contains__, self._admits)
        if job is not None:
            self.stats.pulled += len(job.keys)
            self._store(job, keep=self._hit_this_step)

    def _admits(self, num_blocks: int) -> bool:
        """Whether this tier's back-pressure takes a store of ``num_blocks``
        (vLLM's ``_should_store_to_tier``: a refusal is counted as dropped)."""
        detector = self.bp_detector
        return detector is None or detector.should_store(num_blocks)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.touch_many(list(keys))

    def _refuse_after_shutdown(self, job_metadata: TransferJob) -> bool:
        """A job that comes after ``shutdown`` fails whole at once (its
        primary slots are released), as the runtime fails one after a
        drain timed out; never an assertion in the scheduler."""
        if self.runtime is not None:
            return False
        self._done.append(
            JobResult(job_metadata.job_id, False, transfer_time=0.0, transfer_bytes=0)
        )
        return True

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._store(job_metadata, keep=self._hit_this_step)

    def _store(self, job_metadata: TransferJob, keep: Collection[OffloadKey]) -> None:
        """Store ``job_metadata``'s keys not held yet, evicting for room any
        block but the job's own and ``keep``'s."""
        if self._refuse_after_shutdown(job_metadata):
            return
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        tier = self.tier
        fresh: dict[OffloadKey, int] = {}
        for key, chunk in zip(keys, chunks):
            if key not in tier:  # else stored or being stored already
                fresh.setdefault(key, chunk)
        tier.touch_many([key for key in keys if key not in fresh])
        if len(fresh) > tier.num_free:
            evicted = self.core.make_room(len(fresh), exclude={*keys, *keep})
            self.stats.evictions += len(evicted)
            if len(fresh) > tier.num_free:
                # Everything else is pinned or in flight: keep the earliest
                # chunks (a prefix lookup stops at the first miss).
                self.stats.stores_skipped_full += len(fresh) - tier.num_free
                fresh = dict(list(fresh.items())[: tier.num_free])
        slots = self.core.allocate(list(fresh))
        items = [
            TransferItem(key, chunk, slot)
            for (key, chunk), slot in zip(fresh.items(), slots)
        ]
        job_id = job_metadata.job_id
        if not items:
            self._done.append(
                JobResult(job_id, True, transfer_time=0.0, transfer_bytes=0)
            )
            return
        self._jobs[job_id] = _TierJob(True, keys, moved=[it.key for it in items])
        self.runtime.submit_spill(SpillOrder(job_id, tuple(items)))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        if self._refuse_after_shutdown(job_metadata):
            return
        keys = list(job_metadata.keys)
        job = _TierJob(False, keys)
        items = []
        chunks: list[int] = []
        for key, chunk in zip(keys, job_metadata.chunk_ids):
            if not self.tier.is_ready(key):
                job.missing.append(key)
                continue
            job.moved.append(key)
            chunks.append(int(chunk))
        # Touched in key order: the last key ends up most recent.
        slots = self.core.pin_reads(job.moved[::-1])[::-1]
        items = [
            TransferItem(key, slot, chunk)
            for key, slot, chunk in zip(job.moved, slots, chunks)
        ]
        job_id = job_metadata.job_id
        if not items:
            # Nothing to read: it failed if a key is gone, and a job with no
            # keys at all succeeded (every key of it did), as submit_store's.
            self.stats.promotion_failures += len(job.missing)
            self._done.append(
                JobResult(
                    job_id, not job.missing, transfer_time=0.0, transfer_bytes=0
                )
            )
            return
        self._jobs[job_id] = job
        self.runtime.submit_promote(PromoteOrder(job_id, tuple(items)))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._done = self._done, []
        if self.runtime is None:
            return results
        for done in self.runtime.poll():
            job = self._jobs.pop(done.job_id)
            assert job.is_store == done.spill
            failed = set(done.lost_keys)
            # Keys a reset cancelled (drain_jobs) were neither read nor
            # written: no I/O error, no failure of the disk, as the full
            # spec's cancelled spills; a cancelled promotion's blocks stay.
            cancelled = failed.intersection(done.cancelled_keys)
            if done.spill:
                lost = [k for k in job.moved if k in failed]
                stored = [k for k in job.moved if k not in failed]
                self.core.fail(lost)  # never READY: no event
                self.core.complete(stored)  # reported as stored
                self.stats.store_failures += len(lost) - len(cancelled)
                self.stats.stores_completed += len(stored)
                results.append(
                    JobResult(
                        done.job_id,
                        not failed,
                        transfer_time=done.seconds,
                        transfer_bytes=done.bytes,
                    )
                )
                continue
            # A failed key's primary row was not written. The core applies
            # the read-failure rule: a block whose bytes failed verification
            # (its slot invalidated by the runtime) is dropped, so the next
            # lookup is a clean miss; one whose read failed with an I/O
            # error stays for the next lookup to promote again, unless its
            # reads failed too often in a row.
            io_failed = set(done.io_failed_keys) - cancelled
            self.core.release_reads(
                job.moved,
                corrupt=[
                    k
                    for k in job.moved
                    if k in failed and k not in io_failed and k not in cancelled
                ],
                io_failed=[k for k in job.moved if k in io_failed],
                unread=[k for k in job.moved if k in cancelled],
            )
            ok = [k for k in job.moved if k not in failed]
            self.stats.promotions_completed += len(ok)
            self.stats.load_errors += len(job.moved) - len(ok) - len(cancelled)
            self.stats.promotion_failures += len(job.keys) - len(ok)
            self._read_latencies.add(done.seconds)
            success = len(ok) == len(job.keys)
            results.append(
                JobResult(
                    done.job_id,
                    success,
                    successful_keys=None if success or not ok else tuple(ok),
                    transfer_time=done.seconds,
                    transfer_bytes=done.bytes,
                )
            )
        return results

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return m.metric_definitions(DISK_TIER_METRICS)

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """Gauges of the tier's occupancy, what each counter grew by since
        the last call, and the read latencies observed since. Scheduler's
        thread only."""
        tier, stats = self.tier, self.stats
        out = OffloadingConnectorStats()
        m.report_occupancy(out, tier, MEDIUM_DISK)
        totals: list[tuple[str, tuple[str, ...], float]] = [
            (m.EVICTIONS, _DISK, stats.evictions),
            (m.SPILLS, (), stats.stores_completed),
            (m.SPILL_FAILURES, (), stats.store_failures),
            (m.PROMOTIONS, (), stats.promotions_completed),
            (m.PROMOTION_FAILURES, (), stats.promotion_failures),
            (m.LOADED_BLOCKS, _DISK, stats.promotions_completed),
            (m.LOAD_ERRORS, (), stats.load_errors),
            (m.STORES_DECLINED, (), stats.stores_skipped_full),
            *m.read_failure_totals(self.core.failures),
        ]
        runtime = self.runtime
        if runtime is not None:
            out.set_gauge(m.DISK_STALLED, runtime.stalled_s(), ())
            t = runtime.totals
            self._io = [
                (m.READ_BYTES, _DISK, t.read_bytes),
                (m.READ_SECONDS, _DISK, t.read_seconds),
                (m.WRITE_BYTES, _DISK, t.write_bytes),
                (m.WRITE_SECONDS, _DISK, t.write_seconds),
                (m.CHECKSUM_FAILURES, (), runtime.checksum_failures()),
                (m.IO_ERRORS, (), runtime.io_errors()),
            ]
        m.report_counters(out, self._deltas, totals + self._io)
        self._read_latencies.observe(out, m.READ_LATENCY)
        return out

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._done or len(self._pull))

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        # Once per engine step: a warm restart's event naming every adopted
        # block goes out over several steps (EVENT_BACKLOG_PER_STEP).
        for ev in self._events.take(EVENT_BACKLOG_PER_STEP):
            yield OffloadingEvent(
                keys=list(ev.keys),
                medium=Medium.STORAGE,
                removed=ev.removed,
                locality=Locality.LOCAL,
                # Names this tier among several STORAGE tiers, and (every
                # block leaves with a BlockRemoved) keeps vLLM's
                # self-describing payload alive until that removal.
                ownership=self.tier_type,
                removal_expected=True,
            )

    @override
    def drain_jobs(self) -> None:
        """vLLM's reset (``TieringOffloadingManager.reset_cache``): the jobs
        not started yet are cancelled, as vLLM's contract allows (each comes
        back failed: a cascade's block is not stored, a promotion's is
        promoted again by a later lookup), and the batches being moved are
        waited for: waiting for the whole queue would hold the engine's step
        for as long as the drive takes to write a primary tier's worth of
        cascades. Cancelled transfers are neither read errors nor store
        failures (:meth:`get_finished_jobs`). The tier keeps its blocks
        (vLLM does not reset secondary tiers), but the blocks stored from
        now on may come from other weights (a sleep, a weight update), so
        no later engine adopts them (:meth:`DiskRuntime.mark_reset`).

        Under vLLM 0.32 its lookups then miss for ``reset_hold_steps``
        scheduler steps. The reset frees the primary rows of store jobs the
        workers run only at the next step's start (vLLM's flush); a disk hit
        promoted into such a row meanwhile was overwritten by the late store,
        and its request loaded another request's KV under its own keys
        (tests/tiering/test_tiering_e2e.py). vLLM 0.33 holds promotions
        itself until the flush is reported, and misses as this does."""
        if self.runtime is not None:
            self.runtime.cancel_queued()
            self.runtime.drain()
            self.runtime.mark_reset()
        if not VLLM_HOLDS_PROMOTIONS_AFTER_RESET:
            self._held_steps = self.reset_hold_steps

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # vLLM calls this after it submitted the step's promotions.
        self._hit_this_step.clear()
        if self._held_steps:
            self._held_steps -= 1

    @override
    def shutdown(self) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.shutdown()

