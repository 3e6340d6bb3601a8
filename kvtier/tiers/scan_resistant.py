"""The scan-resistant eviction policies: ARC, 2Q and ARC with a doorkeeper.

Each keeps a recency side and a frequency side (ghost lists or a Bloom
filter remember keys past their eviction), so one long scan of new blocks
cannot flush the blocks that keep coming back. They implement
:class:`~kvtier.tiers.policy.EvictionPolicy`'s contract (segments,
``position``, ``victim_order``) and register by name like LRU.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvtier.tiers.doorkeeper import Doorkeeper
from kvtier.tiers.policy import (
    SEGMENT_SHIFT,
    EvictionPolicy,
    Run,
    StampOrder,
    register_policy,
)

_T1, _T2 = 0, 1
# log2 of the stamps one bucket of a ghost list spans (see ARCPolicy).
_GHOST_BUCKET_BITS = 8


@register_policy
class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    T1 holds keys seen once, T2 keys seen at least twice; B1/B2 remember
    recently evicted keys of each list (ghosts, keys only). A re-insert that
    hits a ghost list shifts the target size ``p`` of T1 toward the list
    that would have kept it, so the cache adapts between recency and
    frequency. Scan-resistant: one pass over new keys only churns T1.
    Segments: T1 and T2, each by last use; T1 goes first while it exceeds
    its target ``p`` (ARC's REPLACE).
    """

    name = "arc"
    summary = (
        "adaptive replacement (ARC): balances recency and frequency with "
        "ghost lists one tier long; scan-resistant, no tuning."
    )
    segments = 2

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        # Resident lists, StampOrders as large as the tier (their keys'
        # positions in ``positions``).
        self.positions: dict[Hashable, int] = {}
        self._t1 = StampOrder()
        self._t2 = StampOrder()
        self._lists = (self._t1, self._t2)
        # Ghost lists, up to a tier's worth of keys together: each ghost's
        # list and stamp in one dict (key -> ``list << SEGMENT_SHIFT |
        # stamp``, B1 = 0, B2 = 1), each list's order a StampOrder, so no
        # OrderedDict of them rebuilds (0.35 s at a million keys, five
        # times a dict's). Small buckets: a ghost list is popped from its
        # front, and a pop walks the front bucket's emptied places.
        self._ghosts: dict[Hashable, int] = {}
        self._ghost_clock = itertools.count()
        self._b1 = StampOrder(_GHOST_BUCKET_BITS)
        self._b2 = StampOrder(_GHOST_BUCKET_BITS)
        self._ghost_lists = (self._b1, self._b2)

    def _place(self, key: Hashable, segment: int) -> None:
        """Append ``key`` to T1 or T2 with the next stamp."""
        self.positions[key] = position = segment << SEGMENT_SHIFT | next(self._clock)
        self._lists[segment].add(key, position)

    def insert(self, key: Hashable) -> None:
        ghost = self._ghosts.pop(key, None)
        if ghost is None:
            self._place(key, _T1)
            return
        c = max(self.capacity, 1)
        b1, b2 = len(self._b1), len(self._b2)
        if ghost >> SEGMENT_SHIFT == _T1:  # in B1
            self.p = min(c, self.p + max(b2 / max(b1, 1), 1))
        else:
            self.p = max(0.0, self.p - max(b1 / max(b2, 1), 1))
        self._ghost_lists[ghost >> SEGMENT_SHIFT].discard(key, ghost)
        self._place(key, _T2)

    def touch(self, key: Hashable) -> None:
        position = self.positions.get(key)
        if position is not None:
            self._lists[position >> SEGMENT_SHIFT].discard(key, position)
            self._place(key, _T2)

    def remove(self, key: Hashable, evicted: bool) -> None:
        position = self.positions.pop(key, None)
        if position is None:
            return
        segment = position >> SEGMENT_SHIFT
        self._lists[segment].discard(key, position)
        if evicted:  # a ghost in B1 (from T1) or B2
            ghosts = self._ghosts
            ghosts[key] = ghost = segment << SEGMENT_SHIFT | next(self._ghost_clock)
            self._ghost_lists[segment].add(key, ghost)
            # Ghost lists are bounded by the capacity together with their
            # resident lists, as in the paper: |T1|+|B1| <= c, total <= 2c.
            b1, b2 = self._ghost_lists
            while len(ghosts) > self.capacity:
                del ghosts[(b1 if len(b1) >= len(b2) else b2).pop_first()]

    def _forget_all(self) -> None:
        self.positions.clear()
        self._t1.clear()
        self._t2.clear()

    def _t1_first(self) -> bool:
        # ARC's REPLACE: take from T1 while it exceeds its target p.
        return bool(self._t1) and len(self._t1) > self.p

    def candidates(self) -> Iterator[Hashable]:
        if self._t1_first():
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def position(self, key: Hashable) -> int:
        return self.positions[key]

    def victim_order(self) -> tuple[Run, ...]:
        if self._t1_first():
            return ((_T1, None), (_T2, None))
        return ((_T2, None), (_T1, None))


_PROBATION, _MAIN = 0, 1


