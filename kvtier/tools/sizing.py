"""Trace-driven sizing of the CPU and disk tiers (``kvtier size``).

Replays a Mooncake-format trace (read by :mod:`kvtier.tools.trace`, which
defines the format and the infinite-cache bound) through the real
:class:`~kvtier.tiers.hierarchy.TierHierarchy`, as the plugin's
scheduler side would drive it, with every spill and load completing
instantly. Only the offload tiers are modelled: every block of every request
is looked up in CPU/disk (the GPU prefix cache is not simulated).

Hit rate is block-level: hit blocks / all blocks of all requests. The
every-policy comparison against the offline optimum is
:mod:`kvtier.tools.sizing_compare`.

No vLLM import; pure Python on top of :mod:`kvtier.tiers`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency
from kvtier.tools.trace import (
    TOKENS_PER_TRACE_BLOCK,
    TraceRequest,
    infinite_cache_hit_rate,
    request_keys,
    unique_blocks,
)

DEFAULT_TARGET_FRACTION = 0.95

Progress = Callable[[int], None]


@dataclass
class SizingResult:
    """Outcome of one replay. Rates are fractions of ``blocks``."""

    cpu_blocks: int
    disk_blocks: int
    cpu_policy: str
    disk_policy: str
    spill_watermark: float
    promote_on_hit: bool = True
    requests: int = 0
    blocks: int = 0
    hit_blocks_cpu: int = 0
    hit_blocks_disk: int = 0
    infinite_hit_rate: float = 0.0
    # Store batches refused even after completing the pending spills, and
    # the new blocks they would have stored (a later request misses them).
    stores_declined: int = 0
    blocks_not_stored: int = 0
    spills: int = 0
    promotions: int = 0
    cpu_evictions: int = 0
    disk_evictions: int = 0

    @property
    def hit_blocks(self) -> int:
        return self.hit_blocks_cpu + self.hit_blocks_disk

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_cpu(self) -> float:
        return self.hit_blocks_cpu / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_disk(self) -> float:
        return self.hit_blocks_disk / self.blocks if self.blocks else 0.0

    @property
    def fraction_of_bound(self) -> float:
        """hit_rate / infinite_hit_rate (1.0 when the bound is 0)."""
        if self.infinite_hit_rate <= 0:
            return 1.0
        return self.hit_rate / self.infinite_hit_rate

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            hit_rate_cpu=self.hit_rate_cpu,
            hit_rate_disk=self.hit_rate_disk,
            hit_blocks=self.hit_blocks,
            fraction_of_bound=self.fraction_of_bound,
        )
        return d


class TraceReplayer:
    """Drives one :class:`TierHierarchy` request by request.

    Each phase is a method so benchmarks can time them separately; ``replay``
    runs them in order. I/O is instant: every spill order and every load is
    completed as soon as the hierarchy hands it out.
    """

    def __init__(self, hierarchy: TierHierarchy):
        self.h = hierarchy
        disk = hierarchy.disk
        self.result = SizingResult(
            cpu_blocks=hierarchy.cpu.capacity,
            disk_blocks=disk.capacity if disk is not None else 0,
            cpu_policy=hierarchy.cpu.policy.name,
            disk_policy=disk.policy.name if disk is not None else "lru",
            spill_watermark=hierarchy.spill_watermark,
        )
        self._seen: set[Hashable] = set()
        self._infinite_hits = 0

    # -- phases ---------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> tuple[int, list[Hashable]]:
        """Prefix lookup: the number of leading keys ready in some tier, and
        those of them only on disk."""
        lookup = self.h.lookup
        n = 0
        on_disk: list[Hashable] = []
        for key in keys:
            r = lookup(key)
            if r is Residency.HIT_CPU:
                n += 1
            elif r is Residency.HIT_DISK:
                n += 1
                on_disk.append(key)
            else:
                break
        return n, on_disk

    def load(self, keys: Sequence[Hashable]) -> None:
        """Pin and release the hit blocks (loading them to the GPU); disk
        hits are read in place and copied up into free CPU rows, as the
        plugin's workers do."""
        if keys:
            plan = self.h.prepare_load(keys)
            self.h.complete_load(plan.load_id)

    def store(self, keys: Sequence[Hashable]) -> None:
        """Offer the computed blocks for storing, in CPU-sized batches (a
        larger store can never succeed in one call)."""
        step = self.h.cpu.capacity
        for i in range(0, len(keys), step):
            batch = keys[i : i + step]
            plan = self.h.prepare_store(batch)
            if plan is None:
                # Declined while dirty blocks wait for their spill: let the
                # spills finish (instant I/O) and retry once.
                self.drain_spills()
                plan = self.h.prepare_store(batch)
            if plan is None:
                self.result.stores_declined += 1
                self.result.blocks_not_stored += sum(
                    1 for k in batch if not self.h.lookup(k).is_hit
                )
                continue
            if plan.keys_to_store:
                self.h.complete_store(plan.keys_to_store)
            self.drain_spills()

    def drain_spills(self) -> None:
        for order in self.h.take_spills():
            self.h.complete_spill(order.job_id)

    # -- driver ---------------------------------------------------------------

    def replay(self, keys: Sequence[Hashable]) -> None:
        """One request: lookup, load the hits (CPU or disk), store the rest."""
        res = self.result
        n, disk_keys = self.lookup(keys)
        hits = keys[:n]
        self.load(hits)
        self.store(keys[n:])

        res.requests += 1
        res.blocks += len(keys)
        res.hit_blocks_disk += len(disk_keys)
        res.hit_blocks_cpu += n - len(disk_keys)
        seen = self._seen
        self._infinite_hits += sum(1 for k in keys if k in seen)
        seen.update(keys)

    def finish(self) -> SizingResult:
        res = self.result
        stats = self.h.stats
        res.spills = stats.spills_completed
        res.promotions = stats.promotions_completed
        res.cpu_evictions = stats.cpu_evictions
        res.disk_evictions = stats.disk_evictions
        res.infinite_hit_rate = self._infinite_hits / res.blocks if res.blocks else 0.0
        return res


