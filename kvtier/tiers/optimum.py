"""The offline optimum of a prefix cache on a known trace (Belady's MIN).

A request is a list of prefix-hash keys (a key covers its block and every
block before it); a block is a *hit* when it and every block before it in
the request are cached (the leading run). After a request the cache may
keep any of the blocks it holds or just saw, up to its capacity; blocks are
never fetched except by a request. The optimum keeps the blocks whose next
use is nearest: after each request, while over capacity, it drops the block
used farthest in the future (never again first), and among blocks next used
by the same request the deepest one, so a cached block's parent is always
cached too and every cached block of a request is a hit.

Why that is optimal: the hits of a prefix cache are at most those of a
plain cache of the same blocks (a hit needs the block cached), and serving a
request's blocks one after another turns the problem into classic paging
with the option not to cache (bypass), where evicting the farthest next use
is optimal (Belady 1966; Mattson et al. 1970). The deepest-first tie-break
keeps the cache prefix-closed (a child's next use is never before its
parent's: every request holding the child holds the parent), so the plain
cache's hits are all prefix hits and the bound is reached.
``tests/tiers/test_optimum.py`` checks it against exhaustive search.

Two tiers can never beat one tier of their total capacity holding the
same blocks, so ``optimal_hits(trace, cpu + disk)`` bounds any two-tier
configuration. Cost: O(B log B) for B blocks in the trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Hashable, Sequence

NEVER = float("inf")


def _next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[float]]:
    """For each request and position, the index of the next request that
    holds the same key (``NEVER`` if none)."""
    nxt: dict[Hashable, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for t in range(len(requests) - 1, -1, -1):
        row = [nxt.get(k, NEVER) for k in requests[t]]
        out[t] = row
        for k in requests[t]:
            nxt[k] = t
    return out


def _leading_hits(keys: Sequence[Hashable], cache: Container[Hashable]) -> int:
    """How many of a request's keys, from its first, are in ``cache``."""
    n = 0
    for k in keys:
        if k not in cache:
            break
        n += 1
    return n


def optimal_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Most prefix-hit blocks any cache of ``capacity`` blocks gets on
    ``requests`` (lists of keys in prefix order; duplicate keys in one
    request count once per occurrence but are cached once)."""
    return sum(_belady_hit_counts(requests, capacity))


def _belady_hit_counts(
    requests: Sequence[Sequence[Hashable]], capacity: int
) -> list[int]:
    """Per request, how many of its leading blocks the optimum hits."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    next_use = _next_uses(requests)
    cached: dict[Hashable, tuple[float, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[float, int, int, Hashable]] = []  # max-heap by negation
    tick = 0  # heap tie-break that never compares keys
    out: list[int] = []
    for t, keys in enumerate(requests):
        n = _leading_hits(keys, cached)
        out.append(n)
        for depth, (k, nu) in enumerate(zip(keys, next_use[t])):
            entry = (nu, depth)
            if cached.get(k) != entry:
                cached[k] = entry
                tick += 1
                heapq.heappush(heap, (-nu, -depth, tick, k))
        while len(cached) > capacity:
            neg_nu, neg_depth, _, k = heapq.heappop(heap)
            if cached.get(k) == (-neg_nu, -neg_depth):
                del cached[k]
        # Lazy deletion leaves stale entries; rebuild when they dominate.
        if len(heap) > 4 * len(cached) + 1024:
            heap = [(-nu, -d, i, k) for i, (k, (nu, d)) in enumerate(cached.items())]
            heapq.heapify(heap)
            tick = len(heap)
    return out


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

    counts = _belady_hit_counts(requests, capacity)
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


def optimal_hit_rate(requests: Sequence[Sequence[Hashable]], capacity: int) -> float:
    """:func:`optimal_hits` / all blocks of all requests."""
    total = sum(len(r) for r in requests)
    return optimal_hits(requests, capacity) / total if total else 0.0


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
        n = _leading_hits(keys, cache)
        pool = sorted(cache | set(keys), key=repr)
        out = 0
        for size in range(min(capacity, len(pool)) + 1):
            for keep in combinations(pool, size):
                out = max(out, best(t + 1, frozenset(keep)))
        return n + out

    return best(0, frozenset())


# ------------------------------------------------ clairvoyant reference points
#
# Not bounds on every online policy, but on two families of them: they show
# how much of the gap to the optimum *admission* and *frequency ranking*
# could close even if they were told the future.


def oracle_admission_lru_hits(
    requests: Sequence[Sequence[Hashable]], capacity: int
) -> int:
    """Prefix hits of an LRU cache (a request's head ranked newest) that
    stores a block only if some later request uses it again: the most an
    admission filter in front of LRU can get."""
    from collections import OrderedDict

    next_use = _next_uses(requests)
    lru: OrderedDict[Hashable, None] = OrderedDict()
    hits = 0
    for t, keys in enumerate(requests):
        n = _leading_hits(keys, lru)
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
        n = _leading_hits(keys, cached)
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
