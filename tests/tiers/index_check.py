"""The victim index checked against a full scan of its tier (O(n): tests),
and the prefix lookup the hierarchy tests probe with."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvtier.testing.state import evictable
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.tier import Tier


def check_index(tier: Tier) -> None:
    """Assert ``tier``'s victim index holds exactly the evictable blocks its
    filter accepts, and yields them in the policy's own victim order."""
    blocks = dict(tier.items())
    expect = [
        k
        for k in tier.policy.candidates()
        if evictable(blocks[k]) and (tier.filter is None or tier.filter(k, blocks[k]))
    ]
    eligible = set(tier.index.eligible)
    assert set(expect) == eligible, (tier.medium, expect, eligible)
    saved = tier.index.inspected
    got = eligible_in_order(tier)
    tier.index.inspected = saved
    assert got == expect, (tier.medium, got, expect)


def eligible_in_order(tier: Tier) -> list:
    """Every eligible key of ``tier``, most evictable first."""
    return tier.victims(len(tier.index.eligible))


def prefix_hits(h: TierHierarchy, keys: Iterable[Hashable]) -> int:
    """Consecutive keys from the first that are ready in *any* tier of ``h``."""
    n = 0
    for key in keys:
        if not h.lookup(key).is_hit:
            break
        n += 1
    return n
