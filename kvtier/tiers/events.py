"""Residency events: one per change of which medium holds a ready block.

Every time a block becomes readable on a medium (``stored``) or stops being
readable there (``removed``), the hierarchy appends one :class:`TierEvent`.
Replaying the stream from an empty state reproduces exactly which keys are
ready on which medium (``tests/tiers/test_hierarchy_stateful.py`` checks it);
the vLLM adapter maps these events 1:1 onto vLLM's ``OffloadingEvent``
(medium CPU / STORAGE).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from itertools import repeat
from typing import NamedTuple

# Media: where a block lives, in vLLM's word. These are kvtier's names for
# them everywhere (events, metrics' ``tier`` label, load plans, the CLI);
# vLLM's own names (``OffloadingEvent.medium``) map onto them via VLLM_MEDIA.
MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"
MEDIUM_DISK = "disk"
ALL_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)
VLLM_MEDIA = {"GPU": MEDIUM_GPU, "CPU": MEDIUM_CPU, "STORAGE": MEDIUM_DISK}

# Keys of bulk events (``BULK_REASONS``) one engine step's drain hands out
# (``EventLog.take(backlog=...)``), beyond every other event recorded since
# the last one. vLLM builds and publishes one KV event per key within the
# step, so a warm restart's event naming a million adopted blocks would
# otherwise cost the first step seconds. At this rate it goes out over its
# first ~1,000 steps, a few milliseconds of each; four times as many a step
# took a third of an 8B model's decode step (docs/benchmarks.md, "Start,
# reset, shutdown and event backlogs at scale").
EVENT_BACKLOG_PER_STEP = 1024

# Reasons of the events that name a whole tier at once (warm restart,
# reset): handed out as a bounded backlog (see ``EventLog``).
BULK_REASONS = frozenset({"restore", "reset"})

# Bulk events of one key come in this order (medium, removed, reason): a
# restore at start, before any reset; a reset removes a block from the CPU
# tier, then from the disk tier (``TierHierarchy.reset``).
BULK_KINDS = (
    (MEDIUM_DISK, False, "restore"),
    (MEDIUM_CPU, True, "reset"),
    (MEDIUM_DISK, True, "reset"),
)

# ``EventLog._owed``: the low bits name bulk kinds (at most this many).
_KIND_BITS = 8
_KIND_MASK = (1 << _KIND_BITS) - 1


class TierEvent(NamedTuple):
    """``keys`` became ready on (``removed=False``) or left (``removed=True``)
    ``medium``. ``reason`` says why, for logs and metrics: ``store``,
    ``spill``, ``promote``, ``restore``, ``evict``, ``corrupt``,
    ``unreadable`` (reads failed with I/O errors too often in a row),
    ``reset``.

    An immutable tuple rather than a frozen dataclass: every request drains
    a few of them on the engine step, and a frozen dataclass costs several
    times more to build (:meth:`EventLog.take` builds them in C)."""

    keys: tuple[Hashable, ...]
    medium: str
    removed: bool
    reason: str = ""


class EventLog:
    """The pending residency events of one hierarchy, drained by ``take``.

    Consecutive events of the same kind coalesce into one (amortized O(1)
    per key), which keeps streams short for batch evictions. Disabled (no
    consumer, e.g. KV events off) it records nothing, so nothing grows.

    ``take(backlog=k)`` bounds what one drain costs without delaying any
    event a step caused. The events naming a whole tier at once
    (``BULK_REASONS``: a warm restart's one event naming every block
    adopted, a million on a large disk tier; a reset's removals) are a
    *backlog*, handed out at most ``k`` keys a drain, oldest first; every
    other event goes out in the first drain after it. Order is kept per
    key, which is what a consumer rebuilding each tier's contents needs
    (vLLM's event tracker keeps a block's payload per key too): a drain
    hands out the other events before the backlog's keys, and an event
    naming a key the backlog still owes an event for is preceded by that
    one (it leaves the backlog). So the stream still replays to the tiers'
    contents after every drain."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: list[tuple[str, bool, str, list[Hashable]]] = []
        # The kind (medium, removed, reason) and keys of the last pending
        # event, so coalescing compares one tuple and extends one list.
        self._last_kind: tuple[str, bool, str] | None = None
        self._last_keys: list[Hashable] = []
        # The backlog: bulk events oldest first, as (number, kind bit,
        # keys), and how many keys of the first were handed out already.
        self._bulk: deque[tuple[int, int, list[Hashable]]] = deque()
        self._bulk_head = 0
        self._bulk_number = 0
        # The bulk kinds, bit i naming _bulk_kinds[i], in each key's order
        # of them (BULK_KINDS; any other after them, as first recorded).
        # The order of first recording is not it: a warm restart's blocks
        # all on disk, the first reset records no CPU removal.
        self._bulk_kinds: list[tuple[str, bool, str]] = list(BULK_KINDS)
        # Per key, the bulk events it is still owed: kind bits, and above
        # _KIND_BITS the number of the first backlog event it owes one of.
        # An older backlog event naming the key went out ahead of an event
        # of the key already (``_settle``), so it hands out nothing for it.
        self._owed: dict[Hashable, int] = {}

    def record(
        self, keys: Sequence[Hashable], medium: str, removed: bool, reason: str
    ) -> None:
        if not self.enabled or not keys:
            return
        kind = (medium, removed, reason)
        if reason in BULK_REASONS:
            self._record_bulk(keys, kind)
            return
        if self._owed:
            self._settle(keys)
        self._append(keys, kind)

    def _append(self, keys: Sequence[Hashable], kind: tuple[str, bool, str]) -> None:
        if kind == self._last_kind:
            self._last_keys.extend(keys)
        else:
            self._last_kind, self._last_keys = kind, list(keys)
            self._pending.append((*kind, self._last_keys))

    def _record_bulk(self, keys: Sequence[Hashable], kind: tuple[str, bool, str]) -> None:
        if kind in self._bulk_kinds:
            bit = 1 << self._bulk_kinds.index(kind)
        else:
            assert len(self._bulk_kinds) < _KIND_BITS, self._bulk_kinds
            bit = 1 << len(self._bulk_kinds)
            self._bulk_kinds.append(kind)
        bulk = self._bulk
        if bulk and bulk[-1][1] == bit:
            number = bulk[-1][0]
            bulk[-1][2].extend(keys)
        else:
            self._bulk_number += 1
            number = self._bulk_number
            bulk.append((number, bit, list(keys)))
        owed, first = self._owed, number << _KIND_BITS
        if len(owed) >= len(keys):
            for key in keys:
                owed[key] = (owed.get(key) or first) | bit
            return
        # A whole tier's keys (a reset's, a restore's) against fewer owed:
        # the map built in C, Python only for the keys owed before, where a
        # loop of two dict operations per key is much of a large reset. The
        # same map: (owed.get(key) or first) | bit per key.
        fresh = dict.fromkeys(keys, first | bit)
        for key, value in owed.items():
            fresh[key] = value | bit if key in fresh else value
        self._owed = fresh

    def _settle(self, keys: Sequence[Hashable]) -> None:
        """Move out of the backlog, ahead of an event naming ``keys``, the
        bulk events those keys are still owed."""
        owed, kinds = self._owed, self._bulk_kinds
        for key in keys:
            bits = owed.pop(key, 0) & _KIND_MASK
            while bits:
                low = bits & -bits
                self._append((key,), kinds[low.bit_length() - 1])
                bits ^= low

    @property
    def has_backlog(self) -> bool:
        """Whether bulk events still owe keys to later drains. O(1)."""
        return bool(self._bulk)

    def owes_reason(self, reason: str) -> bool:
        """Whether a bulk event of ``reason`` still owes keys to later
        drains. O(bulk events pending)."""
        kinds = self._bulk_kinds
        return any(kinds[bit.bit_length() - 1][2] == reason for _, bit, _ in self._bulk)

    def owes(self, key: Hashable) -> bool:
        """Whether a bulk event still owes ``key`` an event. O(1)."""
        return key in self._owed

    def take(
        self, backlog: int | None = None, weights: Mapping[str, int] | None = None
    ) -> list[TierEvent]:
        """Drain the events since the last call: every event but the
        backlog's, in order, then at most ``backlog`` keys of the backlog
        (None: all of it), oldest first. O(keys returned + ``backlog``).

        ``weights``: per reason, what one key of a bulk event of that reason
        counts against ``backlog`` (1 if not named), for a consumer whose
        cost per key differs by reason. A drain hands out at least one key
        of the backlog."""
        out = [(tuple(keys), m, r, why) for m, r, why, keys in self._pending]
        self._pending, self._last_kind = [], None
        if self._bulk:
            self._take_bulk(out, backlog, weights or {})
        # tuple.__new__ builds the NamedTuples in C.
        return list(map(tuple.__new__, repeat(TierEvent), out))

    def _take_bulk(
        self,
        out: list[tuple[tuple[Hashable, ...], str, bool, str]],
        backlog: int | None,
        weights: Mapping[str, int],
    ) -> None:
        owed, bulk = self._owed, self._bulk
        left = backlog
        while bulk and (left is None or left > 0):
            number, bit, keys = bulk[0]
            kind = self._bulk_kinds[bit.bit_length() - 1]
            weight = weights.get(kind[2], 1)
            head = self._bulk_head
            # head + ceil(left / weight): at least one key while left > 0.
            end = (
                len(keys) if left is None else min(len(keys), head - (-left // weight))
            )
            due = []
            for key in keys[head:end]:
                v = owed.get(key, 0)
                # Else it went out ahead of a later event of its key.
                if v & bit and v >> _KIND_BITS <= number:
                    if v & _KIND_MASK == bit:
                        del owed[key]
                    else:
                        owed[key] = v ^ bit
                    due.append(key)
            if due:
                out.append((tuple(due), *kind))
            if left is not None:
                left -= (end - head) * weight
            if end == len(keys):
                bulk.popleft()
                self._bulk_head = 0
            else:
                self._bulk_head = end
