"""One tier of the hierarchy: fixed slots, a key -> block map, and a policy.

A tier does bookkeeping only; it never moves bytes. Slots are integers in
``[0, capacity)`` that the worker side maps onto memory (a CPU buffer row)
or onto disk (a slab slot).

Victim choice is O(blocks touched), for every registered policy. The tier
keeps an index of its *eligible* blocks (READY, unpinned, and allowed by the
tier's filter, e.g. "also on disk" for a CPU tier over a disk tier), updated
on every state change, ordered exactly as the policy ranks them: one heap
per policy segment, keyed by the stamps the policy hands out
(:class:`kvtier.tiers.policy.EvictionPolicy`'s victim order). ``victims``
walks only that index, following the policy's ``victim_order`` runs, so a
tier whose blocks are nearly all dirty, pinned or being written answers at
once instead of scanning every block it holds. Only an explicitly bounded
scan (``victims(limit=...)``) walks ``candidates()``.

Not thread-safe: the tier's owner serializes calls.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.tiers.policy import EvictionPolicy, make_policy


class BlockState(Enum):
    WRITING = "writing"  # slot allocated, bytes not yet there: not readable
    READY = "ready"  # readable


@dataclass(slots=True)
class TierBlock:
    slot: int
    state: BlockState
    # Readers (loads, spills or promotions reading this slot) in flight.
    pins: int = 0
    # Why the block is being written: "store", "spill", "promote", "restore".
    origin: str = "store"

    @property
    def evictable(self) -> bool:
        return self.state is BlockState.READY and self.pins == 0


_READY = BlockState.READY


class Tier:
    """Capacity, slot allocator, key map and eviction policy of one medium.

    Invariants: ``len(self) <= capacity``; every resident key holds exactly
    one slot and no two keys share one; a block that is WRITING or pinned is
    never offered as a victim.

    Block state changes go through the tier's methods (``pin``, ``unpin``,
    ``mark_ready``...), which keep the eligible index current. When what the
    tier's ``filter`` depends on changes outside the tier, the owner calls
    :meth:`refresh` for that key.
    """

    def __init__(
        self, medium: str, capacity: int, policy: str | EvictionPolicy = "lru"
    ):
        if capacity < 0:
            raise ValueError(f"{medium} tier capacity must be >= 0, got {capacity}")
        self.medium = medium
        self.capacity = capacity
        self.policy = (
            make_policy(policy, capacity) if isinstance(policy, str) else policy
        )
        self._blocks: dict[Hashable, TierBlock] = {}
        # ``get(key)``: the block of ``key`` or None. The dict's own method
        # (the dict is never replaced), so the hottest query costs no frame.
        self.get: Callable[[Hashable], TierBlock | None] = self._blocks.get
        # Slots never handed out yet are implicit (a counter), so building a
        # tier of millions of slots costs nothing.
        self._next_fresh = 0
        self._free: list[int] = []
        # Eligible index. ``_pos[key]`` = the policy's (segment, stamp) of
        # every resident key, as of its last insert/touch; ``_eligible`` the
        # keys that may be victims now; one heap of (stamp, key) per segment
        # holding every eligible key, plus stale entries dropped lazily when
        # popped (an entry is live iff the key is eligible and its _pos
        # matches).
        self.filter: Callable[[Hashable, TierBlock], bool] | None = None
        self._pos: dict[Hashable, tuple[int, int]] = {}
        self._eligible: set[Hashable] = set()
        # key -> stamp of the entry it has in a heap (live or, while the key
        # is ineligible, dormant): a pin/unpin cycle pushes nothing.
        self._heaped: dict[Hashable, int] = {}
        self._heaps: list[list[tuple[int, Hashable]]] = [
            [] for _ in range(self.policy.segments)
        ]
        # Candidates examined by ``victims`` (index entries, or policy
        # candidates of a bounded scan), for tests and benchmarks.
        self.inspected = 0

    # --- queries ---

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def is_ready(self, key: Hashable) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.state is BlockState.READY

    @property
    def num_free(self) -> int:
        return len(self._free) + self.capacity - self._next_fresh

    @property
    def num_eligible(self) -> int:
        """Blocks that may be chosen as victims now."""
        return len(self._eligible)

    def ready_keys(self) -> set[Hashable]:
        """Keys whose block is READY (O(n): tests and tools)."""
        return {k for k, b in self._blocks.items() if b.state is BlockState.READY}

    def keys(self) -> Iterator[Hashable]:
        return iter(self._blocks)

    def items(self) -> Iterator[tuple[Hashable, TierBlock]]:
        return iter(self._blocks.items())

    # --- mutations ---

    def allocate(self, key: Hashable, origin: str = "store") -> TierBlock:
        """Give ``key`` a free slot in state WRITING. Caller checked room."""
        if key in self._blocks:
            raise KeyError(f"{key!r} already resident in {self.medium} tier")
        if self._free:
            slot = self._free.pop()
        elif self._next_fresh < self.capacity:
            slot = self._next_fresh
            self._next_fresh += 1
        else:
            raise RuntimeError(f"{self.medium} tier is full")
        block = TierBlock(slot=slot, state=BlockState.WRITING, origin=origin)
        self._blocks[key] = block
        self.policy.insert(key)
        self._reposition(key, eligible=False)  # WRITING: not eligible yet
        return block

    def restore(self, entries: list[tuple[Hashable, int]]) -> None:
        """Register READY blocks at known slots (warm restart).

        Only on an empty tier; ``entries`` are oldest first, which becomes
        the policy's recency order. O(capacity) once."""
        if self._blocks or self._next_fresh:
            raise RuntimeError(f"restore into a non-empty {self.medium} tier")
        used: set[int] = set()
        for key, slot in entries:
            if not 0 <= slot < self.capacity:
                raise ValueError(f"slot {slot} outside {self.medium} tier capacity")
            if slot in used or key in self._blocks:
                raise KeyError(f"duplicate key {key!r} or slot {slot}")
            used.add(slot)
            self._blocks[key] = TierBlock(
                slot=slot, state=BlockState.READY, origin="restore"
            )
            self.policy.insert(key)
            self._reposition(key)
        # Free slots go on a stack popped from the end: keep low slots last
        # so fresh allocations fill the slab front to back.
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        self._next_fresh = self.capacity

    def mark_ready(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        block.state = BlockState.READY
        self.refresh(key)
        return block

    def remove(self, key: Hashable, evicted: bool = False) -> TierBlock:
        """Drop ``key`` and free its slot."""
        block = self._blocks.pop(key)
        self.policy.remove(key, evicted)
        self._free.append(block.slot)
        self._pos.pop(key, None)
        self._heaped.pop(key, None)
        self._eligible.discard(key)  # its heap entry goes stale
        return block

    def touch(self, key: Hashable) -> None:
        if key in self._blocks:
            self.policy.touch(key)
            self._reposition(key)

    def pin(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        block.pins += 1
        self._eligible.discard(key)
        return block

    def unpin(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        if block.pins <= 0:
            raise RuntimeError(f"unpin of unpinned {key!r} in {self.medium} tier")
        block.pins -= 1
        if block.pins == 0:
            self.refresh(key)
        return block

    # --- batches: the same as one call per key, in order, minus the calls ---

    def allocate_many(self, keys: Sequence[Hashable], origin: str) -> list[int]:
        """``allocate(key, origin)`` for each key in order; returns the
        slots. Caller checked room for all. O(len(keys))."""
        blocks, free, insert = self._blocks, self._free, self.policy.insert
        pos, position = self._pos, self.policy.position
        writing = BlockState.WRITING
        slots: list[int] = []
        for key in keys:
            if key in blocks:
                raise KeyError(f"{key!r} already resident in {self.medium} tier")
            if free:
                slot = free.pop()
            elif self._next_fresh < self.capacity:
                slot = self._next_fresh
                self._next_fresh += 1
            else:
                raise RuntimeError(f"{self.medium} tier is full")
            blocks[key] = TierBlock(slot, writing, 0, origin)
            insert(key)
            # _reposition(key, eligible=False), inlined: WRITING blocks are
            # never eligible.
            pos[key] = position(key)
            slots.append(slot)
        return slots

    def mark_ready_many(self, keys: Sequence[Hashable]) -> None:
        """``mark_ready(key)`` for each key in order. O(len(keys) log n)."""
        blocks, refresh = self._blocks, self.refresh
        ready = BlockState.READY
        for key in keys:
            blocks[key].state = ready
            refresh(key)

    def pin_many(self, keys: Sequence[Hashable]) -> list[TierBlock]:
        """``pin(key)`` for each key in order; returns the blocks. O(len)."""
        blocks, discard = self._blocks, self._eligible.discard
        out: list[TierBlock] = []
        for key in keys:
            block = blocks[key]
            block.pins += 1
            discard(key)
            out.append(block)
        return out

    def unpin_many(self, keys: Sequence[Hashable]) -> None:
        """``unpin(key)`` for each key in order. O(len(keys) log n)."""
        blocks, refresh = self._blocks, self.refresh
        for key in keys:
            block = blocks[key]
            if block.pins <= 0:
                raise RuntimeError(f"unpin of unpinned {key!r} in {self.medium} tier")
            block.pins -= 1
            if not block.pins:
                refresh(key)

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        """``touch(key)`` for each key in order (the last ends up most
        recent). O(len(keys) log n)."""
        blocks, touch, reposition = self._blocks, self.policy.touch, self._reposition
        for key in keys:
            if key in blocks:
                touch(key)
                reposition(key)

    def remove_many(self, keys: Sequence[Hashable], evicted: bool) -> None:
        """``remove(key, evicted)`` for each key in order. O(len(keys))."""
        blocks, free, policy_remove = self._blocks, self._free, self.policy.remove
        pos, heaped, eligible = self._pos, self._heaped, self._eligible
        for key in keys:
            free.append(blocks.pop(key).slot)
            policy_remove(key, evicted)
            pos.pop(key, None)
            heaped.pop(key, None)
            eligible.discard(key)  # its heap entry goes stale

    # --- eligible index ---

    def set_filter(self, accept: Callable[[Hashable, TierBlock], bool] | None) -> None:
        """Narrow victims to evictable blocks ``accept`` allows. The owner
        calls :meth:`refresh` whenever ``accept``'s answer for a resident
        key may have changed. O(blocks) once."""
        self.filter = accept
        for key in self._blocks:
            self.refresh(key)

    def refresh(self, key: Hashable) -> None:
        """Re-evaluate whether ``key`` may be a victim. O(log n)."""
        block = self._blocks.get(key)
        if block is None:
            return
        if (
            block.state is _READY
            and not block.pins
            and (self.filter is None or self.filter(key, block))
        ):
            if key not in self._eligible:
                self._eligible.add(key)
                self._push(key)
        else:
            self._eligible.discard(key)

    def _reposition(self, key: Hashable, eligible: bool = True) -> None:
        """``key`` was inserted into or touched in the policy: record where
        the policy put it (only that key's position changed).
        ``eligible=False``: the caller knows the key may not be a victim (a
        block just allocated), so nothing is re-checked."""
        self._pos[key] = self.policy.position(key)
        if key in self._eligible:
            self._push(key)  # the old entry is stale now
        elif eligible:
            self.refresh(key)

    def _push(self, key: Hashable) -> None:
        seg, stamp = self._pos[key]
        if self._heaped.get(key) == stamp:
            return  # its entry is still there
        self._heaped[key] = stamp
        heap = self._heaps[seg]
        heapq.heappush(heap, (stamp, key))
        if len(heap) > 2 * len(self._eligible) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop stale entries: O(eligible), after at least as many pushes."""
        heaps: list[list[tuple[int, Hashable]]] = [[] for _ in self._heaps]
        self._heaped = {}
        for key in self._eligible:
            seg, stamp = self._pos[key]
            heaps[seg].append((stamp, key))
            self._heaped[key] = stamp
        for heap in heaps:
            heapq.heapify(heap)
        self._heaps = heaps

    def eligible_in_order(self) -> list[Hashable]:
        """Every eligible key, most evictable first (O(n); for tests)."""
        return self.victims(len(self._eligible))

    def check_index(self) -> None:
        """Assert the eligible index agrees with a full scan (O(n); tests)."""
        expect = [
            k
            for k in self.policy.candidates()
            if self._blocks[k].evictable
            and (self.filter is None or self.filter(k, self._blocks[k]))
        ]
        assert set(expect) == self._eligible, (self.medium, expect, self._eligible)
        saved = self.inspected
        got = self.eligible_in_order()
        self.inspected = saved
        assert got == expect, (self.medium, got, expect)

    def victims(
        self,
        n: int,
        accept: Callable[[Hashable, TierBlock], bool] | None = None,
        exclude: set[Hashable] | frozenset[Hashable] = frozenset(),
        limit: int | None = None,
    ) -> list[Hashable]:
        """Up to ``n`` eligible keys in policy order (nothing is removed).

        Eligible: READY, unpinned and allowed by the tier's ``filter``.
        ``accept`` can narrow the choice further per call. Cost is
        proportional to the eligible candidates inspected (the chosen, the
        excluded and those ``accept`` rejects), plus stale index entries,
        each dropped once: never to the blocks that may not be victims.
        With ``limit``, only the first ``limit`` keys of the policy's order
        (eligible or not) are considered, as a bounded scan."""
        chosen: list[Hashable] = []
        if n <= 0 or not self._eligible:
            return chosen
        if limit is not None:
            return self._scan(n, accept, exclude, limit)
        held: list[tuple[int, tuple[int, Hashable]]] = []
        seen: set[Hashable] = set()
        eligible, pos, blocks = self._eligible, self._pos, self._blocks
        heaped = self._heaped
        for seg, stop in self.policy.victim_order():
            heap = self._heaps[seg]
            while heap and len(chosen) < n:
                if stop is not None and heap[0][0] >= stop:
                    break  # the rest of this segment comes in a later run
                entry = heapq.heappop(heap)
                self.inspected += 1
                stamp, key = entry
                if key in seen or key not in eligible or pos[key] != (seg, stamp):
                    # Stale, dormant (the key is ineligible now) or a
                    # duplicate: gone for good.
                    if heaped.get(key) == stamp and key not in seen:
                        del heaped[key]
                    continue
                seen.add(key)
                held.append((seg, entry))
                if key in exclude:
                    continue
                if accept is not None and not accept(key, blocks[key]):
                    continue
                chosen.append(key)
            if len(chosen) >= n:
                break
        for seg, entry in held:
            heapq.heappush(self._heaps[seg], entry)
        return chosen

    def _scan(
        self,
        n: int,
        accept: Callable[[Hashable, TierBlock], bool] | None,
        exclude: set[Hashable] | frozenset[Hashable],
        limit: int,
    ) -> list[Hashable]:
        """Victims among the first ``limit`` of the policy's candidates (a
        bounded scan); stops once every eligible key was seen."""
        chosen: list[Hashable] = []
        candidates = itertools.islice(self.policy.candidates(), limit)
        eligible = self._eligible
        left = len(eligible)
        for key in candidates:
            self.inspected += 1
            if key not in eligible:
                continue
            left -= 1
            if key not in exclude and (
                accept is None or accept(key, self._blocks[key])
            ):
                chosen.append(key)
                if len(chosen) >= n:
                    break
            if left == 0:
                break
        return chosen

    def clear(self) -> list[Hashable]:
        """Forget every block; returns the keys that were READY."""
        ready = [k for k, b in self._blocks.items() if b.state is BlockState.READY]
        for key in list(self._blocks):
            self.policy.remove(key, evicted=False)
        self._blocks.clear()
        self._free.clear()
        self._next_fresh = 0
        self._pos.clear()
        self._eligible.clear()
        self._heaped.clear()
        self._heaps = [[] for _ in self._heaps]
        return ready
