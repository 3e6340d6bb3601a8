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
CHECKSUM_FAILURES = PREFIX + "checksum_failures"
IO_ERRORS = PREFIX + "io_errors"
STORES_DECLINED = PREFIX + "stores_declined"

_DEFS: dict[str, OffloadingMetricMetadata] = {
    TIER_USAGE: OffloadingGaugeMetadata(
        "Fraction of the tier's blocks in use (0.0 - 1.0).", TIER
    ),
    TIER_BLOCKS: OffloadingGaugeMetadata("Blocks resident in the tier.", TIER),
    TIER_CAPACITY: OffloadingGaugeMetadata("Capacity of the tier in blocks.", TIER),
    READ_BYTES: OffloadingCounterMetadata(
        "Bytes read out of the tier (cpu: loads into the GPU; disk: promotions).",
        TIER,
    ),
    READ_SECONDS: OffloadingCounterMetadata(
        "Seconds spent in disk-tier reads (queueing included); cpu-tier copy "
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
    PROMOTIONS: OffloadingCounterMetadata("Blocks promoted disk -> CPU."),
    PROMOTION_FAILURES: OffloadingCounterMetadata(
        "Promotions that failed (I/O error, checksum or header mismatch); a miss."
    ),
    CHECKSUM_FAILURES: OffloadingCounterMetadata(
        "Disk reads rejected by the checksum; each cost a miss, never data."
    ),
    IO_ERRORS: OffloadingCounterMetadata("Disk I/O errors (any errno)."),
    STORES_DECLINED: OffloadingCounterMetadata(
        "GPU -> CPU stores declined because no CPU room could be made without "
        "waiting for the disk."
    ),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return dict(_DEFS)
