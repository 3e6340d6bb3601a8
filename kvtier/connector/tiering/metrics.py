"""The metrics of :class:`kvtier.connector.tiering.KvtierDiskTier`.

The tier counts into :class:`DiskTierStats`; :data:`DISK_TIER_METRICS`
names kvtier's series it declares to vLLM and :class:`DiskTierMetrics` turns the
counters' growth since the last call into vLLM's
``OffloadingConnectorStats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from kvtier.connector import metrics as m
from kvtier.connector.worker_report import CounterDeltas
from kvtier.tiers.events import MEDIUM_DISK

if TYPE_CHECKING:
    from kvtier.store.transfers import DiskRuntime
    from kvtier.tiers.disk_core import DiskTierCore

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
)
_DISK = (MEDIUM_DISK,)


@dataclass
class DiskTierStats:
    """Monotonic counters (the metrics diff them)."""

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


class DiskTierMetrics:
    """Turns the tier's cumulative counters into vLLM's
    ``OffloadingConnectorStats`` (``get_stats``): gauges of the tier's
    occupancy, for each counter what it grew by since the last call, and
    the read latencies observed since (``read_latencies``, one per
    promotion job). One per tier; ``collect`` is called from the
    scheduler's thread only."""

    def __init__(self) -> None:
        self._deltas = CounterDeltas()
        self.read_latencies = m.Samples()
        # The data path's totals as last seen: a shut-down tier (no
        # runtime) keeps reporting them, so no counter goes backwards.
        self._io: list[tuple[str, tuple[str, ...], float]] = []

    def collect(
        self,
        core: DiskTierCore,
        stats: DiskTierStats,
        runtime: DiskRuntime | None,
    ) -> OffloadingConnectorStats:
        tier = core.tier
        out = OffloadingConnectorStats()
        out.set_gauge(m.TIER_BLOCKS, len(tier), _DISK)
        out.set_gauge(m.TIER_CAPACITY, tier.capacity, _DISK)
        out.set_gauge(m.TIER_USAGE, len(tier) / tier.capacity, _DISK)
        totals: list[tuple[str, tuple[str, ...], float]] = [
            (m.EVICTIONS, _DISK, stats.evictions),
            (m.SPILLS, (), stats.stores_completed),
            (m.SPILL_FAILURES, (), stats.store_failures),
            (m.PROMOTIONS, (), stats.promotions_completed),
            (m.PROMOTION_FAILURES, (), stats.promotion_failures),
            (m.LOADED_BLOCKS, _DISK, stats.promotions_completed),
            (m.LOAD_ERRORS, (), stats.load_errors),
            (m.STORES_DECLINED, (), stats.stores_skipped_full),
            *m.read_failure_totals(core.failures),
        ]
        if runtime is not None:
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
        self.read_latencies.observe(out, m.READ_LATENCY)
        return out
