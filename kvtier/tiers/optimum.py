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


def next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[float]]:
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


def leading_hits(keys: Sequence[Hashable], cache: Container[Hashable]) -> int:
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
    return sum(belady_hit_counts(requests, capacity))


def belady_hit_counts(
    requests: Sequence[Sequence[Hashable]], capacity: int
) -> list[int]:
    """Per request, how many of its leading blocks the optimum hits."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    next_use = next_uses(requests)
    cached: dict[Hashable, tuple[float, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[float, int, int, Hashable]] = []  # max-heap by negation
    tick = 0  # heap tie-break that never compares keys
    out: list[int] = []
    for t, keys in enumerate(requests):
        n = leading_hits(keys, cached)
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


def optimal_hit_rate(requests: Sequence[Sequence[Hashable]], capacity: int) -> float:
    """:func:`optimal_hits` / all blocks of all requests."""
    total = sum(len(r) for r in requests)
    return optimal_hits(requests, capacity) / total if total else 0.0
