"""Scenario tests of the cascade: spill ahead, drop clean, promote, decline."""

import pytest

from kvtier.testing.residency import replay, residency
from kvtier.testing.state import io_error_count
from kvtier.tiers.disk_core import MAX_READ_IO_ERRORS
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency
from kvtier.tiers.policy import policy_names
from tests.tiers.index_check import check_index, prefix_hits


def _store(h, keys):
    plan = h.prepare_store(keys)
    assert plan is not None
    h.complete_store(plan.keys_to_store)
    return plan


def _finish_spills(h, fail=()):
    for order in h.take_spills():
        h.complete_spill(order.job_id, [i.key for i in order.items if i.key in fail])


def test_cpu_only_drops_lru_victims():
    h = TierHierarchy(3)
    _store(h, ["x"])
    _store(h, ["a", "b"])
    plan = _store(h, ["c"])
    assert plan.evicted_keys == ["x"]  # least recently used request first
    # Within one request's prefix the tail goes before the head: "b" without
    # "a" could never be hit, "a" without "b" still is.
    assert _store(h, ["d"]).evicted_keys == ["b"]
    assert h.lookup("b") is Residency.MISS
    assert prefix_hits(h, ["a", "b"]) == 1


def test_victims_cascade_to_disk_and_come_back():
    h = TierHierarchy(2, 4, spill_watermark=0.0)
    _store(h, ["a", "b"])
    _finish_spills(h)  # watermark 0: everything dirty is spilled ahead
    plan = _store(h, ["c", "d"])
    assert sorted(plan.evicted_keys) == ["a", "b"]
    assert h.lookup("a") is Residency.HIT_DISK
    # A prefix spanning disk and CPU counts as one hit run.
    assert prefix_hits(h, ["a", "c", "b", "d"]) == 4
    load = h.prepare_load(["a", "c"])
    assert [loc.medium for loc in load.locations] == [MEDIUM_DISK, MEDIUM_CPU]
    h.complete_load(load.load_id)
    ev = h.take_events()
    assert [(e.medium, e.removed, e.reason) for e in ev] == [
        ("cpu", False, "store"),
        ("disk", False, "spill"),
        ("cpu", True, "evict"),
        ("cpu", False, "store"),
    ]
    assert replay(ev) == residency(h)


def test_store_declines_rather_than_waiting_for_disk():
    h = TierHierarchy(2, 4, spill_watermark=1.0)
    _store(h, ["a", "b"])
    assert h.take_spills() == []  # below the watermark: nothing to spill
    assert h.prepare_store(["c"]) is None  # only dirty victims: decline...
    orders = h.take_spills()  # ...and spill one so the retry succeeds
    assert len(orders) == 1 and orders[0].items[0].key == "b"  # the tail
    assert h.prepare_store(["c"]) is None  # spill still in flight
    h.complete_spill(orders[0].job_id)
    assert _store(h, ["c"]).evicted_keys == ["b"]


def test_at_shutdown_every_dirty_block_spills_heads_and_newest_first():
    """Below the watermark nothing spills, and a block only on CPU is lost
    at shutdown; spill_everything orders them all, newest first: each
    prompt's head before its tail (the watermark's spills go tail first),
    so what reaches the disk in the time shutdown has is reachable."""
    h = TierHierarchy(8, 16, spill_watermark=1.0)
    _store(h, ["a0", "a1", "a2"])
    _store(h, ["b0", "b1", "b2"])
    assert h.take_spills() == []
    h.spill_everything()
    orders = h.take_spills()
    assert [i.key for o in orders for i in o.items] == [
        "b0", "b1", "b2", "a0", "a1", "a2"
    ]  # fmt: skip
    for order in orders:
        h.complete_spill(order.job_id)
    assert [h.lookup(k) for k in ("a0", "b2")] == [Residency.HIT_CPU] * 2
    h.spill_everything()  # nothing dirty is left
    assert h.take_spills() == []


