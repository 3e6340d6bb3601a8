"""The offline optimum replay equals exhaustive search on small traces."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.testing.oracles import (
    brute_force_hits,
    optimal_hits_by_reuse_distance,
    oracle_admission_lru_hits,
    rate_oracle_hits,
    static_frequency_hits,
)
from kvtier.tiers.optimum import optimal_hit_rate, optimal_hits
from kvtier.tiers.policy import policy_names
from kvtier.tools.sizing import replay_trace


def _prefix_trace(prompts: list[list[int]]) -> list[list[int]]:
    """Prefix hashes: a block's id names its tokens and all before it."""
    ids: dict[tuple[int, ...], int] = {}
    return [
        [ids.setdefault(tuple(p[: i + 1]), len(ids)) for i in range(len(p))]
        for p in prompts
    ]


PROMPTS = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1, max_size=6
)


@settings(max_examples=150, deadline=None)
@given(PROMPTS, st.integers(0, 3))
def test_belady_equals_brute_force(prompts, capacity):
    trace = _prefix_trace(prompts)
    assert optimal_hits(trace, capacity) == brute_force_hits(trace, capacity)


@settings(max_examples=100, deadline=None)
@given(PROMPTS, st.integers(0, 6))
def test_optimum_bounds(prompts, capacity):
    trace = _prefix_trace(prompts)
    hits = optimal_hits(trace, capacity)
    seen: set[int] = set()
    infinite = 0
    for r in trace:
        infinite += sum(1 for k in r if k in seen)
        seen.update(r)
    assert 0 <= hits <= infinite
    assert optimal_hits(trace, capacity + 1) >= hits  # monotone in capacity
    if capacity >= len(seen):
        assert hits == infinite


def test_optimum_keeps_the_block_used_next():
    # Capacity 1: after [a] and [b], keep a (used next) rather than b.
    assert optimal_hits([[0], [1], [0], [1]], 1) == 1
    assert optimal_hit_rate([[0], [0]], 1) == 0.5
    assert optimal_hit_rate([], 4) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=12
    ),
    st.integers(1, 4),
    st.integers(0, 4),
    st.sampled_from(policy_names()),
)
def test_no_policy_beats_the_optimum(prompts, cpu, disk, policy):
    """Every policy, through the real hierarchy replay, stays under the
    optimum of one tier of the total capacity."""
    trace = _prefix_trace(prompts)
    r = replay_trace(trace, cpu, disk, policy, policy)
    assert r.hit_blocks <= optimal_hits(trace, cpu + disk)


@settings(max_examples=100, deadline=None)
@given(PROMPTS, st.integers(0, 6))
def test_clairvoyant_references_stay_under_the_optimum(prompts, capacity):
    trace = _prefix_trace(prompts)
    opt = optimal_hits(trace, capacity)
    assert oracle_admission_lru_hits(trace, capacity) <= opt
    assert static_frequency_hits(trace, capacity) <= opt
    assert rate_oracle_hits(trace, capacity) <= opt
    assert rate_oracle_hits(trace, capacity, knows_last_use=True) <= opt


def test_oracle_admission_skips_one_time_blocks():
    # Capacity 2: a one-time prompt between two uses of [0, 1] evicts them
    # under LRU; the oracle never stores it.
    trace = [[0, 1], [5, 6], [0, 1]]
    assert oracle_admission_lru_hits(trace, 2) == 2
    assert static_frequency_hits(trace, 2) == 2


def test_rate_oracle_keeps_the_higher_rate_and_drops_the_finished():
    # Capacity 1. A: requests 0 and 1 (rate 1, finished after 1); B:
    # requests 2 and 4 (rate 1/2); C: request 3 only (rate 0).
    trace = [["A"], ["A"], ["B"], ["C"], ["B"]]
    # Rates alone keep A over B and C: only A's second use hits.
    assert rate_oracle_hits(trace, 1) == 1
    # Told that A is finished, it keeps B through C: B's return hits too.
    assert rate_oracle_hits(trace, 1, knows_last_use=True) == 2
    assert optimal_hits(trace, 1) == 2


def test_rate_oracle_ranks_a_child_no_higher_than_its_parent():
    # Parent 0: requests 0, 1 and 10 (rate 0.2); its child 1: requests 0
    # and 1 (rate 1); one-time blocks in between. Ranked by its own rate the
    # child would push out the parent it needs and nothing would hit; capped
    # at the parent's worth, the parent stays.
    trace = [[0, 1], [0, 1]] + [[100 + i] for i in range(8)] + [[0]]
    assert rate_oracle_hits(trace, 1) == 2 == optimal_hits(trace, 1)
    assert rate_oracle_hits(trace, 2) == 3 == optimal_hits(trace, 2)


@settings(max_examples=100, deadline=None)
@given(PROMPTS, st.integers(0, 6), st.lists(st.integers(0, 8), max_size=3))
def test_optimum_by_reuse_distance_adds_up(prompts, capacity, edges):
    trace = _prefix_trace(prompts)
    hits, reuses = optimal_hits_by_reuse_distance(trace, capacity, sorted(edges))
    assert len(hits) == len(reuses) == len(edges) + 1
    assert sum(hits) == optimal_hits(trace, capacity)
    seen: set[int] = set()
    infinite = 0
    for r in trace:
        infinite += sum(1 for k in r if k in seen)
        seen.update(r)
    assert sum(reuses) == infinite
    assert all(0 <= h <= n for h, n in zip(hits, reuses))


def test_optimum_by_reuse_distance_bins():
    # Block 0 comes back after 0 blocks in between (distance 0), then after
    # the 2 blocks of [1, 2] (distance 2); capacity 1 keeps it throughout.
    trace = [[0], [0], [1], [2], [0]]
    hits, reuses = optimal_hits_by_reuse_distance(trace, 1, [1, 2])
    assert reuses == [1, 0, 1]
    assert hits == [1, 0, 1]
