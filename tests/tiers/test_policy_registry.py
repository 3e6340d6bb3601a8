"""The policy registry: what it refuses, and the O(blocks touched) promise.

Every registered policy must let a tier choose victims in O(blocks
touched). The check below builds a 100k-block tier whose blocks are nearly
all pinned and counts the keys a ``victims`` call visits; two deliberately
scanning variants (a policy whose victim order walks its keys, and the tier
falling back to a scan) show that the check fails when the promise breaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtier.testing.state import allocate, pin
from kvtier.tiers.policy import (
    POLICY_REGISTRY,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from kvtier.tiers.tier import Tier

TIER_BLOCKS = 100_000
ELIGIBLE_EVERY = 100  # 1 % of the blocks may be victims, the rest are pinned
ROUNDS, PER_CALL = 40, 8


class CountingKey:
    """A block key that counts every lookup of it (hash or equality): each
    dict, set or heap operation of the tier or the policy on a key is one
    visit. (A walk that only iterates a container without looking keys up is
    not counted: that is what ``VictimIndex.inspected`` is for.)"""

    visits = 0
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __hash__(self) -> int:
        CountingKey.visits += 1
        return hash(self.i)

    def __eq__(self, other: object) -> bool:
        CountingKey.visits += 1
        return isinstance(other, CountingKey) and other.i == self.i

    def __lt__(self, other: CountingKey) -> bool:  # heap ties: never (stamps)
        CountingKey.visits += 1
        return self.i < other.i


@dataclass
class VictimCost:
    worst_visits: int  # key lookups in the most expensive victims() call
    worst_inspected: int  # index entries (or candidates) it examined
    returned: int  # victims returned over all calls


def victim_cost(policy: str, scan_limit: int | None = None) -> VictimCost:
    """Replay churn on a full tier of ``TIER_BLOCKS`` blocks, 99 % pinned
    (the oldest ones, in every policy's order):
    each round asks for ``PER_CALL`` victims, evicts them, stores as many
    new blocks and touches a few eligible ones (so the index holds stale
    entries too). ``scan_limit`` makes every call a bounded scan of that
    many candidates (the old fallback, for the negative test)."""
    tier = Tier("cpu", TIER_BLOCKS, policy)
    keys = [CountingKey(i) for i in range(TIER_BLOCKS)]
    for k in keys:
        allocate(tier, k)
        tier.mark_ready(k)
    for k in keys[::3]:
        tier.touch(k)  # a second use: ARC's T2, 2q's main
    for i, k in enumerate(keys):
        if i % ELIGIBLE_EVERY:
            pin(tier, k)
    for k in keys[::ELIGIBLE_EVERY]:
        tier.touch(k)  # the eligible blocks are the newest: a scan walks
        # past every pinned block before it finds one (issue 11's case)
    # The setup's touches left stale index entries; the first call drops
    # them (each once, amortized over the pushes that made them).
    tier.victims(1)
    cost = VictimCost(0, 0, 0)
    fresh = TIER_BLOCKS
    for r in range(ROUNDS):
        CountingKey.visits, inspected = 0, tier.index.inspected
        chosen = tier.victims(PER_CALL, limit=scan_limit)
        cost.worst_visits = max(cost.worst_visits, CountingKey.visits)
        cost.worst_inspected = max(
            cost.worst_inspected, tier.index.inspected - inspected
        )
        cost.returned += len(chosen)
        assert chosen, "the tier always has eligible blocks here"
        for k in chosen:
            tier.remove(k, evicted=True)
        for _ in chosen:
            k = CountingKey(fresh)
            fresh += 1
            allocate(tier, k)
            tier.mark_ready(k)
        tier.touch(keys[(r * 7 * ELIGIBLE_EVERY) % TIER_BLOCKS])
    return cost


def assert_touched_only(cost: VictimCost) -> None:
    """The O(blocks touched) bound: a call examines at most what it returns
    plus what it skips, never a share of the tier. Skips here are the stale
    entries of the few keys touched or evicted since the last call, so a
    small multiple of ``PER_CALL`` bounds both counts (the tier's own
    bookkeeping looks each examined key up a handful of times)."""
    assert cost.returned == ROUNDS * PER_CALL
    assert cost.worst_inspected <= 4 * PER_CALL, cost
    assert cost.worst_visits <= 16 * PER_CALL, cost


@pytest.mark.parametrize("name", policy_names())
def test_every_registered_policy_chooses_victims_in_blocks_touched(name):
    assert_touched_only(victim_cost(name))


@pytest.fixture
def scanning_policy() -> Iterator[str]:
    """A registered LRU whose victim order finds its oldest stamp by
    looking every resident key up: the API is honoured, the cost is not."""

    @register_policy
    class ScanningLRU(LRUPolicy):
        name = "test-scanning-lru"
        summary = "LRU that scans its keys for every victim order (test only)."

        def victim_order(self):
            if self.positions:
                min(self.positions, key=self.positions.__getitem__)  # O(resident)
            return super().victim_order()

    try:
        yield ScanningLRU.name
    finally:
        del POLICY_REGISTRY[ScanningLRU.name]


def test_the_check_flags_a_policy_whose_victim_order_scans(scanning_policy):
    cost = victim_cost(scanning_policy)
    assert cost.worst_visits >= TIER_BLOCKS  # every resident key, every call
    with pytest.raises(AssertionError):
        assert_touched_only(cost)


def test_the_check_flags_a_tier_that_scans():
    """The old fallback for policies without an adapter: walk candidates()
    past the pinned blocks."""
    cost = victim_cost("lru", scan_limit=TIER_BLOCKS)
    assert cost.worst_inspected > TIER_BLOCKS // 2
    with pytest.raises(AssertionError):
        assert_touched_only(cost)


# ------------------------------------------------------------ registration


def test_a_policy_without_a_victim_order_is_refused():
    with pytest.raises(TypeError) as info:

        @register_policy
        class ScanOnly(EvictionPolicy):  # insert/touch/remove/candidates only
            name = "test-scan-only"
            summary = "has no victim order."

            def insert(self, key): ...
            def touch(self, key): ...
            def remove(self, key, evicted): ...
            def candidates(self):
                return iter(())

    message = str(info.value)
    assert "'test-scan-only'" in message
    assert "does not implement position, victim_order" in message
    assert "O(blocks touched)" in message
    assert "test-scan-only" not in POLICY_REGISTRY


def test_registration_refuses_a_taken_name_and_a_missing_summary():
    with pytest.raises(TypeError, match="'lru' is taken by LRUPolicy"):

        @register_policy
        class OtherLRU(LRUPolicy):
            summary = "another lru."

    with pytest.raises(TypeError, match="name and a summary"):

        @register_policy
        class Unnamed(LRUPolicy):
            name = "test-unnamed"
            summary = ""

    with pytest.raises(TypeError, match="segments must be an int >= 1"):

        @register_policy
        class NoSegments(LRUPolicy):
            name = "test-no-segments"
            summary = "no segments."
            segments = 0

    assert policy_names()[:4] == ("lru", "arc", "2q", "arcdk")


def test_registered_policies_are_built_by_name_and_config_lists_them():
    from kvtier.connector.config import ConfigError, parse_extra_config

    for name, cls in POLICY_REGISTRY.items():
        assert type(make_policy(name, 4)) is cls and cls.summary
    with pytest.raises(ConfigError) as info:
        parse_extra_config({"cpu_bytes_to_use": 1 << 30, "cpu_eviction_policy": "x"})
    message = str(info.value)
    assert "['cpu_eviction_policy']" in message
    assert " | ".join(policy_names()) in message
