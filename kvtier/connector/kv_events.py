"""vLLM KV events of kvtier's tiers: what vLLM's event tracker names them by.

kvtier's managers announce their blocks as vLLM's ``OffloadingEvent``s
(keys, medium); vLLM's ``OffloadingEventsTracker`` turns them into KV events,
with ``self_describing_kv_events`` by the payload (every block hash and
token of a chunk) it recorded while a request described the block. Here:

- :class:`KvtierEventsTracker`, vLLM's tracker with a removal named by what
  its store named, where the store went out before any payload existed (a
  warm restart's adopted blocks);
- :func:`translate_after_reset`, one step's events after a connector reset,
  those owed from before it by the payloads vLLM's tracker held then;
- :func:`keep_secondary_payloads`, what a tiering-mode reset keeps of those.

The connector (``kvtier.connector.connector``) decides when each runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from typing_extensions import override
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

from kvtier.connector.manager import BulkEvent


class KvtierEventsTracker(OffloadingEventsTracker):
    """vLLM's tracker, but a removal names the block hashes its store named.

    vLLM's tracker names a store by the payload it holds for the key then,
    or, with none, by a placeholder: the chunk's last block hash. It has
    none for a block no request described yet, as a warm restart's adopted
    blocks, announced on STORAGE at start, or a store completed after
    vLLM dropped the payload it recorded for it (the key's older copy left
    in the same step). A lookup that hits such a block records its payload,
    and vLLM's tracker then named the block's removal by every hash of its
    chunk: hashes no store named, which took a reference-counting
    subscriber (vLLM's events module asks consumers to count repeated
    announcements) below zero, and told a set-based one of hashes it never
    held (only with more than one GPU block a chunk: with one, the two name
    the same hash).

    So this tracker remembers, of each medium (and ownership) whose events
    expect removals (``removal_expected``: every tier of kvtier's announces
    each block's removal, a reset's included), the keys whose copy there
    went out by a placeholder, and translates such a copy's removal without
    the payload: by the placeholder too. A key's hashes follow from the key
    (the chunk's last hash, of a chained hash), so a copy described by a
    payload is removed by any payload of its key. Those sets hold the
    placeholder copies still held: a warm restart's adopted blocks until
    they leave (about 32 MB a million; a set emptied is let go, as a set
    never shrinks its table).

    With ``removal_expected``, vLLM also records a residency at each store
    it describes, so a payload outlives a removal of the key that comes
    with a new store of it in the same step (a set of residencies, not a
    count: the removal empties it, and the payload was dropped at the end
    of the call while the new copy was held).

    Takes vLLM's tracker's place in the connector scheduler
    (:meth:`taking_over`); its methods are vLLM's but :meth:`take_events`.
    Not thread-safe, as vLLM's: the scheduler's thread calls it."""

    # (medium, ownership) -> the keys whose copy there a placeholder named.
    _placeholders: dict[tuple[Medium, str | None], set[OffloadKey]]

    @classmethod
    def taking_over(cls, tracker: OffloadingEventsTracker) -> KvtierEventsTracker:
        """One in place of ``tracker``, which vLLM's connector scheduler
        builds itself: its config, group specs (0.33) and payloads."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(tracker))
        new._placeholders = {}
        return new

    @override
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placeholders = {}

    @override
    def take_events(self, events: Iterable[OffloadingEvent]) -> Iterable[KVCacheEvent]:
        if not self.self_describing_enabled:  # every event is a placeholder
            return super().take_events(events)
        return super().take_events(self._as_announced(events))

    def _as_announced(
        self, events: Iterable[OffloadingEvent]
    ) -> Iterator[OffloadingEvent]:
        """``events``, each noted as vLLM's tracker is about to name it; a
        removal of a copy a placeholder named has its key's payload hidden
        while the tracker translates it. The tracker takes the next event
        once it yielded the last one's KV events, so a hidden payload is
        back before it reads another (and before its end-of-call cleanup of
        payloads without residencies). O(keys of the events)."""
        for event in events:
            hidden: dict[OffloadKey, Any] = {}
            payloads = self._pending_event_metadata
            if event.removal_expected and not getattr(event, "metadata_only", False):
                # (0.33's metadata-only removal: a store never announced.)
                where = (event.medium, event.ownership)
                placeholders = self._placeholders.setdefault(where, set())
                if event.removed:
                    for key in event.keys:
                        if key in placeholders:
                            placeholders.remove(key)
                            if (meta := payloads.pop(key, None)) is not None:
                                hidden[key] = meta
                else:
                    for key in event.keys:
                        if key in payloads:
                            placeholders.discard(key)
                        else:
                            placeholders.add(key)
                if not placeholders:
                    del self._placeholders[where]
            try:
                yield event
            finally:
                payloads.update(hidden)


def translate_after_reset(
    events: Iterable[OffloadingEvent],
    tracker: OffloadingEventsTracker,
    reset_tracker: OffloadingEventsTracker,
    owed: Callable[[OffloadKey], bool],
) -> Iterable[KVCacheEvent]:
    """One step's ``events`` as KV events, in order: those owed from before
    a reset (:class:`BulkEvent`) by ``reset_tracker``, which holds the
    payloads from before it; the others by ``tracker`` in one call, as
    vLLM calls it: it keeps a removed key's payload until the call's last
    event, in case a later one of the batch stores it again.
    ``reset_tracker`` then forgets the keys of those events that are
    ``owed`` no other event.

    ``tracker`` reads the events one at a time, as it translates them; the
    events met before its next one are translated then, and go out before
    that event's KV events."""
    ahead: list[KVCacheEvent] = []
    done: list[OffloadKey] = []

    def its_events() -> Iterable[OffloadingEvent]:
        for event in events:
            if isinstance(event, BulkEvent):
                ahead.extend(reset_tracker.take_events((event,)))
                done.extend(event.keys)
            else:
                yield event

    for kv_event in tracker.take_events(its_events()):
        if ahead:
            yield from ahead
            ahead.clear()
        yield kv_event
    yield from ahead
    payloads = reset_tracker._pending_event_metadata
    for key in done:
        if not owed(key):
            payloads.pop(key, None)


def keep_secondary_payloads(payloads: dict[OffloadKey, Any]) -> None:
    """Keep, of the payloads vLLM's tracker held at a reset in tiering mode,
    those of the blocks a secondary tier still holds, less their primary
    residency. vLLM resets only the primary tier (its secondary tiers keep
    their blocks) but drops every payload, so the later removal of a block
    from a secondary tier (kvtier's disk tier evicting it) named its chunk's
    last block hash only: a subscriber kept the chunk's other hashes on
    STORAGE for ever. O(payloads), as vLLM's own reset of them."""
    primary = (Medium.CPU, None)  # the tracker's residency of the primary tier
    for key in [
        key for key, meta in payloads.items() if not meta.active_residencies - {primary}
    ]:
        del payloads[key]
    for meta in payloads.values():
        meta.active_residencies.discard(primary)
