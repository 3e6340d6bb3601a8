"""Keep locally what a lower secondary tier supplied (``KvtierDiskTier``).

vLLM's ``TieringOffloadingManager`` asks the secondary tiers in list order
and promotes from the first one that hits, straight into the primary (CPU)
tier. It never cascades a promoted block to the *other* secondary tiers:
the cascade runs only when a GPU -> primary store completes. So with
``secondary_tiers = [KvtierDiskTier (local NVMe), fs (shared directory)]`` a
block fetched from the shared tier would be fetched from it again next time.

:class:`PullBack` closes that gap with vLLM's own hook for a tier that
wants blocks it was not sent, ``serve_external_requests(parent)``:

1. ``KvtierDiskTier.lookup`` notes every key it misses (and does not hold).
   Because it is asked first, that covers every key a later tier then
   supplies.
2. Once per step, ``serve`` asks the manager through ``parent`` where each
   noted key is, with a request whose tier filter admits no secondary tier,
   so only the primary tier answers (no lookup or promotion is started in
   another tier). ``HIT``: the block is in the primary tier now, and
   ``parent.create_store_job`` pins it there for a store into this tier,
   exactly like a cascade. ``HIT_PENDING``: its promotion is still in
   flight, so ask again next step (up to :data:`PATIENCE_S`). ``MISS``:
   nobody supplied it (a fresh block, which reaches this tier through the
   normal cascade once computed), so forget it.
3. The store goes through this tier's back-pressure as a cascade does
   (vLLM's ``_should_store_to_tier``): under pressure it is dropped.

Bounded: at most :data:`LIMIT` noted keys (the oldest are dropped), and each
is given up after :data:`PATIENCE_S`. Costs one primary-tier dict lookup per
noted key per step; the extra queries show in vLLM's tiering lookup metrics.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    TierFilter,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

# Admits no secondary tier: the manager's lookup then asks the primary only.
PRIMARY_ONLY = TierFilter(matchers=())
# Noted keys kept at most, and seconds a key's promotion is waited for.
LIMIT = 8192
PATIENCE_S = 30.0

_ids = itertools.count()


class PullBack:
    """Noted misses of one tier, turned into store jobs once another tier
    has brought the block into the primary tier (see module doc)."""

    def __init__(self) -> None:
        self._noted: OrderedDict[OffloadKey, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._noted)

    def note(self, key: OffloadKey) -> None:
        """A lookup of ``key`` missed in this tier."""
        if key in self._noted:
            return
        self._noted[key] = time.monotonic()
        if len(self._noted) > LIMIT:
            self._noted.popitem(last=False)

    def serve(
        self,
        parent: ParentManager,
        held: Callable[[OffloadKey], bool],
        admit: Callable[[int], bool],
    ) -> TransferJob | None:
        """One step: a store job (pinned in the primary tier) for the noted
        keys that are ready there now and not ``held`` by this tier yet,
        if ``admit`` takes that many blocks (the tier's back-pressure, as
        vLLM asks it before a cascade: refused, they are not kept)."""
        if not self._noted:
            return None
        ctx = ReqContext(
            req_id=f"kvtier-pull-{next(_ids)}", load_tier_filter=PRIMARY_ONLY
        )
        parent.on_new_request(ctx)
        ready: list[OffloadKey] = []
        now = time.monotonic()
        try:
            for key, since in list(self._noted.items()):
                if held(key):
                    del self._noted[key]
                    continue
                result = parent.lookup(key, ctx)
                if result is LookupResult.HIT:
                    ready.append(key)
                elif result is LookupResult.HIT_PENDING and now - since < PATIENCE_S:
                    continue
                del self._noted[key]
            job = (
                parent.create_store_job(ready, ctx)
                if ready and admit(len(ready))
                else None
            )
        finally:
            parent.on_request_finished(ctx)
        return job

    def clear(self) -> None:
        self._noted.clear()