def test_at_shutdown_at_most_the_given_number_spill_the_newest():
    """The shutdown's bound: the newest dirty blocks, no more than asked
    (the rest stay dirty, and no disk block is evicted for them)."""
    h = TierHierarchy(8, 4, spill_watermark=1.0)
    _store(h, ["x0", "x1", "x2", "x3"])
    h.spill_everything()
    for order in h.take_spills():
        h.complete_spill(order.job_id)
    assert len(h.disk) == 4  # full
    _store(h, ["b0", "b1", "b2"])
    h.spill_everything(2)
    orders = h.take_spills()
    assert [i.key for o in orders for i in o.items] == ["b0", "b1"]
    assert sorted(k for k in ("x0", "x1", "x2", "x3") if k in h.disk) == ["x2", "x3"]


def test_at_shutdown_the_disk_takes_as_many_as_it_has_room_for_heads_first():
    h = TierHierarchy(8, 2, spill_watermark=1.0)
    _store(h, ["a0", "a1", "a2"])
    h.spill_everything()
    (order,) = h.take_spills()
    assert [i.key for i in order.items] == ["a0", "a1"]


def test_failed_spill_costs_a_miss_not_a_wedge():
    h = TierHierarchy(1, 2, spill_watermark=0.0)
    _store(h, ["a"])
    _finish_spills(h, fail={"a"})
    assert h.lookup("a") is Residency.HIT_CPU
    assert _store(h, ["b"]).evicted_keys == ["a"]
    assert h.lookup("a") is Residency.MISS
    assert h.stats.spill_failures == 1


def test_disk_hits_load_in_place_with_promotion_and_corrupt_block():
    h = TierHierarchy(2, 4, spill_watermark=0.0)
    _store(h, ["a", "b"])
    _finish_spills(h)
    _store(h, ["c", "d"])
    _finish_spills(h)  # c, d clean: their CPU slots can be given up
    assert h.lookup("a") is Residency.HIT_DISK
    plan = h.prepare_load(["a", "b"])
    # Read from their disk slots; CPU rows were free to copy them into.
    assert [loc.medium for loc in plan.locations] == [MEDIUM_DISK, MEDIUM_DISK]
    assert all(loc.promote_slot is not None for loc in plan.locations)
    assert h.lookup("a") is Residency.HIT_DISK  # still loadable by others
    h.complete_load(plan.load_id, corrupt=["b"])
    assert h.lookup("a") is Residency.HIT_CPU
    assert h.source_of("a") == MEDIUM_DISK  # credited to the disk tier
    assert h.lookup("b") is Residency.MISS  # corrupt copy dropped
    assert "b" not in h.cpu  # its promotion row given back unwritten
    assert h.disk_core.failures.corrupt == 1 and h.stats.load_failures == 1
    assert h.stats.loads_disk == 1 and h.stats.promotions_completed == 1
    assert replay(h.take_events()) == residency(h)


def _on_disk_only(keys):
    """A hierarchy whose CPU tier dropped ``keys`` (spilled): disk hits."""
    h = TierHierarchy(2, 8, spill_watermark=0.0, promote_on_hit=False)
    _store(h, keys)
    _finish_spills(h)
    _store(h, ["x", "y"])
    _finish_spills(h)
    assert all(h.lookup(k) is Residency.HIT_DISK for k in keys)
    return h


def test_an_io_error_keeps_the_disk_copy_and_a_good_read_resets_its_count():
    h = _on_disk_only(["a", "b"])
    failures = h.disk_core.failures
    for _ in range(MAX_READ_IO_ERRORS - 1):
        plan = h.prepare_load(["a", "b"])
        h.complete_load(plan.load_id, io_failed=["b"])
    # Failed loads, but the block stays: the next request may read it.
    assert h.lookup("b") is Residency.HIT_DISK
    assert io_error_count(h.disk_core, "b") == MAX_READ_IO_ERRORS - 1
    assert failures.io_errors_kept == MAX_READ_IO_ERRORS - 1
    assert failures.corrupt == failures.unreadable == 0
    assert h.stats.load_failures == MAX_READ_IO_ERRORS - 1
    assert h.stats.loads_disk == MAX_READ_IO_ERRORS - 1  # "a" each time
    plan = h.prepare_load(["b"])
    h.complete_load(plan.load_id)  # read and verified: the count starts again
    assert io_error_count(h.disk_core, "b") == 0
    plan = h.prepare_load(["b"])
    h.complete_load(plan.load_id, io_failed=["b"])
    assert h.lookup("b") is Residency.HIT_DISK
    assert replay(h.take_events()) == residency(h)


