"""Reference points for the offline optimum, for tests and benchmarks.

:func:`brute_force_hits` is the exhaustive optimum that
``tests/tiers/test_optimum.py`` holds :func:`kvtier.tiers.optimum.optimal_hits`
to. :func:`optimal_hits_by_reuse_distance` breaks the optimum's hits down by
reuse distance (``benchmarks/optimum_anatomy.py``). The clairvoyant caches
bound two families of online policies, not every policy: how much of the gap
to the optimum *admission* and *frequency ranking* could close even if they
were told the future (``benchmarks/hit_rate.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from kvtier.tiers.optimum import NEVER, belady_hit_counts, leading_hits, next_uses


def optimal_hits_by_reuse_distance(
    requests: Sequence[Sequence[Hashable]], capacity: int, edges: Sequence[float]
) -> tuple[list[int], list[int]]:
    """Where the optimum's hits come from: every reuse of a block (a block
    seen in an earlier request) binned by its *reuse distance*, the blocks
    requested in between (after the block's previous request, before this
    one), at bin edges ``edges`` (ascending; bin i is ``[edges[i-1],
    edges[i])``, the last bin open-ended). Returns (optimum's hits, all
    reuses) per bin; the hits sum to :func:`optimal_hits`.

    An LRU cache of ``capacity`` blocks hits (about) the reuses closer than
    ``capacity``; what the optimum gets beyond that is what an online
    policy can only get by guessing which blocks come back."""
    from bisect import bisect_right

    counts = belady_hit_counts(requests, capacity)
    hits = [0] * (len(edges) + 1)
    reuses = [0] * (len(edges) + 1)
    last: dict[Hashable, int] = {}  # key -> blocks requested up to its last use
    done = 0  # blocks of all earlier requests
    for keys, n in zip(requests, counts):
        for i, k in enumerate(keys):
            prev = last.get(k)
            if prev is not None:
                b = bisect_right(edges, done - prev)
                reuses[b] += 1
                hits[b] += i < n
        done += len(keys)
        for k in keys:
            last[k] = done
    return hits, reuses


def brute_force_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Exhaustive optimum (every choice of blocks to keep after every
    request); exponential, for tests on tiny traces only."""
    from functools import cache
    from itertools import combinations

    reqs = [tuple(r) for r in requests]

    @cache
    def best(t: int, cache: frozenset) -> int:
        if t == len(reqs):
            return 0
        keys = reqs[t]
        n = leading_hits(keys, cache)
        pool = sorted(cache | set(keys), key=repr)
        out = 0
        for size in range(min(capacity, len(pool)) + 1):
            for keep in combinations(pool, size):
                out = max(out, best(t + 1, frozenset(keep)))
        return n + out

    return best(0, frozenset())


def oracle_admission_lru_hits(
    requests: Sequence[Sequence[Hashable]], capacity: int
) -> int:
    """Prefix hits of an LRU cache (a request's head ranked newest) that
    stores a block only if some later request uses it again: the most an
    admission filter in front of LRU can get."""
    from collections import OrderedDict

    next_use = next_uses(requests)
    lru: OrderedDict[Hashable, None] = OrderedDict()
    hits = 0
    for t, keys in enumerate(requests):
        n = leading_hits(keys, lru)
        hits += n
        for k, nu in zip(reversed(keys), reversed(next_use[t])):
            if k in lru:
                lru.move_to_end(k)
            elif nu != NEVER:
                lru[k] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits


def static_frequency_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Prefix hits of a cache that holds, once seen, exactly the
    ``capacity`` blocks used most often in the whole trace: perfect
    knowledge of popularity, none of timing (what frequency-ranked
    policies such as LFU or TinyLFU estimate)."""
    from collections import Counter

    counts = Counter(k for keys in requests for k in keys)
    # Ties: a parent is counted at least as often as its child, so taking
    # shallower blocks first keeps the chosen set prefix-closed.
    depth: dict[Hashable, int] = {}
    for keys in requests:
        for d, k in enumerate(keys):
            depth.setdefault(k, d)
    chosen = set(
        sorted(counts, key=lambda k: (-counts[k], depth[k]))[: max(capacity, 0)]
    )
    seen: set[Hashable] = set()
    hits = 0
    for keys in requests:
        for k in keys:
            if k not in chosen or k not in seen:
                break
            hits += 1
        seen.update(keys)
    return hits


def rate_oracle_hits(
    requests: Sequence[Sequence[Hashable]],
    capacity: int,
    *,
    knows_last_use: bool = False,
) -> int:
    """Prefix hits of a cache that ranks blocks by their true reuse *rate*:
    a block used by ``n`` requests between request ``first`` and ``last``
    is worth ``(n - 1) / (last - first)`` (0 if ``n == 1``), and the cache
    evicts the lowest worth, then the least recently used, deepest first.
    A block is worth no more than its parent in the same request (its hits
    need the parent), so the ranking stays prefix-closed.

    This is the optimal policy when requests arrive independently at known
    rates (the independent reference model, Coffman & Denning's A0), told
    each block's rate over its lifetime: perfect popularity *and* perfect
    admission, but no knowledge of when the next request comes. With
    ``knows_last_use`` it is also told when a block is used for the last
    time (its worth drops to 0 then): a perfect dead-block predictor on
    top. The gap between the two is what only a prediction of *which*
    blocks are finished could add."""
    first: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    count: dict[Hashable, int] = {}
    for t, keys in enumerate(requests):
        for k in set(keys):
            first.setdefault(k, t)
            last[k] = t
            count[k] = count.get(k, 0) + 1
    rate = {
        k: (n - 1) / (last[k] - first[k]) if n > 1 else 0.0 for k, n in count.items()
    }
    cached: dict[Hashable, tuple[float, int, int]] = {}  # key -> eviction rank
    heap: list[tuple[tuple[float, int, int], int, Hashable]] = []
    tick = 0  # heap tie-break that never compares keys
    hits = 0
    for t, keys in enumerate(requests):
        n = leading_hits(keys, cached)
        hits += n
        worth = float("inf")
        for depth, k in enumerate(keys):
            own = 0.0 if knows_last_use and last[k] == t else rate[k]
            worth = min(worth, own)
            rank = (worth, t, -depth)
            cached[k] = rank
            tick += 1
            heapq.heappush(heap, (rank, tick, k))
        while len(cached) > capacity:
            rank, _, k = heapq.heappop(heap)
            if cached.get(k) == rank:
                del cached[k]
        if len(heap) > 4 * len(cached) + 1024:
            heap = [(r, i, k) for i, (k, r) in enumerate(cached.items())]
            heapq.heapify(heap)
            tick = len(heap)
    return hits
