"""The metrics of :class:`kvtier.connector.tiering.KvtierDiskTier`.

The tier counts into :class:`DiskTierStats`; :class:`DiskTierMetrics` (a
mixin of the tier) declares kvtier's series to vLLM and turns the counters'
differences since the last call into vLLM's ``OffloadingConnectorStats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingMetricMetadata

from kvtier.connector import metrics as m

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
_DISK = ("disk",)


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
    # Blocks another secondary tier supplied, stored here too (tiering_pull).
    pulled: int = 0


class DiskTierMetrics:
    """``build_metric_definitions``/``get_stats`` of the tier (a mixin: the
    tier sets the state declared below)."""

    if TYPE_CHECKING:
        tier: Tier
        stats: DiskTierStats
        runtime: PrimaryViewRuntime | None
        _last_metrics: tuple[DiskTierStats, int, int]

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs = m.metric_definitions()
        return {name: defs[name] for name in _METRICS}

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        out = OffloadingConnectorStats()
        tier = self.tier
        out.set_gauge(m.TIER_BLOCKS, len(tier), _DISK)
        out.set_gauge(m.TIER_CAPACITY, tier.capacity, _DISK)
        out.set_gauge(m.TIER_USAGE, len(tier) / tier.capacity, _DISK)
        now = self.stats
        checks = (0, 0)
        if self.runtime is not None:
            checks = (self.runtime.checksum_failures(), self.runtime.io_errors())
        last, last_sum, last_io = self._last_metrics
        self._last_metrics = (DiskTierStats(**vars(now)), *checks)

        def counter(name: str, delta: int, labels: tuple[str, ...] = ()) -> None:
            if delta:
                out.increase_counter(name, delta, labels)

        counter(m.EVICTIONS, now.evictions - last.evictions, _DISK)
        counter(m.SPILLS, now.stores_completed - last.stores_completed)
        counter(m.SPILL_FAILURES, now.store_failures - last.store_failures)
        counter(m.PROMOTIONS, now.promotions_completed - last.promotions_completed)
        counter(m.PROMOTION_FAILURES, now.promotion_failures - last.promotion_failures)
        counter(m.CHECKSUM_FAILURES, checks[0] - last_sum)
        counter(m.IO_ERRORS, checks[1] - last_io)
        return out