def test_io_errors_in_a_row_drop_the_disk_copy():
    h = _on_disk_only(["a", "b"])
    h.take_events()
    for _ in range(MAX_READ_IO_ERRORS):
        assert h.lookup("b") is Residency.HIT_DISK
        plan = h.prepare_load(["b"])
        h.complete_load(plan.load_id, io_failed=["b"])
    assert h.lookup("b") is Residency.MISS
    assert h.lookup("a") is Residency.HIT_DISK
    failures = h.disk_core.failures
    assert (failures.io_errors_kept, failures.unreadable, failures.corrupt) == (
        MAX_READ_IO_ERRORS - 1,
        1,
        0,
    )
    events = h.take_events()
    assert [(e.keys, e.removed, e.reason) for e in events] == [
        (("b",), True, "unreadable")
    ]


def test_a_block_given_up_unread_keeps_its_count():
    h = _on_disk_only(["a"])
    plan = h.prepare_load(["a"])
    h.complete_load(plan.load_id, io_failed=["a"])
    plan = h.prepare_load(["a"])
    h.complete_load(plan.load_id, unread=["a"])  # nothing was read
    assert io_error_count(h.disk_core, "a") == 1
    assert h.lookup("a") is Residency.HIT_DISK


def test_a_corrupt_read_drops_at_once_even_after_io_errors():
    h = _on_disk_only(["a"])
    plan = h.prepare_load(["a"])
    h.complete_load(plan.load_id, io_failed=["a"])
    plan = h.prepare_load(["a"])
    h.complete_load(plan.load_id, corrupt=["a"])
    assert h.lookup("a") is Residency.MISS
    failures = h.disk_core.failures
    assert (failures.io_errors_kept, failures.corrupt, failures.unreadable) == (1, 1, 0)


def test_an_unreadable_block_still_read_by_another_load_stays_until_it_ends():
    h = _on_disk_only(["a"])
    for _ in range(MAX_READ_IO_ERRORS - 1):
        plan = h.prepare_load(["a"])
        h.complete_load(plan.load_id, io_failed=["a"])
    first, second = h.prepare_load(["a"]), h.prepare_load(["a"])
    h.complete_load(first.load_id, io_failed=["a"])  # still pinned by second
    assert h.lookup("a") is Residency.HIT_DISK
    h.complete_load(second.load_id, io_failed=["a"])
    assert h.lookup("a") is Residency.MISS
    assert h.disk_core.failures.unreadable == 1


def test_disk_load_never_waits_for_cpu_room():
    # CPU full of dirty blocks (their spills in flight): a disk hit still
    # loads, just without a promotion row.
    h = TierHierarchy(2, 4, spill_watermark=0.0)
    _store(h, ["a", "b"])
    _finish_spills(h)
    _store(h, ["c", "d"])
    h.take_spills()  # c, d spilling, not droppable
    plan = h.prepare_load(["a"])
    assert plan.locations[0].medium == MEDIUM_DISK
    assert plan.locations[0].promote_slot is None
    h.complete_load(plan.load_id)
    assert h.stats.loads_disk == 1 and h.stats.promotions_completed == 0


def test_disk_full_evicts_disk_lru():
    h = TierHierarchy(1, 2, spill_watermark=0.0)
    for k in "abc":
        _store(h, [k])
        _finish_spills(h)
    assert h.lookup("a") is Residency.MISS
    assert h.lookup("b") is Residency.HIT_DISK
    assert h.lookup("c") is Residency.HIT_CPU


