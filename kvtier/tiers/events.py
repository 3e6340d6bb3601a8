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
from collections.abc import Hashable, Sequence
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

# Keys left pending by earlier drains that one engine step's drain takes
# (``EventLog.take(backlog=...)``), beyond every key recorded since the last
# one. vLLM builds and publishes one KV event per key within the step (about
# 5 us each on a 2-core VM), so a warm restart's event naming a million
# adopted blocks would otherwise cost the first step seconds; at this rate
# it goes out over its first steps, about 20 ms of each.
EVENT_BACKLOG_PER_STEP = 4096

# Reasons of the events that name a whole tier at once (warm restart,
# reset): backlog from the start (see ``EventLog``).
BULK_REASONS = frozenset({"restore", "reset"})


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

    ``take(backlog=k)`` bounds what one drain costs. The events of a whole
    tier at once (``BULK_REASONS``: a warm restart's one event naming every
    block adopted, a million on a large disk tier; a reset's removals) are
    *backlog* from the start, and so are the keys a drain leaves pending. A
    drain returns the oldest pending keys, in order: as many as the other
    keys recorded since the previous drain, plus at most ``k``. So a
    consumer that drains once per engine step pays for what the step did
    plus ``k``, and the backlog shrinks by ``k`` a step (events recorded
    behind it wait for it: order is kept)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: deque[tuple[str, bool, str, list[Hashable]]] = deque()
        # The kind (medium, removed, reason) and keys of the last pending
        # event, so coalescing compares one tuple and extends one list.
        self._last_kind: tuple[str, bool, str] | None = None
        self._last_keys: list[Hashable] = []
        # Keys of the first pending event already taken (a partial take).
        self._head = 0
        # Keys pending in all, and those of them that are backlog (pending
        # when the last ``take`` returned, or of a bulk event).
        self._count = 0
        self._backlog = 0

    def __len__(self) -> int:
        """Keys pending (recorded and not taken yet)."""
        return self._count

    def record(
        self, keys: Sequence[Hashable], medium: str, removed: bool, reason: str
    ) -> None:
        if not self.enabled or not keys:
            return
        kind = (medium, removed, reason)
        if kind == self._last_kind:
            self._last_keys.extend(keys)
        else:
            self._last_kind, self._last_keys = kind, list(keys)
            self._pending.append((medium, removed, reason, self._last_keys))
        self._count += len(keys)
        if reason in BULK_REASONS:
            self._backlog += len(keys)

    def take(self, backlog: int | None = None) -> list[TierEvent]:
        """Drain the events since the last call, in order. ``backlog``: take
        at most this many keys more than were recorded since the last call,
        bulk events aside (see the class doc), leaving the newest pending
        keys for later calls; None: all. O(keys returned)."""
        pending = self._pending
        if not pending:
            return []
        limit = self._count
        if backlog is not None:
            limit = min(limit, self._count - self._backlog + backlog)
        out: list[tuple[tuple[Hashable, ...], str, bool, str]] = []
        left, head = limit, self._head
        while left > 0 and pending:
            medium, removed, why, keys = pending[0]
            end = head + left
            if end < len(keys):
                out.append((tuple(keys[head:end]), medium, removed, why))
                head = end
                break
            out.append((tuple(keys[head:] if head else keys), medium, removed, why))
            left -= len(keys) - head
            head = 0
            pending.popleft()
        if not pending:
            self._last_kind = None  # nothing left to coalesce into
        self._head = head
        self._count -= limit
        self._backlog = self._count
        # tuple.__new__ builds the NamedTuples in C.
        return list(map(tuple.__new__, repeat(TierEvent), out))
