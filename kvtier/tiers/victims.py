"""The victim index of one tier: which blocks may be evicted, in policy order.

A :class:`~kvtier.tiers.tier.Tier` owns one :class:`VictimIndex` and tells
it about every change of a resident key's policy position and of whether
the key may be a victim (*eligible*: READY, unpinned, allowed by the tier's
filter). The index keeps the eligible keys ordered exactly as the policy
ranks them: one heap per policy segment, keyed by the stamps the policy
hands out (:class:`kvtier.tiers.policy.EvictionPolicy`'s victim order).
Choosing victims walks only that index, following the policy's
``victim_order`` runs, so a tier whose blocks are nearly all dirty, pinned
or being written answers at once instead of scanning every block it holds.

Stale entries (a key touched since it was pushed, made ineligible, or
removed) stay in the heaps and are dropped when popped, each once; an entry
is live iff its key is eligible and its stamp is the key's current one. A
key made ineligible keeps its entry (dormant) so that a pin/unpin cycle
pushes nothing. Heaps are rebuilt when stale entries outnumber live ones,
so their size stays O(eligible) and every operation is amortized
O(log eligible) per key changed or inspected.

Not thread-safe: the tier's owner serializes calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

# One run of a victim order (see kvtier.tiers.policy.Run).
Runs = Sequence[tuple[int, int | None]]


class VictimIndex:
    """Eligible keys of one tier, by (segment, stamp).

    ``pos[key]`` is the policy position of every resident key as of its
    last insert/touch; ``eligible`` the keys that may be victims now;
    ``heaped[key]`` the stamp of the entry a key has in a heap (live or
    dormant). The tier reads and writes these three directly in its hot
    batch loops (one attribute load per batch instead of one call per key);
    it keeps them consistent by the rules of :meth:`admit`, :meth:`place`
    and :meth:`forget`, which its per-key paths call."""

    def __init__(self, segments: int) -> None:
        self.pos: dict[Hashable, tuple[int, int]] = {}
        self.eligible: set[Hashable] = set()
        self.heaped: dict[Hashable, int] = {}
        self.heaps: list[list[tuple[int, Hashable]]] = [[] for _ in range(segments)]
        # Entries examined by ``victims``, for tests and benchmarks.
        self.inspected = 0

    def __len__(self) -> int:
        return len(self.eligible)

    def place(self, key: Hashable, position: tuple[int, int]) -> bool:
        """Record ``key``'s new policy position; an eligible key's entry is
        re-pushed (its old one goes stale). Returns whether the key is
        eligible. O(log n)."""
        self.pos[key] = position
        if key in self.eligible:
            self.push(key)
            return True
        return False

    def admit(self, key: Hashable) -> None:
        """``key`` (positioned) may be a victim now. O(log n), O(1) if it
        already was or its dormant entry is still current."""
        if key not in self.eligible:
            self.eligible.add(key)
            self.push(key)

    def push(self, key: Hashable) -> None:
        """Give eligible ``key`` a heap entry at its current position,
        unless it has one already."""
        seg, stamp = self.pos[key]
        if self.heaped.get(key) == stamp:
            return  # its entry is still there
        self.heaped[key] = stamp
        heap = self.heaps[seg]
        heapq.heappush(heap, (stamp, key))
        if len(heap) > 2 * len(self.eligible) + 64:
            self.rebuild()

    def admit_many(self, keys: Iterable[Hashable]) -> None:
        """``admit(key)`` for each key in order, in one frame (the heaps are
        checked for rebuilding once, after the batch: rebuilding keeps the
        order, so when it happens changes nothing but memory)."""
        eligible, pos, heaped, heaps = self.eligible, self.pos, self.heaped, self.heaps
        add, heappush = eligible.add, heapq.heappush
        pushed = False
        for key in keys:
            if key in eligible:
                continue
            add(key)
            seg, stamp = pos[key]
            if heaped.get(key) != stamp:
                heaped[key] = stamp
                heappush(heaps[seg], (stamp, key))
                pushed = True
        if pushed:
            self._check_size()

    def place_many(self, keys: Iterable[Hashable]) -> None:
        """Re-push each eligible key at its (new) recorded position: what
        :meth:`place` does after ``pos`` was updated. One frame."""
        pos, heaped, heaps = self.pos, self.heaped, self.heaps
        heappush = heapq.heappush
        for key in keys:
            seg, stamp = pos[key]
            if heaped.get(key) != stamp:
                heaped[key] = stamp
                heappush(heaps[seg], (stamp, key))
        self._check_size()

    def _check_size(self) -> None:
        bound = 2 * len(self.eligible) + 64
        if any(len(heap) > bound for heap in self.heaps):
            self.rebuild()

    def forget(self, key: Hashable) -> None:
        """``key`` left the tier; its entry (if any) goes stale. O(1)."""
        self.pos.pop(key, None)
        self.heaped.pop(key, None)
        self.eligible.discard(key)

    def forget_many(self, keys: Iterable[Hashable]) -> None:
        pos_pop, heaped_pop = self.pos.pop, self.heaped.pop
        discard = self.eligible.discard
        for key in keys:
            pos_pop(key, None)
            heaped_pop(key, None)
            discard(key)

    def rebuild(self) -> None:
        """Drop stale entries: O(eligible), after at least as many pushes."""
        heaps: list[list[tuple[int, Hashable]]] = [[] for _ in self.heaps]
        heaped: dict[Hashable, int] = {}
        pos = self.pos
        for key in self.eligible:
            seg, stamp = pos[key]
            heaps[seg].append((stamp, key))
            heaped[key] = stamp
        for heap in heaps:
            heapq.heapify(heap)
        self.heaps = heaps
        self.heaped = heaped

    def clear(self) -> None:
        self.pos.clear()
        self.eligible.clear()
        self.heaped.clear()
        self.heaps = [[] for _ in self.heaps]

    def victims(
        self,
        n: int,
        runs: Runs,
        accept: Callable[[Hashable], bool] | None,
        exclude: set[Hashable] | frozenset[Hashable],
        take: bool,
    ) -> list[Hashable]:
        """Up to ``n`` eligible keys, not in ``exclude`` and passing
        ``accept``, in the order of ``runs`` (the policy's victim order).

        ``take=False``: nothing changes but the dropping of stale entries.
        ``take=True``: the chosen keys leave the index (no longer eligible,
        no entry), one heap pop each; the caller removes them from the tier
        or re-admits them. Cost: O(log n) per entry inspected (the chosen,
        the excluded, those ``accept`` rejects, and stale entries, each
        dropped once)."""
        if take and accept is None:
            return self._take(n, runs, exclude)
        chosen: list[Hashable] = []
        held: list[tuple[int, tuple[int, Hashable]]] = []
        seen: set[Hashable] = set()
        eligible, pos, heaped = self.eligible, self.pos, self.heaped
        heappop = heapq.heappop
        inspected = 0
        for seg, stop in runs:
            heap = self.heaps[seg]
            while heap and len(chosen) < n:
                if stop is not None and heap[0][0] >= stop:
                    break  # the rest of this segment comes in a later run
                entry = heappop(heap)
                inspected += 1
                stamp, key = entry
                if key in seen or key not in eligible or pos[key] != (seg, stamp):
                    # Stale, dormant (the key is ineligible now) or a
                    # duplicate: gone for good.
                    if key not in seen and heaped.get(key) == stamp:
                        del heaped[key]
                    continue
                seen.add(key)
                if key in exclude or (accept is not None and not accept(key)):
                    held.append((seg, entry))
                    continue
                chosen.append(key)
                if take:
                    del heaped[key]
                    eligible.discard(key)
                else:
                    held.append((seg, entry))
            if len(chosen) >= n:
                break
        self.inspected += inspected
        heaps = self.heaps
        for seg, entry in held:
            heapq.heappush(heaps[seg], entry)
        return chosen

    def _take(
        self,
        n: int,
        runs: Runs,
        exclude: set[Hashable] | frozenset[Hashable],
    ) -> list[Hashable]:
        """``victims(n, runs, None, exclude, take=True)`` with less work per
        entry: a chosen key leaves ``eligible`` at once, so no set of keys
        seen is needed (a duplicate entry of a chosen key is then stale; of
        an excluded key, held once more: the heap may keep it, the victims
        are the same)."""
        chosen: list[Hashable] = []
        held: list[tuple[int, tuple[int, Hashable]]] = []
        eligible, pos, heaped = self.eligible, self.pos, self.heaped
        discard, heappop = eligible.discard, heapq.heappop
        inspected = 0
        for seg, stop in runs:
            heap = self.heaps[seg]
            while heap and len(chosen) < n:
                if stop is not None and heap[0][0] >= stop:
                    break  # the rest of this segment comes in a later run
                entry = heappop(heap)
                inspected += 1
                stamp, key = entry
                if key not in eligible or pos[key] != (seg, stamp):
                    # Stale or dormant: gone for good.
                    if heaped.get(key) == stamp:
                        del heaped[key]
                elif key in exclude:
                    held.append((seg, entry))
                else:
                    chosen.append(key)
                    del heaped[key]
                    discard(key)
            if len(chosen) >= n:
                break
        self.inspected += inspected
        heaps = self.heaps
        for seg, entry in held:
            heapq.heappush(heaps[seg], entry)
        return chosen


def scan_victims(
    n: int,
    candidates: Iterable[Hashable],
    eligible: set[Hashable],
    accept: Callable[[Hashable], bool] | None,
    exclude: set[Hashable] | frozenset[Hashable],
    counter: Any,
) -> list[Hashable]:
    """Victims among ``candidates`` (a bounded prefix of the policy's
    order): the first ``n`` eligible ones not excluded and accepted; stops
    once every eligible key was seen. ``counter.inspected`` counts the
    candidates examined. O(candidates consumed)."""
    chosen: list[Hashable] = []
    left = len(eligible)
    inspected = 0
    for key in candidates:
        inspected += 1
        if key not in eligible:
            continue
        left -= 1
        if key not in exclude and (accept is None or accept(key)):
            chosen.append(key)
            if len(chosen) >= n:
                break
        if left == 0:
            break
    counter.inspected += inspected
    return chosen