def test_offer_larger_than_the_cpu_tier_stores_its_head():
    h = TierHierarchy(4, 16, spill_watermark=0.0)
    keys = [f"k{i}" for i in range(10)]
    plan = _store(h, keys)
    assert plan.keys_to_store == keys[:4]  # the head, not nothing
    assert h.stats.store_blocks_skipped == 6 and h.stats.stores_declined == 0
    assert prefix_hits(h, keys) == 4
    # An offer that fits the tier stays all or nothing (dirty blocks wait).
    assert h.prepare_store(["x", "y"]) is None
    assert h.stats.stores_declined == 1


def _count_candidates(tier):
    """Count the candidates ``tier`` inspects when choosing victims: keys its
    policy yields by scanning, plus entries of its eligible index."""
    seen = [0]
    scan = tier.policy.candidates

    def counting():
        for key in scan():
            seen[0] += 1
            yield key

    tier.policy.candidates = counting  # this instance only
    return lambda: seen[0] + tier.index.inspected


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("disk_blocks", [65536, 16384])
def test_declined_stores_inspect_blocks_touched_not_the_tier(policy, disk_blocks):
    """Issue 11: spills are slow, so every CPU block is dirty or being
    spilled; a declined prepare_store (and the spill queueing it triggers)
    must cost O(blocks touched), not a scan of the 32k-block tier. With
    16384 disk blocks the disk is also full of spills in flight, so making
    disk room for new spills finds no victim either."""
    cpu_blocks, chunk = 32768, 512
    h = TierHierarchy(
        cpu_blocks,
        disk_blocks,
        cpu_policy=policy,
        disk_policy=policy,
        spill_watermark=0.0,
        record_events=False,
    )
    for i in range(0, cpu_blocks, chunk):
        _store(h, [("old", k) for k in range(i, i + chunk)])
    in_flight = h.take_spills()  # issued, never completed: the disk is slow
    assert sum(len(o.items) for o in in_flight) == min(cpu_blocks, disk_blocks)
    assert h.cpu.num_free == 0
    cpu_seen, disk_seen = _count_candidates(h.cpu), _count_candidates(h.disk)

    calls, per_call = 200, 16
    for i in range(calls):
        keys = [("new", i, k) for k in range(per_call)]
        assert h.prepare_store(keys) is None
        h.take_spills()
    assert h.stats.stores_declined == calls
    touched = calls * per_call
    # The old full scan inspected cpu_blocks (plus up to disk_blocks)
    # candidates per call: 6.5M here. Now each call looks at most at the
    # blocks it touches.
    assert cpu_seen() + disk_seen() <= 2 * touched, (cpu_seen(), disk_seen())

    # The spills land: the same stores now succeed, evicting clean blocks
    # in policy order (the index agrees with a full scan).
    for order in in_flight:
        h.complete_spill(order.job_id)
    check_index(h.cpu)
    check_index(h.disk)
    assert h.prepare_store([("new", 0, k) for k in range(per_call)]) is not None


