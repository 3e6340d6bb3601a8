"""Residency events: one per change of which medium holds a ready block.

Every time a block becomes readable on a medium (``stored``) or stops being
readable there (``removed``), the hierarchy appends one :class:`TierEvent`.
Replaying the stream from an empty state reproduces exactly which keys are
ready on which medium (``tests/tiers/test_hierarchy_stateful.py`` checks it);
the vLLM adapter maps these events 1:1 onto vLLM's ``OffloadingEvent``
(medium CPU / STORAGE).
"""

from __future__ import annotations

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
    consumer, e.g. KV events off) it records nothing, so nothing grows."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: list[tuple[str, bool, str, list[Hashable]]] = []
        # The kind (medium, removed, reason) and keys of the last pending
        # event, so coalescing compares one tuple and extends one list.
        self._last_kind: tuple[str, bool, str] | None = None
        self._last_keys: list[Hashable] = []

    def record(
        self, keys: Sequence[Hashable], medium: str, removed: bool, reason: str
    ) -> None:
        if not self.enabled:
            return
        kind = (medium, removed, reason)
        if kind == self._last_kind:
            self._last_keys.extend(keys)
        else:
            self._last_kind, self._last_keys = kind, list(keys)
            self._pending.append((medium, removed, reason, self._last_keys))

    def take(self) -> list[TierEvent]:
        """Drain the events since the last call, in order."""
        pending = self._pending
        if not pending:
            return []
        self._pending, self._last_kind = [], None
        return list(
            map(
                tuple.__new__,
                repeat(TierEvent),
                [(tuple(k), m, r, why) for m, r, why, k in pending],
            )
        )
