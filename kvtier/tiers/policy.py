"""Eviction policies: the order in which a tier gives up its blocks.

A policy only ranks keys; it knows nothing of slots, pins or I/O. The tier
asks it for candidates in eviction order and skips those it may not evict
(pinned, being written), so a policy never has to be told about pins.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice

POLICIES = ("lru", "arc", "2q", "arcdk")


class EvictionPolicy(ABC):
    """Ranks the keys resident in one tier.

    Contract: every resident key was ``insert``-ed exactly once and is
    ``remove``-d exactly once when it leaves; ``candidates`` yields each
    resident key at most once, most evictable first, lazily (callers stop
    early, so the cost is proportional to what they consume).
    """

    name = ""  # what make_policy accepts for it

    def __init__(self, capacity: int):
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """A key became resident (its store started)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """A resident key was used (hit, load, or re-offered for store)."""

    @abstractmethod
    def remove(self, key: Hashable, evicted: bool) -> None:
        """A resident key left; ``evicted`` when the policy chose it."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Resident keys, most evictable first."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # Snapshot-free iteration would break if the caller evicts while
        # iterating; callers collect first, then evict, so iterate directly.
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    T1 holds keys seen once, T2 keys seen at least twice; B1/B2 remember
    recently evicted keys of each list (ghosts, keys only). A re-insert that
    hits a ghost list shifts the target size ``p`` of T1 toward the list
    that would have kept it, so the cache adapts between recency and
    frequency. Scan-resistant: one pass over new keys only churns T1.
    """

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        c = max(self.capacity, 1)
        if key in self._b1:
            self.p = min(c, self.p + max(len(self._b2) / max(len(self._b1), 1), 1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / max(len(self._b2), 1), 1))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            ghost = self._b1
        elif key in self._t2:
            del self._t2[key]
            ghost = self._b2
        else:
            return
        if evicted:
            ghost[key] = None
            # Ghost lists are bounded by the capacity together with their
            # resident lists, as in the paper: |T1|+|B1| <= c, total <= 2c.
            while len(self._b1) + len(self._b2) > self.capacity:
                (self._b1 if len(self._b1) >= len(self._b2) else self._b2).popitem(
                    last=False
                )

    def candidates(self) -> Iterator[Hashable]:
        # ARC's REPLACE: take from T1 while it exceeds its target p.
        if self._t1 and len(self._t1) > self.p:
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


_M64 = (1 << 64) - 1
_MIX1 = 0x9E3779B97F4A7C15  # odd 64-bit constants (Fibonacci hashing)
_MIX2 = 0xC2B2AE3D27D4EB4F


class Doorkeeper:
    """Has this key been seen among the last ``window`` to ``2 * window``
    keys added? A Bloom filter (two bits per key, 16 bits of filter per
    key of window, so ~1 % false positives) in two generations: the current
    one takes new keys, the previous one is still asked, and after
    ``window`` additions the previous is dropped. 4 bytes per key of window
    whatever the keys are; never a false negative within the window. O(1).

    ``hash(key)`` is mixed by two multiplications, so keys whose hashes
    are sequential (the integer block ids of a trace) collide as often as
    real block hashes do: ``kvtier size`` then predicts what the plugin gets.
    """

    def __init__(self, window: int):
        self.window = max(64, window)
        self._bits = (16 * self.window - 1).bit_length()  # >= 16 bits per key
        self._shift = 64 - self._bits
        self._nbytes = (1 << self._bits) // 8
        self._cur = bytearray(self._nbytes)
        self._prev = bytearray(self._nbytes)
        self._added = 0

    def _index(self, key: Hashable) -> tuple[int, int, int, int]:
        h = hash(key)
        a = ((h * _MIX1) & _M64) >> self._shift
        b = ((h * _MIX2) & _M64) >> self._shift
        return a >> 3, 1 << (a & 7), b >> 3, 1 << (b & 7)

    def __contains__(self, key: Hashable) -> bool:
        ia, ma, ib, mb = self._index(key)
        cur, prev = self._cur, self._prev
        return bool(
            (cur[ia] & ma and cur[ib] & mb) or (prev[ia] & ma and prev[ib] & mb)
        )

    def add(self, key: Hashable) -> bool:
        """Remember ``key``; returns whether it was already remembered."""
        ia, ma, ib, mb = self._index(key)
        cur, prev = self._cur, self._prev
        seen = bool(
            (cur[ia] & ma and cur[ib] & mb) or (prev[ia] & ma and prev[ib] & mb)
        )
        cur[ia] |= ma
        cur[ib] |= mb
        self._added += 1
        if self._added >= self.window:
            self._prev, self._cur = cur, bytearray(self._nbytes)
            self._added = 0
        return seen


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
    reused too rarely to survive in the main LRU then crowd it (10x lost to
    5x at small tiers on the tuning half of the trace). O(1) per call;
    ~4 bytes per key of history.
    """

    name = "2q"

    def __init__(self, capacity: int, small: float = 0.1, history: float = 5.0):
        super().__init__(capacity)
        self.small_target = max(1, int(small * capacity))
        self.doorkeeper = Doorkeeper(int(history * max(capacity, 1)))
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if self.doorkeeper.add(key):
            self._main[key] = None
        else:
            self._probation[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._probation:
            del self._probation[key]
            self._main[key] = None
        elif key in self._main:
            self._main.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            self._main.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        excess = len(self._probation) - self.small_target
        if excess > 0:
            yield from islice(self._probation, excess)
            yield from self._main
            yield from islice(self._probation, excess, None)
        else:
            yield from self._main
            yield from self._probation

    def __len__(self) -> int:
        return len(self._probation) + len(self._main)


class ARCDoorkeeperPolicy(ARCPolicy):
    """ARC whose memory of "seen before" reaches past its ghost lists.

    ARC sends a key to T2 (the frequency side) only when it finds it in a
    ghost list, which remembers evicted keys for about one capacity; a
    prefix cache's blocks come back after many capacities. Here a key that
    is in no ghost list but in the doorkeeper (the same Bloom filter as
    ``2q``'s: every inserted key of the last ``history`` = 5 capacities)
    also goes to T2, without moving ARC's target ``p`` (that is reserved for
    ghost hits, which say which list was too short). Everything else is ARC,
    so a tier that is small next to the short-term reuse still adapts toward
    recency, where ``2q``'s fixed 10 % probation cannot. O(1) per call.
    """

    name = "arcdk"

    def __init__(self, capacity: int, history: float = 5.0):
        super().__init__(capacity)
        self.doorkeeper = Doorkeeper(int(history * max(capacity, 1)))

    def insert(self, key: Hashable) -> None:
        seen = self.doorkeeper.add(key)
        if seen and key not in self._b1 and key not in self._b2:
            self._t2[key] = None
        else:
            super().insert(key)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a policy by name; unknown names raise ``ValueError``."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    if name == "2q":
        return TwoQueuePolicy(capacity)
    if name == "arcdk":
        return ARCDoorkeeperPolicy(capacity)
    raise ValueError(
        f"unknown eviction policy {name!r}: accepted values are {POLICIES}"
    )
