"""kvtier's Prometheus metrics, exported through vLLM's offloading connector.

vLLM creates the Prometheus series from :func:`metric_definitions` (via
``OffloadingSpec.build_metric_definitions``, or a secondary tier's in
tiering mode) and feeds them from the ``OffloadingConnectorStats`` that the
manager (tiering mode: the tier) returns from ``get_stats``. Per-tier
series carry a ``tier`` label (``cpu`` or ``disk``). Both modes feed the
same series where the concept exists (:func:`report_counters`,
:func:`read_failure_totals`, :class:`Samples`: the parts they share).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvtier.tiers.disk_core import MAX_READ_IO_ERRORS

if TYPE_CHECKING:
    from kvtier.connector.worker_report import CounterDeltas
    from kvtier.tiers.disk_core import ReadFailures
    from kvtier.tiers.tier import Tier

PREFIX = "vllm:kv_offload_kvtier_"
TIER = ("tier",)

TIER_USAGE = PREFIX + "tier_usage_perc"
TIER_BLOCKS = PREFIX + "tier_blocks"
TIER_CAPACITY = PREFIX + "tier_capacity_blocks"
READ_BYTES = PREFIX + "read_bytes"
READ_SECONDS = PREFIX + "read_seconds"
WRITE_BYTES = PREFIX + "write_bytes"
WRITE_SECONDS = PREFIX + "write_seconds"
EVICTIONS = PREFIX + "evictions"
SPILLS = PREFIX + "spills"
SPILL_FAILURES = PREFIX + "spill_failures"
PROMOTIONS = PREFIX + "promotions"
PROMOTION_FAILURES = PREFIX + "promotion_failures"
LOADED_BLOCKS = PREFIX + "loaded_blocks"
LOAD_ERRORS = PREFIX + "load_errors"
LOAD_IO_ERRORS = PREFIX + "load_io_errors"
CORRUPT_BLOCKS = PREFIX + "corrupt_blocks"
UNREADABLE_BLOCKS = PREFIX + "unreadable_blocks"
READ_LATENCY = PREFIX + "read_latency_seconds"
CHECKSUM_FAILURES = PREFIX + "checksum_failures"
IO_ERRORS = PREFIX + "io_errors"
STORES_DECLINED = PREFIX + "stores_declined"
WORKER_EXCEPTIONS = PREFIX + "worker_exceptions"
DISK_STALLED = PREFIX + "disk_stalled_seconds"

_DEFS: dict[str, OffloadingMetricMetadata] = {
    TIER_USAGE: OffloadingGaugeMetadata(
        "Fraction of the tier's blocks in use (0.0 - 1.0).", TIER
    ),
    TIER_BLOCKS: OffloadingGaugeMetadata("Blocks resident in the tier.", TIER),
    TIER_CAPACITY: OffloadingGaugeMetadata("Capacity of the tier in blocks.", TIER),
    READ_BYTES: OffloadingCounterMetadata(
        "Bytes read out of the tier (cpu: block bytes loaded into the KV "
        "cache; disk: the drive's traffic for loads, slot headers and "
        "payloads the workers read, a slot that then fails verification "
        "included; tiering mode: block bytes each rank read to promote into "
        "vLLM's primary tier).",
        TIER,
    ),
    READ_SECONDS: OffloadingCounterMetadata(
        "Seconds spent in disk-tier reads. Full spec: the workers' load "
        "threads waiting for reads (reads that overlap the previous batch's "
        "verification are not counted, so bytes per second here over-states "
        "the drive's rate; a whole load's time is vLLM's "
        "vllm:kv_offload_load_time). Tiering mode: promotion jobs, from "
        "submission to completion (queueing included).",
        TIER,
    ),
    WRITE_BYTES: OffloadingCounterMetadata(
        "Bytes written into the tier (cpu: stores from the GPU; disk: the "
        "block bytes of spills, in tiering mode of the blocks written to the "
        "disk tier, raw: before zstd and without the slot header, so unlike "
        "read_bytes not the drive's traffic; each rank's write counts, even "
        "where another rank's write of the same block failed).",
        TIER,
    ),
    WRITE_SECONDS: OffloadingCounterMetadata(
        "Seconds spent in disk-tier writes (queueing included); cpu-tier copy "
        "time is vLLM's vllm:kv_offload_store_time.",
        TIER,
    ),
    EVICTIONS: OffloadingCounterMetadata("Blocks evicted from the tier.", TIER),
    SPILLS: OffloadingCounterMetadata(
        "Blocks spilled CPU -> disk (tiering mode: written to the disk tier)."
    ),
    SPILL_FAILURES: OffloadingCounterMetadata(
        "Spills that failed (I/O error, disk full); the block stays CPU-only."
    ),
    PROMOTIONS: OffloadingCounterMetadata(
        "Disk blocks that a load also copied into the CPU tier (verified; "
        "tiering mode: every disk block loaded into vLLM's primary tier)."
    ),
    PROMOTION_FAILURES: OffloadingCounterMetadata(
        "Tiering mode: disk -> CPU copies that failed (I/O error, failed "
        "verification, or the block gone); a miss."
    ),
    LOADED_BLOCKS: OffloadingCounterMetadata(
        "Blocks loaded out of the tier, verified: into the KV cache (tiering "
        "mode: disk blocks promoted into vLLM's primary tier); a failed disk "
        "block is not counted, nor any block of a load that failed whole.",
        TIER,
    ),
    LOAD_ERRORS: OffloadingCounterMetadata(
        "Disk blocks a load could not use (I/O error, failed verification): "
        "reported to vLLM as load errors, their tokens recomputed."
    ),
    LOAD_IO_ERRORS: OffloadingCounterMetadata(
        "Disk blocks a load could not read because of an I/O error (any "
        "errno, a stalled read, a device's short read): the load failed, its "
        "tokens recomputed, and the block stayed on disk to be read again; "
        f"after {MAX_READ_IO_ERRORS} such reads in a row it is dropped "
        "(unreadable_blocks)."
    ),
    CORRUPT_BLOCKS: OffloadingCounterMetadata(
        "Disk copies dropped at once because a load found their bytes bad "
        "(checksum, header, key, layout, decoding)."
    ),
    UNREADABLE_BLOCKS: OffloadingCounterMetadata(
        f"Disk copies dropped after {MAX_READ_IO_ERRORS} reads in a row failed "
        "with an I/O error (a dead sector, a failing drive)."
    ),
    READ_LATENCY: OffloadingHistogramMetadata(
        "Seconds from issuing a batch of disk-tier reads to having it "
        "verified. Full spec: one read batch of a worker's load (up to a bounce "
        "part of slots, one read per run of adjacent slots). Tiering mode: one "
        "promotion job (its blocks read in parallel on the tier's I/O "
        "threads, queueing included).",
        buckets=(
            0.001,
            0.0025,
            0.005,
            0.01,
            0.025,
            0.05,
            0.1,
            0.25,
            0.5,
            1.0,
            2.5,
            5.0,
            10.0,
            15.0,
            30.0,
            60.0,
        ),
    ),
    CHECKSUM_FAILURES: OffloadingCounterMetadata(
        "Disk reads rejected by verification (checksum, header, key, "
        "truncation); each cost a miss, never data."
    ),
    IO_ERRORS: OffloadingCounterMetadata("Disk I/O errors (any errno)."),
    DISK_STALLED: OffloadingGaugeMetadata(
        "Seconds since the disk tier's I/O last answered a job (a spill or a "
        "promotion, done or failed) while some wait; 0 when none waits. "
        "Growing past seconds: a hung drive or mount (kvtier logs an ERROR "
        "once at 15 s); a write has no deadline of its own."
    ),
    STORES_DECLINED: OffloadingCounterMetadata(
        "Stores declined. Full spec: GPU -> CPU stores declined because no CPU "
        "room could be made without waiting for the disk. Tiering mode: blocks "
        "the disk tier did not store because every slot was being read or "
        "written."
    ),
    WORKER_EXCEPTIONS: OffloadingCounterMetadata(
        "Transfer jobs that raised an unexpected exception in a worker (a bug; "
        "logged with its traceback): the job failed whole, a load's tokens "
        "recomputed, a store's blocks not offloaded."
    ),
}


# Observations a histogram may hold between two ``get_stats`` calls: past
# that (nobody collects them, e.g. stats logging is off), the oldest go.
MAX_PENDING_SAMPLES = 4096


def metric_definitions(
    names: Iterable[str] | None = None,
) -> dict[str, OffloadingMetricMetadata]:
    """kvtier's series (for vLLM's ``build_metric_definitions``), or those
    of ``names`` (what a secondary tier feeds)."""
    return dict(_DEFS) if names is None else {name: _DEFS[name] for name in names}


Totals = Iterable[tuple[str, tuple[str, ...], float]]


def report_occupancy(stats: OffloadingConnectorStats, tier: Tier, medium: str) -> None:
    """The tier's occupancy gauges (blocks, capacity, usage), labelled
    ``medium``; an empty tier reports them too."""
    labels = (medium,)
    stats.set_gauge(TIER_BLOCKS, len(tier), labels)
    stats.set_gauge(TIER_CAPACITY, tier.capacity, labels)
    stats.set_gauge(TIER_USAGE, len(tier) / tier.capacity, labels)


def report_counters(
    stats: OffloadingConnectorStats, deltas: CounterDeltas, totals: Totals
) -> None:
    """Increase each counter ``(name, labels, cumulative total)`` of
    ``totals`` by what it grew since the last call. Every counter is
    reported from the first call on, at 0 if nothing happened yet, so its
    series exists before its first event (vLLM creates a labelled series at
    its first report; ``rate()`` and alerts need one)."""
    for name, labels, total in totals:
        key: Hashable = (name, labels)
        first = key not in deltas
        delta = deltas.delta(key, total)
        if delta or first:
            stats.increase_counter(name, delta, labels)


def read_failure_totals(failures: ReadFailures) -> list[tuple[str, tuple[str, ...], int]]:
    """The counters of the disk core's read-failure rule, for
    :func:`report_counters`."""
    return [
        (CORRUPT_BLOCKS, (), failures.corrupt),
        (UNREADABLE_BLOCKS, (), failures.unreadable),
        (LOAD_IO_ERRORS, (), failures.io_errors_kept),
    ]


class Samples:
    """Observations of a histogram waiting for the next ``get_stats``: added
    from any thread, at most ``MAX_PENDING_SAMPLES`` kept (the oldest go)."""

    def __init__(self) -> None:
        self._pending: deque[float] = deque(maxlen=MAX_PENDING_SAMPLES)

    def add(self, value: float) -> None:
        self._pending.append(value)

    def extend(self, values: Iterable[float]) -> None:
        self._pending.extend(values)

    def take(self) -> list[float]:
        """The observations since the last call (drains them; one thread
        takes, any may add meanwhile)."""
        pop = self._pending.popleft
        return [pop() for _ in range(len(self._pending))]

    def observe(self, stats: OffloadingConnectorStats, name: str) -> None:
        """Record the pending observations as histogram ``name``."""
        for value in self.take():
            stats.observe_histogram(name, value)
