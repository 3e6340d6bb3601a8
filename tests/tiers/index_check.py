"""The victim index checked against a full scan of its tier (O(n): tests)."""

from __future__ import annotations

from kvtier.tiers.tier import Tier


def check_index(tier: Tier) -> None:
    """Assert ``tier``'s victim index holds exactly the evictable blocks its
    filter accepts, and yields them in the policy's own victim order."""
    blocks = dict(tier.items())
    expect = [
        k
        for k in tier.policy.candidates()
        if blocks[k].evictable and (tier.filter is None or tier.filter(k, blocks[k]))
    ]
    eligible = set(tier.index.eligible)
    assert set(expect) == eligible, (tier.medium, expect, eligible)
    saved = tier.index.inspected
    got = tier.eligible_in_order()
    tier.index.inspected = saved
    assert got == expect, (tier.medium, got, expect)