def replay_trace(
    requests: Iterable[TraceRequest | Sequence[Hashable]],
    cpu_blocks: int,
    disk_blocks: int,
    cpu_policy: str = "lru",
    disk_policy: str = "lru",
    spill_watermark: float = 0.75,
    *,
    promote_on_hit: bool = True,
    progress: Progress | None = None,
) -> SizingResult:
    """Replay ``requests`` through a fresh ``TierHierarchy`` and count hits.

    Per request: prefix lookup (a hit block is credited to ``cpu`` when
    ``lookup`` says HIT_CPU, to ``disk`` when HIT_DISK), load of the hits
    (disk hits also copied into free CPU rows, unless ``promote_on_hit`` is
    False, as the engine's key of that name), store of the remaining
    blocks.
    ``progress`` is called with 1 after each request.

    A tier that can hold every block of the trace never evicts, so any
    larger one gets the same hits: it is replayed at the trace's block count
    and reported at the size given (only the spill count of such a CPU tier
    can differ). Without this, a size like 2 TiB at a mistyped 1 byte per
    token (2**32 blocks) overflowed, or its 2q/arcdk doorkeeper took
    ~200 GiB. (The count, not the distinct blocks: it costs a length per
    request, where a set of the trace's blocks would cost each replay of a
    sweep a pass over them.)
    """
    if not isinstance(requests, Sequence):
        requests = list(requests)  # read twice: once for the cap
    cap = max(1, sum(len(request_keys(r)) for r in requests))
    h = TierHierarchy(
        min(cpu_blocks, cap),
        min(disk_blocks, cap),
        cpu_policy=cpu_policy,
        disk_policy=disk_policy,
        spill_watermark=spill_watermark,
        promote_on_hit=promote_on_hit,
    )
    rep = TraceReplayer(h)
    rep.result.disk_policy = disk_policy
    rep.result.promote_on_hit = promote_on_hit
    for req in requests:
        rep.replay(request_keys(req))
        if progress is not None:
            progress(1)
    result = rep.finish()
    result.cpu_blocks, result.disk_blocks = cpu_blocks, disk_blocks
    return result


# ----------------------------------------------------------------- sizing


def bytes_per_block(bytes_per_token: int) -> int:
    """Bytes of one trace block."""
    return bytes_per_token * TOKENS_PER_TRACE_BLOCK


