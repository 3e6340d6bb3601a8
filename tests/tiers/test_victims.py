"""The victim index: taking victims out as they are chosen changes nothing
but the work done (same keys, same order, same index afterwards)."""

import random
import sys

import pytest

from kvtier.testing.state import allocate, evictable, pin
from kvtier.tiers import victims
from kvtier.tiers.policy import EvictionPolicy, LRUPolicy, make_policy, policy_names
from kvtier.tiers.tier import Tier
from tests.tiers.index_check import check_index, eligible_in_order


def _churned_tier(policy: str | EvictionPolicy, seed: int, capacity: int = 200) -> Tier:
    """A full tier after random pins, touches, removals and refills, some
    blocks left WRITING: every kind of stale and dormant index entry."""
    rng = random.Random(seed)
    tier = Tier("cpu", capacity, policy)
    fresh = 0
    for _ in range(capacity):
        allocate(tier, fresh)
        tier.mark_ready(fresh)
        fresh += 1
    for _ in range(600):
        keys = list(tier.keys())
        key = rng.choice(keys)
        block = tier.get(key)
        op = rng.random()
        if op < 0.3:
            tier.touch_many(rng.sample(keys, 3))
        elif op < 0.45 and block.state.value == "ready":
            pin(tier, key)
        elif op < 0.6 and block.pins:
            tier.unpin(key)
        elif op < 0.8 and evictable(block):
            tier.remove(key)
            allocate(tier, fresh)
            if rng.random() < 0.8:
                tier.mark_ready(fresh)
            fresh += 1
        else:
            tier.touch(key)
    return tier


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("seed", range(4))
def test_evict_removes_exactly_what_victims_returns(policy, seed):
    a, b = _churned_tier(policy, seed), _churned_tier(policy, seed)
    exclude = set(list(a.keys())[::7])
    for n in (1, 5, 40, 1000):
        expect = a.victims(n, exclude=exclude)
        for key in expect:
            a.remove(key, evicted=True)
        got = b.evict(n, exclude=exclude)
        assert got == expect
        assert sorted(map(str, b.keys())) == sorted(map(str, a.keys()))
        assert eligible_in_order(b) == eligible_in_order(a)
        check_index(b)
    # n=1000 took every eligible key that was not excluded.
    assert eligible_in_order(b)
    assert all(k in exclude for k in eligible_in_order(b))


@pytest.mark.parametrize("policy", policy_names())
def test_taken_victims_given_back_keep_their_place(policy):
    tier = _churned_tier(policy, seed=11)
    before = eligible_in_order(tier)
    taken = tier.take_victims(10)
    assert taken == before[:10]
    assert tier.num_eligible == len(before) - 10
    tier.refresh_many(taken)
    assert eligible_in_order(tier) == before
    check_index(tier)


def test_count_eligible_counts_only_victim_candidates():
    tier = Tier("cpu", 4)
    for k in "abcd":
        allocate(tier, k)
    tier.mark_ready_many(["a", "b", "c"])
    pin(tier, "b")
    assert tier.count_eligible({"a", "b", "c", "d", "zz"}) == 2  # a, c
    assert tier.num_eligible == 2


def test_index_heaps_stay_bounded_under_touch_churn():
    """Touches move keys to the back of a run (the newest stamp fits any
    run): no heap entry, nothing stale."""
    tier = Tier("cpu", 50)
    for k in range(50):
        allocate(tier, k)
    tier.mark_ready_many(list(range(50)))
    for i in range(5000):
        tier.touch_many([i % 50, (i * 7) % 50])
    assert sum(len(h) for h in tier.index.heaps) == 0
    check_index(tier)
    assert eligible_in_order(tier)[:3] == tier.victims(3)


