"""The blocks of a tier and the free slots they are made on.

A block is what a tier holds for one resident key: its slot (an integer in
``[0, capacity)`` that the worker side maps onto a CPU buffer row or a disk
slab slot), its state and its readers. :class:`SlotPool` hands out WRITING
blocks on free slots and takes back those of keys that left.

A block object belongs to its tier and is valid while its key is resident:
once the key leaves, the pool reuses the same object, slot and all, for the
next key allocated (setting its state, pins and origin), which spares one
object per allocation. Callers read a block's fields within the call that
got it and keep none across calls.

Not thread-safe: the tier's owner serializes calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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


_WRITING = BlockState.WRITING


class SlotPool:
    """The free slots of one tier of ``capacity`` slots.

    Free slots are taken in this order: the blocks of keys that left
    (``free``, last in first out; the tier appends a block there when its
    key leaves, its slot then being free), the slots a warm restart left
    unused, then the slots never handed out, implicit (a counter), so a
    tier of millions of slots costs nothing to build. ``len`` is the number
    of free slots. O(1) per call but ``restore``."""

    def __init__(self, medium: str, capacity: int) -> None:
        self.medium = medium
        self.capacity = capacity
        self.free: list[TierBlock] = []
        self._unused: list[int] = []
        self._next_fresh = 0

    def __len__(self) -> int:
        return len(self.free) + len(self._unused) + self.capacity - self._next_fresh

    @property
    def pristine(self) -> bool:
        """No slot was ever handed out (since the last ``clear``)."""
        return not self._next_fresh

    def take(self, origin: str) -> TierBlock:
        """A WRITING block, with no readers, on a free slot. Raises
        ``RuntimeError`` if there is none."""
        if self.free:
            block = self.free.pop()
            block.state, block.pins, block.origin = _WRITING, 0, origin
            return block
        if self._unused:
            slot = self._unused.pop()
        elif self._next_fresh < self.capacity:
            slot = self._next_fresh
            self._next_fresh += 1
        else:
            raise RuntimeError(f"{self.medium} tier is full")
        return TierBlock(slot, _WRITING, 0, origin)

    def restore(self, used: set[int]) -> None:
        """Only the slots not in ``used`` are free (warm restart of a
        pristine pool). O(capacity)."""
        # A stack popped from the end: low slots last, so allocations fill
        # the slab front to back.
        self._unused = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        self._next_fresh = self.capacity

    def clear(self) -> None:
        """Every slot free and never handed out."""
        self.free.clear()
        self._unused.clear()
        self._next_fresh = 0