def test_spills_the_disk_cannot_take_list_no_dirty_block(monkeypatch):
    """A disk tier full of spills in flight (a slow disk, here a quarter of
    the CPU tier) can take no spill: queueing one must not walk the dirty
    blocks. Every step's take_spills (and each store) asked for the whole
    excess over the watermark and listed it, O(CPU tier) per step (21 ms
    at a million CPU blocks), to spill none of it."""
    from collections import OrderedDict

    from kvtier.tiers import spilling

    listed = [0]

    class CountingDirty(OrderedDict):
        def __iter__(self):
            for key in super().__iter__():
                listed[0] += 1
                yield key

    monkeypatch.setattr(spilling, "OrderedDict", CountingDirty)
    cpu_blocks, disk_blocks = 4096, 1024
    h = TierHierarchy(cpu_blocks, disk_blocks, spill_watermark=0.0, record_events=False)
    assert isinstance(h._spills.dirty, CountingDirty)
    for i in range(0, cpu_blocks, 256):
        _store(h, [("old", k) for k in range(i, i + 256)])
    in_flight = h.take_spills()  # issued, never completed: the disk is slow
    assert sum(len(o.items) for o in in_flight) == disk_blocks
    assert h.disk.num_free == 0 and h.disk.num_eligible == 0
    assert len(h._spills.dirty) == cpu_blocks - disk_blocks
    listed[0] = 0
    for i in range(100):  # engine steps: a declined store, then the pump
        assert h.prepare_store([("new", i)]) is None
        assert h.take_spills() == []
    assert listed[0] == 0
    # One spill lands: its slot takes the oldest dirty block, and only it.
    h.complete_spill(in_flight[0].job_id)
    listed[0] = 0
    orders = h.take_spills()
    landed = len(in_flight[0].items)
    assert sum(len(o.items) for o in orders) == landed
    assert listed[0] == landed
    check_index(h.cpu)
    check_index(h.disk)


def test_a_warm_restart_event_goes_out_over_several_drains():
    # A warm restart records one event naming every adopted block (a million
    # on a 2 TB tier of 2 MiB blocks). A consumer drains once per engine
    # step (vLLM: one KV event per key, built in the step), so a bounded
    # drain hands out every event the step caused plus at most `backlog`
    # keys of the restore, oldest first, and the rest on later drains.
    n, per_drain = 1000, 64
    h = TierHierarchy(4, n)
    h.restore_disk([(f"r{i}", i) for i in range(n)])
    drained = h.take_events(backlog=per_drain)
    assert [(e.medium, e.removed, e.reason) for e in drained] == [
        ("disk", False, "restore")
    ]
    assert list(drained[0].keys) == [f"r{i}" for i in range(per_drain)]
    # A step's own events are never held behind the backlog.
    _store(h, ["a", "b"])
    step = h.take_events(backlog=per_drain)
    assert [(e.reason, len(e.keys)) for e in step] == [
        ("store", 2),
        ("restore", per_drain),
    ]
    drains = [drained, step]
    while True:
        more = h.take_events(backlog=per_drain)
        if not more:
            break
        assert sum(len(e.keys) for e in more) <= per_drain
        drains.append(more)
    assert len(drains) == -(-n // per_drain)
    events = [e for d in drains for e in d]
    # Every adopted key exactly once, in adoption order, and the stream
    # replays to the tiers' contents.
    restored = [k for e in events if e.reason == "restore" for k in e.keys]
    assert restored == [f"r{i}" for i in range(n)]
    assert replay(events) == residency(h)


def test_a_reset_behind_a_restore_backlog_keeps_each_keys_order():
    # A reset while the restore's events are still owed: each adopted key's
    # removal comes after its BlockStored, both from the backlog.
    h = TierHierarchy(4, 4)
    h.restore_disk([(f"r{i}", i) for i in range(4)])
    _store(h, ["a"])
    first = h.take_events(backlog=1)
    h.reset()
    events = first + [e for _ in range(20) for e in h.take_events(backlog=1)]
    per_key: dict = {}
    for e in events:
        for k in e.keys:
            per_key.setdefault(k, []).append((e.medium, e.removed, e.reason))
    for i in range(4):
        assert per_key[f"r{i}"] == [
            ("disk", False, "restore"),
            ("disk", True, "reset"),
        ], per_key
    assert per_key["a"] == [("cpu", False, "store"), ("cpu", True, "reset")]
    assert replay(events) == residency(h) == replay([])


def test_an_unbounded_drain_takes_everything():
    h = TierHierarchy(4, 100)
    h.restore_disk([(f"r{i}", i) for i in range(100)])
    _store(h, ["a"])
    assert [(e.reason, len(e.keys)) for e in h.take_events()] == [
        ("store", 1),
        ("restore", 100),
    ]
    assert h.take_events(backlog=1) == []
