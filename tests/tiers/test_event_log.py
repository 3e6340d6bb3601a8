"""``EventLog``: the bounded backlog of bulk events (warm restart, reset)
keeps each key's order and delays no other event."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.events import BULK_KINDS, EventLog

BULK = list(BULK_KINDS)
OTHER = [
    ("cpu", False, "store"),
    ("disk", False, "spill"),
    ("cpu", True, "evict"),
    ("disk", True, "corrupt"),
]


def test_an_event_naming_an_owed_key_takes_its_backlog_event_along():
    log = EventLog()
    log.record([f"r{i}" for i in range(10)], "disk", False, "restore")
    log.record(["r5"], "disk", True, "corrupt")
    first = [(list(e.keys), e.reason) for e in log.take(backlog=1)]
    # The step's event goes out at once, its key's restore just before it;
    # then one key of the backlog.
    assert first == [(["r5"], "restore"), (["r5"], "corrupt"), (["r0"], "restore")]
    rest = [k for e in log.take(backlog=100) for k in e.keys]
    assert rest == [f"r{i}" for i in range(1, 10) if i != 5]
    assert log.take(backlog=100) == []


def test_a_weighted_reason_counts_each_key_as_its_weight():
    """A key of a reset counts 4 against the backlog, a restored one 1; a
    drain hands out at least one key whatever the weights."""
    log = EventLog()
    log.record([f"r{i}" for i in range(6)], "disk", False, "restore")
    log.record([f"x{i}" for i in range(6)], "cpu", True, "reset")
    weights = {"reset": 4}
    taken = [[list(e.keys) for e in log.take(8, weights)] for _ in range(4)]
    assert taken == [
        [["r0", "r1", "r2", "r3", "r4", "r5"], ["x0"]],  # 6 + 4: the last one over
        [["x1", "x2"]],
        [["x3", "x4"]],
        [["x5"]],
    ]
    log.record(["y0", "y1"], "cpu", True, "reset")
    assert [list(e.keys) for e in log.take(1, weights)] == [["y0"]]
    assert log.has_backlog and log.owes("y1") and not log.owes("y0")


def test_a_key_s_reset_removals_go_cpu_first_whichever_was_recorded_first():
    """A reset that found the CPU tier empty records its disk removals
    first; a later reset's removals of a key still go out CPU then disk
    (a subscriber's tracker keeps the payload until the last one)."""
    log = EventLog()
    log.record(["w"], "disk", True, "reset")  # the first reset: disk only
    log.take()
    log.record(["k"], "cpu", True, "reset")
    log.record(["k"], "disk", True, "reset")
    log.record(["k"], "cpu", False, "store")  # k stored again: settles both
    out = [(e.medium, e.reason) for e in log.take(backlog=0)]
    assert out == [("cpu", "reset"), ("disk", "reset"), ("cpu", "store")]


@pytest.mark.parametrize("seed", range(60))
def test_random_streams_keep_each_keys_order_and_bound_the_backlog(seed: int):
    rng = random.Random(seed)
    log = EventLog()
    recorded: dict[str, list[tuple]] = {}
    emitted: dict[str, list[tuple]] = {}
    keys = [f"k{i}" for i in range(30)]
    # What the hierarchy guarantees (EventLog's doc): between two other
    # events of a key, it owes each bulk kind at most once, in BULK_KINDS'
    # order.
    owed: dict[str, list[tuple]] = {}
    for _ in range(200):
        op = rng.random()
        if op < 0.15:
            kind = rng.choice(BULK)
            rank = BULK.index(kind)
            batch = [
                k
                for k in rng.sample(keys, rng.randint(1, 20))
                if all(BULK.index(o) < rank for o in owed.get(k, ()))
            ]
            if not batch:
                continue
            for k in batch:
                owed.setdefault(k, []).append(kind)
        elif op < 0.6:
            kind = rng.choice(OTHER)
            batch = rng.sample(keys, rng.randint(1, 4))
            for k in batch:
                owed.pop(k, None)
        else:
            k = rng.choice([None, 0, 1, 3, 8])
            since = sum(1 for v in recorded.values() for _ in v) - sum(
                1 for v in emitted.values() for _ in v
            )
            out = log.take(backlog=k)
            bulk_out = sum(len(e.keys) for e in out if e.reason in ("restore", "reset"))
            if k is not None:
                # Owed bulk events leave with a later event of their key
                # (at most one per bulk kind); the backlog itself hands out
                # at most k keys.
                other_out = sum(len(e.keys) for e in out) - bulk_out
                assert bulk_out <= k + len(BULK) * other_out, (bulk_out, k, other_out)
            assert sum(len(e.keys) for e in out) <= since
            for e in out:
                for key in e.keys:
                    emitted.setdefault(key, []).append((e.medium, e.removed, e.reason))
            continue
        log.record(batch, *kind)
        for key in batch:
            recorded.setdefault(key, []).append(kind)
    for e in log.take():
        for key in e.keys:
            emitted.setdefault(key, []).append((e.medium, e.removed, e.reason))
    # Every recorded event exactly once, in each key's order.
    assert emitted == recorded