@register_policy
class TwoQueuePolicy(EvictionPolicy):
    """2Q (Johnson & Shasha, VLDB'94) with a TinyLFU-style doorkeeper.

    A key inserted for the first time (not in the doorkeeper) goes to a
    small FIFO, *probation*; a key seen before, or touched while on
    probation, goes to the main LRU. Probation is evicted first while it
    holds more than ``small`` of the capacity (10 %, S3-FIFO's choice), so
    one-time blocks (whole prompts never sent again, most new tails) pass
    through a corner of the tier instead of pushing out blocks that are
    reused. A block sent again within the probation's lifetime still hits;
    one sent again later misses once and is then kept in the main LRU.

    The doorkeeper remembers every inserted key for ``history`` (5) times
    the capacity insertions: 2Q's A1out ghost list remembers only evicted
    keys, for about half the capacity, while a prefix cache's reuse
    distances are many capacities long. Much longer is not better: keys
    reused too rarely to survive in the main LRU then crowd it
    (docs/benchmarks.md, "Hit rate"). O(1) per call; ~6 bytes per key of
    history.

    Segments: probation and main. Probation is kept as its older part
    (beyond the target) and its newest ``small_target`` keys, so the order
    "older probation, main, newest probation" is one stamp threshold.
    """

    name = "2q"
    summary = (
        "a block seen for the first time goes to a FIFO probation of 10 % of "
        "the tier; one seen again within 5 tier capacities (a Bloom filter) "
        "or hit on probation goes to the main LRU."
    )
    segments = 2

    def __init__(self, capacity: int, small: float = 0.1, history: float = 5.0):
        super().__init__(capacity)
        self.small_target = max(1, int(small * capacity))
        self.doorkeeper = Doorkeeper(int(history * max(capacity, 1)))
        self.positions: dict[Hashable, int] = {}
        # Probation = _old + _young in FIFO order; _young (key -> position)
        # holds its newest min(len, small_target) keys, at most a tenth of
        # the tier: _old and _main, as large as the tier, are StampOrders.
        self._old = StampOrder()
        self._young: OrderedDict[Hashable, int] = OrderedDict()
        self._main = StampOrder()

    def insert(self, key: Hashable) -> None:
        stamp = next(self._clock)
        if self.doorkeeper.add(key):
            self.positions[key] = position = _MAIN << SEGMENT_SHIFT | stamp
            self._main.add(key, position)
            return
        self.positions[key] = self._young[key] = stamp  # probation: segment 0
        if len(self._young) > self.small_target:
            oldest, position = self._young.popitem(last=False)
            self._old.add(oldest, position)

    def _leave(self, key: Hashable, position: int) -> None:
        """Take ``key`` (at ``position``) out of its list, keeping _young
        full. O(1)."""
        if position >> SEGMENT_SHIFT == _MAIN:
            self._main.discard(key, position)
        elif self._young.pop(key, None) is None:
            self._old.discard(key, position)
        elif self._old:  # the newest older key is among the newest again
            newest = self._old.pop_last()
            self._young[newest] = self.positions[newest]
            self._young.move_to_end(newest, last=False)

    def touch(self, key: Hashable) -> None:
        position = self.positions.get(key)
        if position is not None:
            self._leave(key, position)
            self.positions[key] = position = _MAIN << SEGMENT_SHIFT | next(self._clock)
            self._main.add(key, position)

    def remove(self, key: Hashable, evicted: bool) -> None:
        position = self.positions.pop(key, None)
        if position is not None:
            self._leave(key, position)

    def _forget_all(self) -> None:
        self.positions.clear()
        self._old.clear()
        self._young.clear()
        self._main.clear()

    def candidates(self) -> Iterator[Hashable]:
        yield from self._old  # probation beyond its target
        yield from self._main
        yield from self._young

    def position(self, key: Hashable) -> int:
        return self.positions[key]

    def victim_order(self) -> tuple[Run, ...]:
        if not self._old:
            return ((_MAIN, None), (_PROBATION, None))
        threshold = next(iter(self._young.values()))
        return ((_PROBATION, threshold), (_MAIN, None), (_PROBATION, None))


@register_policy
class ARCDoorkeeperPolicy(ARCPolicy):
    """ARC whose memory of "seen before" reaches past its ghost lists.

    ARC sends a key to T2 (the frequency side) only when it finds it in a
    ghost list, which remembers evicted keys for about one capacity; a
    prefix cache's blocks come back after many capacities. Here a key that
    is in no ghost list but in the doorkeeper (the same Bloom filter as
    ``2q``'s: every inserted key of the last ``history`` = 5 capacities)
    also goes to T2, without moving ARC's target ``p`` (that is reserved for
    ghost hits, which say which list was too short). Everything else is ARC
    (its segments and victim order included), so a tier that is small next
    to the short-term reuse still adapts toward recency, where ``2q``'s
    fixed 10 % probation cannot. O(1) per call.
    """

    name = "arcdk"
    summary = (
        'ARC whose "seen before" reaches 5 tier capacities back through '
        "2q's Bloom filter: such a block enters ARC's frequency side."
    )

    def __init__(self, capacity: int, history: float = 5.0):
        super().__init__(capacity)
        self.doorkeeper = Doorkeeper(int(history * max(capacity, 1)))

    def insert(self, key: Hashable) -> None:
        seen = self.doorkeeper.add(key)
        if seen and key not in self._ghosts:
            self._place(key, _T2)
        else:
            super().insert(key)