@pytest.mark.parametrize("policy", policy_names())
def test_out_of_order_admissions_use_the_heap_and_keep_the_order(policy):
    """Keys released in scrambled stamp order overflow the ordered runs
    into the heap; its stale entries (pinned again) are dropped and rebuilt
    away, and the order stays the policy's."""
    rng = random.Random(5)
    tier = Tier("cpu", 300, policy)
    keys = list(range(300))
    for k in keys:
        allocate(tier, k)
    tier.mark_ready_many(keys)
    tier.pin_many(keys)
    for _ in range(40):
        batch = rng.sample(keys, 30)
        tier.unpin_many([k for k in batch if tier.get(k).pins])
        tier.pin_many(rng.sample(batch, 20))
        check_index(tier)
    assert any(tier.index.heaped)
    assert all(
        len(h) <= 2 * len(live) + 64
        for h, live in zip(tier.index.heaps, tier.index.heaped)
    )
    order = eligible_in_order(tier)
    assert tier.evict(len(order) // 2) == order[: len(order) // 2]
    check_index(tier)


def _largest_container(tier: Tier) -> int:
    """The most keys any one bucket of the victim index holds."""
    return max(
        (len(bucket) for runs in tier.index.runs for run in runs for bucket in run),
        default=0,
    )


@pytest.fixture
def small_buckets(monkeypatch):
    """Runs of buckets of 3 keys: every bucket boundary and tidying path on
    a small tier."""
    monkeypatch.setattr(victims, "BUCKET_KEYS", 3)


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("seed", range(3))
def test_bucketed_runs_keep_the_order_and_a_bounded_table(policy, seed, small_buckets):
    """With buckets of 3 keys, a churned tier (runs of many buckets, buckets
    emptied at the front and in the middle, segments visited twice by one
    victim order) yields every eligible key in the policy's order, evicts
    exactly what ``victims`` returns, and no container of the index holds
    more than a bucket: no table rebuild walks more than a bucket's keys."""
    a, b = _churned_tier(policy, seed), _churned_tier(policy, seed)
    check_index(b)
    assert _largest_container(b) == 3
    assert max(len(run) for runs in b.index.runs for run in runs) > 4
    exclude = set(list(a.keys())[::5])
    for n in (1, 7, 30, 1000):
        expect = a.victims(n, exclude=exclude)
        for key in expect:
            a.remove(key, evicted=True)
        assert b.evict(n, exclude=exclude) == expect
        check_index(b)
        assert eligible_in_order(b) == eligible_in_order(a)


def test_a_run_sheds_emptied_buckets_behind_a_long_lived_front(small_buckets):
    """One key stays the oldest eligible while thousands pass behind it
    (admitted, then removed): the run's emptied buckets are swept, so its
    bucket list stays proportional to the keys it holds."""
    tier = Tier("cpu", 20)
    allocate(tier, "old")
    tier.mark_ready("old")
    for i in range(3000):
        allocate(tier, i)
        tier.mark_ready(i)
        if i >= 3:
            tier.remove(i - 3)
    assert tier.victims(5) == ["old", 2997, 2998, 2999]
    buckets = sum(len(run) for runs in tier.index.runs for run in runs)
    assert buckets <= 4
    check_index(tier)


def test_sparse_buckets_are_compacted_in_place(monkeypatch):
    """A bucket whose keys were mostly pinned away keeps its full table
    until the run's tidying compacts it (the same object, so the index
    stays whole): memory follows the keys held, not the keys once held."""
    monkeypatch.setattr(victims, "BUCKET_KEYS", 64)
    tier = Tier("cpu", 5000)
    first = list(range(640))  # ten buckets of 64
    for k in first:
        allocate(tier, k)
    tier.mark_ready_many(first)
    run = tier.index.runs[0][0]
    old = list(run)
    assert len(old) == 10
    tier.pin_many([k for k in first if k % 64])  # one key left in each
    before = [sys.getsizeof(c) for c in old]
    more = list(range(640, 640 + 64 * 30))  # 30 new buckets: 60 tidied
    for k in more:
        allocate(tier, k)
    tier.mark_ready_many(more)
    # The last one had room: the new keys went there first.
    assert [len(c) for c in old] == [1] * 9 + [64]
    assert all(sys.getsizeof(c) * 4 < b for c, b in zip(old[:9], before))
    check_index(tier)


@pytest.mark.parametrize("policy", policy_names())
def test_policy_batches_equal_the_per_key_calls(policy):
    batch, single = make_policy(policy, 8), make_policy(policy, 8)
    keys = [f"k{i}" for i in range(20)]
    expect = []
    for key in keys[:12]:
        single.insert(key)
        expect.append(single.position(key))
    assert batch.insert_many(keys[:12]) == expect
    for key in keys[2:9]:
        single.remove(key, evicted=True)
    batch.remove_many(keys[2:9], evicted=True)
    for key in keys[12:]:  # ghosts and doorkeepers remembered the same
        single.insert(key)
    batch.insert_many(keys[12:])
    touched = [k for k in keys[::3] + keys[1::4] if k in list(single.candidates())]
    expect = []
    for key in touched:
        single.touch(key)
        expect.append(single.position(key))
    assert batch.touch_many(touched) == expect
    assert list(batch.candidates()) == list(single.candidates())
    assert [batch.position(k) for k in batch.candidates()] == [
        single.position(k) for k in single.candidates()
    ]


class PrivateLRU(EvictionPolicy):
    """LRU that does not expose its positions (``positions`` None, as a
    third-party policy may): the tier keeps a copy for its index."""

    segments = 1

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._lru = LRUPolicy(capacity)

    def insert(self, key):
        self._lru.insert(key)

    def touch(self, key):
        self._lru.touch(key)

    def remove(self, key, evicted):
        self._lru.remove(key, evicted)

    def candidates(self):
        return self._lru.candidates()

    def position(self, key):
        return self._lru.position(key)

    def victim_order(self):
        return self._lru.victim_order()


@pytest.mark.parametrize("seed", range(3))
def test_a_policy_keeping_its_positions_private_gets_them_copied(seed):
    """The tier copies the positions of a policy that does not expose them
    into its index, and keeps the copy exact: same victims and order as
    LRU reading its own, and no position of a key that left."""
    a = _churned_tier("lru", seed)
    b = _churned_tier(PrivateLRU(200), seed)
    assert b.index.owns_pos and not a.index.owns_pos
    assert eligible_in_order(b) == eligible_in_order(a)
    check_index(b)
    for n in (3, 50):
        assert b.evict(n) == a.evict(n)
        assert b.index.pos == a.policy.positions
    b.clear()
    assert not b.index.pos


def test_an_lru_subclass_that_changes_insert_keeps_it_in_batches():
    class Tagged(LRUPolicy):
        def insert(self, key):
            super().insert(key)
            self.seen = [*getattr(self, "seen", []), key]

    p = Tagged(4)
    p.insert_many(["a", "b"])
    assert p.seen == ["a", "b"]


def test_an_lru_subclass_that_changes_touch_keeps_it_in_batches():
    class Counted(LRUPolicy):
        touches = 0

        def touch(self, key):
            super().touch(key)
            self.touches += 1

    p = Counted(4)
    p.insert_many(["a", "b"])
    assert p.touch_many(["a", "b", "a"]) == [2, 3, 4]  # segment 0: the stamps
    assert p.touches == 3


def _state(tier: Tier) -> tuple:
    blocks = {k: (b.slot, b.state, b.pins, b.origin) for k, b in tier.items()}
    return blocks, tier.num_free, list(tier.policy.candidates())


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize(
    "case", ["free-and-fresh", "duplicate-key", "already-here", "no-room"]
)
def test_allocate_many_is_allocate_per_key(policy: str, case: str) -> None:
    """The batch takes the same slots (free ones in pop order, then fresh),
    leaves the same blocks and policy order, and fails where the per-key
    loop would fail, with the keys before it allocated."""
    tiers = []
    for _ in range(2):
        tier = Tier("disk", 12, policy)
        for key in range(8):
            allocate(tier, key)
            tier.mark_ready(key)
        for key in (5, 2, 6):
            tier.remove(key)  # three free slots, four never handed out
        tiers.append(tier)
    batch, single = tiers
    keys = {
        "free-and-fresh": [100, 101, 102, 103, 104],
        "duplicate-key": [100, 101, 100, 102],
        "already-here": [100, 3, 101],
        "no-room": [100 + i for i in range(9)],
    }[case]
    errors = []
    for alloc in (
        lambda: batch.allocate_many(keys, "spill"),
        lambda: [allocate(single, k, "spill").slot for k in keys],
    ):
        try:
            errors.append(("ok", alloc()))
        except (KeyError, RuntimeError) as exc:
            errors.append((type(exc).__name__, None))
    assert errors[0] == errors[1]
    if case == "free-and-fresh":
        assert errors[0][1] == [6, 2, 5, 8, 9]
    else:
        assert errors[0][0] != "ok"
    assert _state(batch) == _state(single)
    check_index(batch)
