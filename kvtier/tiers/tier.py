"""One tier of the hierarchy: fixed slots, a key -> block map, and a policy.

A tier does bookkeeping only; it never moves bytes. Its blocks and the
free slots they are made on are :mod:`kvtier.tiers.slots`' (a block object
is valid while its key is resident, then reused).

Victim choice is O(blocks touched), for every registered policy: the tier
keeps a :class:`~kvtier.tiers.victims.VictimIndex` of its *eligible* blocks
(READY, unpinned, and allowed by the tier's filter, e.g. "also on disk" for
a CPU tier over a disk tier), updated on every state change and ordered
exactly as the policy ranks them. Only an explicitly bounded scan
(``victims(limit=...)``) walks the policy's ``candidates()``.

Not thread-safe: the tier's owner serializes calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from operator import attrgetter, is_

from kvtier.tiers.policy import EvictionPolicy, make_policy
from kvtier.tiers.slots import BlockState, SlotPool, TierBlock
from kvtier.tiers.victims import VictimIndex

_READY = BlockState.READY
_WRITING = BlockState.WRITING
_state_of = attrgetter("state")


class Tier:
    """Capacity, slot allocator, key map and eviction policy of one medium.

    Invariants: ``len(self) <= capacity``; every resident key holds exactly
    one slot and no two keys share one; a block that is WRITING or pinned is
    never offered as a victim.

    Block state changes go through the tier's methods (``pin``, ``unpin``,
    ``mark_ready``...), which keep the victim index current. When what the
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
        self._slots = SlotPool(medium, capacity)
        # The blocks of keys that left, for reuse: a removal appends here.
        self._free = self._slots.free
        self.filter: Callable[[Hashable, TierBlock], bool] | None = None
        self.index = VictimIndex(self.policy.segments, self.policy.positions)
        # The tier copies the policy's positions into the index unless the
        # policy keeps them where the index reads them.
        self._copy_positions = self.index.owns_pos

    # --- queries ---

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def is_ready(self, key: Hashable) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.state is _READY

    @property
    def num_free(self) -> int:
        return len(self._slots)

    @property
    def num_eligible(self) -> int:
        """Blocks that may be chosen as victims now."""
        return len(self.index.eligible)

    def count_eligible(self, keys: set[Hashable] | frozenset[Hashable]) -> int:
        """How many of ``keys`` may be victims now. O(len(keys))."""
        return sum(map(self.index.eligible.__contains__, keys))

    def keys(self) -> Iterator[Hashable]:
        return iter(self._blocks)

    def items(self) -> Iterator[tuple[Hashable, TierBlock]]:
        return iter(self._blocks.items())

    # --- mutations: each per-key method is its batch (``*_many``) of one ---

    def restore(self, entries: list[tuple[Hashable, int]]) -> None:
        """Register READY blocks at known slots (warm restart).

        Only on an empty tier; ``entries`` are oldest first, which becomes
        the policy's recency order. O(capacity) once, in batches (the
        policy's ``insert_many``, one ``refresh_many``), as a store's blocks
        take them. Invalid entries raise before any block is registered."""
        if self._blocks or not self._slots.pristine:
            raise RuntimeError(f"restore into a non-empty {self.medium} tier")
        keys = [key for key, _ in entries]
        used = {slot for _, slot in entries}
        if len(used) != len(entries) or len(set(keys)) != len(entries):
            raise KeyError(f"duplicate keys or slots among {len(entries)} entries")
        low, high = (min(used), max(used)) if used else (0, -1)
        if low < 0 or high >= self.capacity:
            bad = low if low < 0 else high
            raise ValueError(f"slot {bad} outside {self.medium} tier capacity")
        blocks = self._blocks
        for key, slot in entries:
            blocks[key] = TierBlock(slot, _READY, 0, "restore")
        self._place(keys)
        self.refresh_many(keys)
        self._slots.restore(used)

    def _place(self, keys: Sequence[Hashable]) -> None:
        """The policy learns of the new resident ``keys``, in order (one
        batch); their positions go to the index where it keeps its own."""
        placed = self.policy.insert_many(keys)
        if self._copy_positions:
            self.index.pos.update(zip(keys, placed))

    def mark_ready(self, key: Hashable) -> None:
        self.mark_ready_many((key,))

    def remove(self, key: Hashable, evicted: bool = False) -> TierBlock:
        """Drop ``key`` and free its slot; returns its (freed) block."""
        block = self._blocks[key]
        self.remove_many((key,), evicted)
        return block

    def touch(self, key: Hashable) -> None:
        self.touch_many((key,))

    def unpin(self, key: Hashable) -> None:
        self.unpin_many((key,))

    def allocate_many(self, keys: Sequence[Hashable], origin: str) -> list[int]:
        """Give each key a free slot in state WRITING, in order; returns the
        slots. Caller checked room for all. A key already resident raises
        ``KeyError`` (the keys before it stay allocated). O(len(keys))."""
        blocks, free = self._blocks, self._free
        slots: list[int] = []
        try:
            for key in keys:
                if key in blocks:
                    raise KeyError(f"{key!r} already resident in {self.medium} tier")
                if free:  # self._slots.take, inlined for its common case
                    block = free.pop()
                    block.state, block.pins, block.origin = _WRITING, 0, origin
                else:
                    block = self._slots.take(origin)
                blocks[key] = block
                slots.append(block.slot)
        finally:
            # The policy learns of the blocks allocated (all of them, or
            # those before a failure: one slot each), in order; WRITING:
            # never eligible, so only their positions are recorded.
            done = len(slots)
            self._place(keys if done == len(keys) else keys[:done])
        return slots

    def mark_ready_many(self, keys: Sequence[Hashable], accepted: bool = False) -> None:
        """The keys' blocks become READY, in order. ``accepted``: the
        caller vouches that the tier's filter accepts every key, so it is
        not asked (same result, one call less per key). O(len(keys) log n)."""
        blocks = self._blocks
        known = accepted or self.filter is None
        ready: list[Hashable] = []
        pinned: list[Hashable] = []
        for key in keys:
            block = blocks[key]
            block.state = _READY
            (pinned if known and block.pins else ready).append(key)
        self._settle(ready, pinned, known)

    def pin_many(self, keys: Sequence[Hashable]) -> list[int]:
        """Add a reader to each key's block (no longer a victim), in order;
        returns their slots. O(len(keys))."""
        blocks, pop = self._blocks, self.index.eligible.pop
        slots: list[int] = []
        for key in keys:
            block = blocks[key]
            block.pins += 1
            held = pop(key, None)  # index.drop_many, inlined
            if held is not None:
                del held[key]
            slots.append(block.slot)
        return slots

    def unpin_many(self, keys: Sequence[Hashable], accepted: bool = False) -> None:
        """Take a reader off each key's block, in order (one left without
        readers may be a victim again); a block without readers raises
        ``RuntimeError``. ``accepted``: as for :meth:`mark_ready_many`.
        O(len(keys) log n)."""
        blocks = self._blocks
        known = accepted or self.filter is None
        idle: list[Hashable] = []
        writing: list[Hashable] = []
        for key in keys:
            block = blocks[key]
            pins = block.pins
            if pins <= 0:
                raise RuntimeError(f"unpin of unpinned {key!r} in {self.medium} tier")
            block.pins = pins - 1
            if pins == 1:
                (writing if known and block.state is not _READY else idle).append(key)
        self._settle(idle, writing, known)

    def _settle(
        self, ready: list[Hashable], other: list[Hashable], known: bool
    ) -> None:
        """``known`` (the filter accepts every key): admit ``ready`` (READY,
        idle), drop ``other``; refresh_many's verdict, without its pass.
        Else ``ready`` holds every key changed: refresh them."""
        if not known:
            self.refresh_many(ready)
            return
        if other:
            self.index.drop_many(other)
        if ready:
            self.index.admit_many(ready)

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        """Mark the resident keys used, in order (the last ends up most
        recent); other keys are ignored. O(len(keys) log n)."""
        blocks, index, accept = self._blocks, self.index, self.filter
        eligible = index.eligible
        resident: list[Hashable] = []
        moved: list[Hashable] = []
        for key in keys:
            block = blocks.get(key)
            if block is None:
                continue
            resident.append(key)
            if key in eligible or (
                block.state is _READY
                and not block.pins
                and (accept is None or accept(key, block))
            ):
                # Eligible (already, or from now on: refresh(key),
                # inlined): placed below at its new position.
                moved.append(key)
        # A touch moves only the key touched, so the policy can take them
        # all first (the last touch of a key listed twice decides).
        placed = self.policy.touch_many(resident)
        if self._copy_positions:
            index.pos.update(zip(resident, placed))
        if moved:
            index.place_many(moved)

    def remove_many(self, keys: Sequence[Hashable], evicted: bool) -> None:
        """Drop the keys and free their slots, in order (``evicted``: the
        tier chose them as victims). O(len(keys))."""
        blocks, free = self._blocks, self._free
        done = 0
        try:
            for key in keys:
                free.append(blocks.pop(key))
                done += 1
        finally:
            removed = keys if done == len(keys) else keys[:done]
            self.policy.remove_many(removed, evicted)
            self.index.forget_many(removed)

    # --- victims ---

    def set_filter(self, accept: Callable[[Hashable, TierBlock], bool] | None) -> None:
        """Narrow victims to evictable blocks ``accept`` allows. The owner
        calls :meth:`refresh` whenever ``accept``'s answer for a resident
        key may have changed. O(blocks) once."""
        self.filter = accept
        for key in self._blocks:
            self.refresh(key)

    def refresh(self, key: Hashable) -> None:
        """Re-evaluate whether ``key`` may be a victim. O(log n)."""
        self.refresh_many((key,))

    def refresh_many(self, keys: Sequence[Hashable], accepted: bool = False) -> None:
        """``refresh(key)`` for each key in order. ``accepted``: as for
        :meth:`mark_ready_many`. O(len(keys) log n)."""
        blocks = self._blocks
        accept = None if accepted else self.filter
        admitted: list[Hashable] = []
        dropped: list[Hashable] = []
        for key in keys:
            block = blocks.get(key)
            if block is None:
                continue
            if (
                block.state is _READY
                and not block.pins
                and (accept is None or accept(key, block))
            ):
                admitted.append(key)
            else:
                dropped.append(key)
        self._settle(admitted, dropped, True)

    def victims(
        self,
        n: int,
        exclude: set[Hashable] | frozenset[Hashable] = frozenset(),
        limit: int | None = None,
    ) -> list[Hashable]:
        """Up to ``n`` eligible keys in policy order (nothing is removed).

        Eligible: READY, unpinned and allowed by the tier's ``filter``. Cost
        is proportional to the eligible candidates inspected (the chosen and
        the excluded), plus stale index entries, each dropped once: never to
        the blocks that may not be victims. With ``limit``, only the first
        ``limit`` keys of the policy's order (eligible or not) are
        considered, as a bounded scan."""
        if n <= 0 or not self.index.eligible:
            return []
        if limit is not None:
            candidates = itertools.islice(self.policy.candidates(), limit)
            return self.index.scan(n, candidates, exclude)
        return self.index.victims(n, self.policy.victim_order(), exclude, take=False)

    def evict(
        self, n: int, exclude: set[Hashable] | frozenset[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Remove up to ``n`` victims (``victims(n, exclude=exclude)``, the
        same keys in the same order) as evicted; returns them. The chosen
        entries are taken out of the index as they are chosen, not put
        back. O(victims log n) plus stale entries dropped."""
        if n <= 0 or not self.index.eligible:
            return []
        index = self.index
        chosen = index.victims(n, self.policy.victim_order(), exclude, take=True)
        if chosen:
            # remove_many(chosen, True), minus the index's eligibility
            # (the victims were taken out of it as they were chosen).
            pop, free = self._blocks.pop, self._free
            for key in chosen:
                free.append(pop(key))
            if self._copy_positions:
                pos_pop = index.pos.pop
                for key in chosen:
                    pos_pop(key)
            self.policy.remove_many(chosen, True)
        return chosen

    def take_victims(
        self, n: int, exclude: set[Hashable] | frozenset[Hashable] = frozenset()
    ) -> list[Hashable]:
        """``victims(n, exclude=exclude)``, taken out of the index (no
        longer eligible, no entry): the caller removes them
        (``remove_many``) or gives them back with ``refresh_many``. For a
        removal that must wait for other work (and its events) first; a
        ``refresh`` in between re-admits the key, whose removal then leaves
        one stale entry, dropped when popped."""
        if n <= 0 or not self.index.eligible:
            return []
        return self.index.victims(n, self.policy.victim_order(), exclude, take=True)

    def clear(self) -> list[Hashable]:
        """Forget every block; returns the keys that were READY."""
        blocks = self._blocks
        # The READY keys, in C: a reset of a large tier names every block.
        states = map(_state_of, blocks.values())
        ready = list(
            itertools.compress(blocks, map(is_, states, itertools.repeat(_READY)))
        )
        self.policy.clear(list(blocks))
        self._blocks.clear()
        self._slots.clear()
        self.index.clear()
        return ready
