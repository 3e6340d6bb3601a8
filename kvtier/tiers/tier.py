"""One tier of the hierarchy: fixed slots, a key -> block map, and a policy.

A tier does bookkeeping only; it never moves bytes. Slots are integers in
``[0, capacity)`` that the worker side maps onto memory (a CPU buffer row)
or onto disk (a slab slot).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
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


class Tier:
    """Capacity, slot allocator, key map and eviction policy of one medium.

    Invariants: ``len(self) <= capacity``; every resident key holds exactly
    one slot and no two keys share one; a block that is WRITING or pinned is
    never offered as a victim.
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
        # Slots never handed out yet are implicit (a counter), so building a
        # tier of millions of slots costs nothing.
        self._next_fresh = 0
        self._free: list[int] = []

    # --- queries ---

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def get(self, key: Hashable) -> TierBlock | None:
        return self._blocks.get(key)

    def is_ready(self, key: Hashable) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.state is BlockState.READY

    @property
    def num_free(self) -> int:
        return len(self._free) + self.capacity - self._next_fresh

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
        # Free slots go on a stack popped from the end: keep low slots last
        # so fresh allocations fill the slab front to back.
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        self._next_fresh = self.capacity

    def mark_ready(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        block.state = BlockState.READY
        return block

    def remove(self, key: Hashable, evicted: bool = False) -> TierBlock:
        """Drop ``key`` and free its slot."""
        block = self._blocks.pop(key)
        self.policy.remove(key, evicted)
        self._free.append(block.slot)
        return block

    def touch(self, key: Hashable) -> None:
        if key in self._blocks:
            self.policy.touch(key)

    def pin(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        block.pins += 1
        return block

    def unpin(self, key: Hashable) -> TierBlock:
        block = self._blocks[key]
        if block.pins <= 0:
            raise RuntimeError(f"unpin of unpinned {key!r} in {self.medium} tier")
        block.pins -= 1
        return block

    def victims(
        self,
        n: int,
        accept: Callable[[Hashable, TierBlock], bool] | None = None,
        exclude: set[Hashable] | frozenset[Hashable] = frozenset(),
        limit: int | None = None,
    ) -> list[Hashable]:
        """Up to ``n`` evictable keys in policy order (nothing is removed).

        ``accept`` can narrow the choice further (e.g. only blocks that are
        safe to drop). Cost is proportional to the candidates inspected, at
        most ``limit`` of them when given."""
        chosen: list[Hashable] = []
        if n <= 0:
            return chosen
        candidates = self.policy.candidates()
        if limit is not None:
            candidates = itertools.islice(candidates, limit)
        for key in candidates:
            if key in exclude:
                continue
            block = self._blocks[key]
            if not block.evictable:
                continue
            if accept is not None and not accept(key, block):
                continue
            chosen.append(key)
            if len(chosen) >= n:
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
        return ready
