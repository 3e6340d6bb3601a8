"""Eviction policies: the order in which a tier gives up its blocks.

A policy only ranks keys; it knows nothing of slots, pins or I/O. The tier
asks it for candidates in eviction order and skips those it may not evict
(pinned, being written), so a policy never has to be told about pins.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator

POLICIES = ("lru", "arc")


class EvictionPolicy(ABC):
    """Ranks the keys resident in one tier.

    Contract: every resident key was ``insert``-ed exactly once and is
    ``remove``-d exactly once when it leaves; ``candidates`` yields each
    resident key at most once, most evictable first, lazily (callers stop
    early, so the cost is proportional to what they consume).
    """

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


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a policy by name; unknown names raise ``ValueError``."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(
        f"unknown eviction policy {name!r}: accepted values are {POLICIES}"
    )
