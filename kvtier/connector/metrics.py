"""kvtier's Prometheus metrics, exported through vLLM's offloading connector.

vLLM creates the Prometheus series from :func:`metric_definitions` (via
``OffloadingSpec.build_metric_definitions``) and feeds them from the
``OffloadingConnectorStats`` that the manager returns from ``get_stats``.
Per-tier series carry a ``tier`` label (``cpu`` or ``disk``).
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

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
CORRUPT_BLOCKS = PREFIX + "corrupt_blocks"
CHECKSUM_FAILURES = PREFIX + "checksum_failures"
IO_ERRORS = PREFIX + "io_errors"
STORES_DECLINED = PREFIX + "stores_declined"
WORKER_EXCEPTIONS = PREFIX + "worker_exceptions"

_DEFS: dict[str, OffloadingMetricMetadata] = {
    TIER_USAGE: OffloadingGaugeMetadata(
        "Fraction of the tier's blocks in use (0.0 - 1.0).", TIER
    ),
    TIER_BLOCKS: OffloadingGaugeMetadata("Blocks resident in the tier.", TIER),
    TIER_CAPACITY: OffloadingGaugeMetadata("Capacity of the tier in blocks.", TIER),
    READ_BYTES: OffloadingCounterMetadata(
        "Bytes loaded out of the tier into the KV cache (disk: verified slot "
        "bytes the workers read).",
        TIER,
    ),
    READ_SECONDS: OffloadingCounterMetadata(
        "Seconds the workers' load threads waited for disk-tier reads (reads "
        "that overlap the previous batch's verification are not counted, so "
        "bytes per second here over-states the drive's rate); a whole load's "
        "time is vLLM's vllm:kv_offload_load_time.",
        TIER,
    ),
    WRITE_BYTES: OffloadingCounterMetadata(
        "Bytes written into the tier (cpu: stores from the GPU; disk: spills).",
        TIER,
    ),
    WRITE_SECONDS: OffloadingCounterMetadata(
        "Seconds spent in disk-tier writes (queueing included); cpu-tier copy "
        "time is vLLM's vllm:kv_offload_store_time.",
        TIER,
    ),
    EVICTIONS: OffloadingCounterMetadata("Blocks evicted from the tier.", TIER),
    SPILLS: OffloadingCounterMetadata("Blocks spilled CPU -> disk."),
    SPILL_FAILURES: OffloadingCounterMetadata(
        "Spills that failed (I/O error, disk full); the block stays CPU-only."
    ),
    PROMOTIONS: OffloadingCounterMetadata(
        "Disk blocks that a load also copied into the CPU tier (verified)."
    ),
    PROMOTION_FAILURES: OffloadingCounterMetadata(
        "Tiering mode: disk -> CPU copies that failed (I/O error, failed "
        "verification); a miss."
    ),
    LOADED_BLOCKS: OffloadingCounterMetadata(
        "Blocks loaded into the KV cache from the tier (a failed disk block is "
        "not counted).",
        TIER,
    ),
    LOAD_ERRORS: OffloadingCounterMetadata(
        "Disk blocks a load could not use (I/O error, failed verification): "
        "reported to vLLM as load errors, their tokens recomputed."
    ),
    CORRUPT_BLOCKS: OffloadingCounterMetadata(
        "Disk copies dropped from the index because they failed verification."
    ),
    CHECKSUM_FAILURES: OffloadingCounterMetadata(
        "Disk reads rejected by verification (checksum, header, key, "
        "truncation); each cost a miss, never data."
    ),
    IO_ERRORS: OffloadingCounterMetadata("Disk I/O errors (any errno)."),
    STORES_DECLINED: OffloadingCounterMetadata(
        "GPU -> CPU stores declined because no CPU room could be made without "
        "waiting for the disk."
    ),
    WORKER_EXCEPTIONS: OffloadingCounterMetadata(
        "Transfer jobs that raised an unexpected exception in a worker (a bug; "
        "logged with its traceback): the job failed whole, a load's tokens "
        "recomputed, a store's blocks not offloaded."
    ),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return dict(_DEFS)