@dataclass
class Recommendation:
    """Smallest disk tier (for a given CPU tier) reaching ``target_fraction``
    of the infinite-cache hit rate; ``disk_blocks`` is None if the bound
    cannot be reached (it always can with disk >= the trace's unique blocks,
    unless stores are declined)."""

    cpu_blocks: int
    target_fraction: float
    target_hit_rate: float
    infinite_hit_rate: float
    disk_blocks: int | None
    hit_rate: float | None
    unique_blocks: int
    bytes_per_block: int | None = None
    evaluated: list[SizingResult] = field(default_factory=list)

    @property
    def disk_bytes(self) -> int | None:
        if self.disk_blocks is None or self.bytes_per_block is None:
            return None
        return self.disk_blocks * self.bytes_per_block

    def to_dict(self) -> dict[str, Any]:
        """The fields, ``disk_bytes``, and of each evaluated replay only its
        disk size and hit rate (by disk size)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(
            disk_bytes=self.disk_bytes,
            evaluated=[
                {"disk_blocks": r.disk_blocks, "hit_rate": r.hit_rate}
                for r in sorted(self.evaluated, key=lambda r: r.disk_blocks)
            ],
        )
        return d


def recommend_disk_blocks(
    requests: Sequence[TraceRequest],
    cpu_blocks: int,
    replay: Callable[[int], SizingResult],
    target_fraction: float = DEFAULT_TARGET_FRACTION,
    *,
    tolerance: float = 0.02,
    bytes_per_token: int | None = None,
    progress: Progress | None = None,
) -> Recommendation:
    """Sweep disk capacities to find the smallest reaching the target.

    ``replay(disk_blocks)`` replays ``requests`` with a CPU tier of
    ``cpu_blocks`` (policies and watermark fixed) and a disk tier of that
    size; ``progress`` is called with 1 after each replay. Doubles the disk
    tier from ``cpu_blocks`` until the target is met (or the disk holds
    every unique block), then bisects between the last miss and the first
    success until they are within ``tolerance`` (relative) of each other.
    Assumes the hit rate grows with disk capacity, which holds for these
    policies up to small non-monotonic wiggles.
    """
    if not 0 < target_fraction <= 1:
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction}")
    runs: dict[int, SizingResult] = {}

    def run(disk: int) -> SizingResult:
        if disk not in runs:
            runs[disk] = replay(disk)
            if progress is not None:
                progress(1)
        return runs[disk]

    n_unique = unique_blocks(requests)
    bound = infinite_cache_hit_rate(requests)
    target = target_fraction * bound

    def ok(r: SizingResult) -> bool:
        return r.hit_rate >= target - 1e-12

    lo, hi = 0, None
    if ok(run(0)):
        hi = 0
    else:
        disk = max(1, cpu_blocks)
        while True:
            if ok(run(disk)):
                hi = disk
                break
            lo = disk
            if disk >= n_unique:
                break
            disk = min(2 * disk, max(n_unique, 1))
    if hi is not None and hi > 0:
        while hi - lo > max(1, int(tolerance * hi)):
            mid = (lo + hi) // 2
            if ok(run(mid)):
                hi = mid
            else:
                lo = mid
    return Recommendation(
        cpu_blocks=cpu_blocks,
        target_fraction=target_fraction,
        target_hit_rate=target,
        infinite_hit_rate=bound,
        disk_blocks=hi,
        hit_rate=None if hi is None else runs[hi].hit_rate,
        unique_blocks=n_unique,
        bytes_per_block=bytes_per_block(bytes_per_token) if bytes_per_token else None,
        evaluated=list(runs.values()),
    )


def default_sweep_sizes(cpu_blocks: int, disk_blocks: int, n_unique: int) -> list[int]:
    """Disk sizes for a hit-rate-vs-disk plot: 0, powers of two times the
    CPU tier up to the trace's unique blocks, and the configured size."""
    sizes = {0, disk_blocks}
    mult = 1
    while True:
        d = int(cpu_blocks * mult)
        if d >= n_unique:
            sizes.add(n_unique)
            break
        if d > 0:
            sizes.add(d)
        mult *= 2
    return sorted(sizes)
