"""The metrics of :class:`kvtier.connector.tiering.KvtierDiskTier`.

The tier counts into :class:`DiskTierStats`; :func:`metric_definitions`
declares kvtier's series to vLLM and :class:`DiskTierMetrics` turns the
counters' growth since the last call into vLLM's
``OffloadingConnectorStats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingMetricMetadata

from kvtier.connector import metrics as m
from kvtier.connector.worker_report import CounterDeltas
from kvtier.tiers.events import MEDIUM_DISK

if TYPE_CHECKING:
    from kvtier.connector.tiering.rows import PrimaryViewRuntime
    from kvtier.tiers.tier import Tier

# kvtier's metric series this tier feeds (tier label "disk"); vLLM's tiering
# manager already exports read/write bytes and time per tier type.
_METRICS = (
    m.TIER_USAGE,
    m.TIER_BLOCKS,
    m.TIER_CAPACITY,
    m.EVICTIONS,
    m.SPILLS,
    m.SPILL_FAILURES,
    m.PROMOTIONS,
    m.PROMOTION_FAILURES,
    m.CHECKSUM_FAILURES,
    m.IO_ERRORS,
)
_DISK = (MEDIUM_DISK,)


@dataclass
class DiskTierStats:
    """Monotonic counters (the metrics diff them)."""

    stores_submitted: int = 0
    stores_completed: int = 0
    store_failures: int = 0
    stores_skipped_full: int = 0
    promotions_completed: int = 0
    promotion_failures: int = 0
    evictions: int = 0
    restored: int = 0
    # Blocks another secondary tier supplied, stored here too (pull.py).
    pulled: int = 0


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """kvtier's series this tier feeds (``build_metric_definitions``)."""
    defs = m.metric_definitions()
    return {name: defs[name] for name in _METRICS}


class DiskTierMetrics:
    """Turns the tier's cumulative counters into vLLM's
    ``OffloadingConnectorStats`` (``get_stats``): gauges of the tier's
    occupancy and, for each counter, what it grew by since the last call.
    One per tier; called from the scheduler's thread only."""

    def __init__(self) -> None:
        self._deltas = CounterDeltas()

    def collect(
        self,
        tier: Tier,
        stats: DiskTierStats,
        runtime: PrimaryViewRuntime | None,
    ) -> OffloadingConnectorStats:
        out = OffloadingConnectorStats()
        out.set_gauge(m.TIER_BLOCKS, len(tier), _DISK)
        out.set_gauge(m.TIER_CAPACITY, tier.capacity, _DISK)
        out.set_gauge(m.TIER_USAGE, len(tier) / tier.capacity, _DISK)
        checksum_failures = io_errors = 0
        if runtime is not None:
            checksum_failures = runtime.checksum_failures()
            io_errors = runtime.io_errors()
        totals: list[tuple[str, tuple[str, ...], int]] = [
            (m.EVICTIONS, _DISK, stats.evictions),
            (m.SPILLS, (), stats.stores_completed),
            (m.SPILL_FAILURES, (), stats.store_failures),
            (m.PROMOTIONS, (), stats.promotions_completed),
            (m.PROMOTION_FAILURES, (), stats.promotion_failures),
            (m.CHECKSUM_FAILURES, (), checksum_failures),
            (m.IO_ERRORS, (), io_errors),
        ]
        for name, labels, total in totals:
            delta = self._deltas.delta((name, labels), total)
            if delta:
                out.increase_counter(name, delta, labels)
        return out
