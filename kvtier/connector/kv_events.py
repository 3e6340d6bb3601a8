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
    blocks, announced on STORAGE at start. A lookup that hits such a block
    records its payload, and vLLM's tracker then named the block's removal
    by every hash of its chunk: hashes no store named, which took a
    reference-counting subscriber (vLLM's events module asks consumers to
    count repeated announcements) below zero, and told a set-based one of
    hashes it never held (only with more than one GPU block a chunk: with
    one, the two name the same hash).

    Where a medium's events expect removals (``removal_expected``: kvtier's
    disk tiers, the full spec's and ``KvtierDiskTier``), vLLM records the
    residency (medium, ownership) in the payload at each store it
    describes. A removal whose payload lacks that residency therefore
    removes a block whose store was a placeholder: it is translated without
    the payload (a placeholder too), which stays for the block's other
    residencies. CPU events expect none (vLLM records a CPU residency at the
    lookup or store that makes the payload, and kvtier's CPU copies are
    stored from a request or a load, after both), so they are vLLM's.

    Takes vLLM's tracker's place in the connector scheduler
    (:meth:`taking_over`); its methods are vLLM's but :meth:`take_events`.
    Not thread-safe, as vLLM's: the scheduler's thread calls it."""

    @classmethod
    def taking_over(cls, tracker: OffloadingEventsTracker) -> KvtierEventsTracker:
        """One in place of ``tracker``, which vLLM's connector scheduler
        builds itself: its config, group specs (0.33) and payloads."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(tracker))
        return new

    @override
    def take_events(self, events: Iterable[OffloadingEvent]) -> Iterable[KVCacheEvent]:
        return super().take_events(self._as_stored(events))

    def _as_stored(
        self, events: Iterable[OffloadingEvent]
    ) -> Iterator[OffloadingEvent]:
        """``events``, each removal's placeholder-stored keys' payloads
        hidden while vLLM's tracker translates it. The tracker takes the
        next event once it yielded the last one's KV events, so they are
        back before it reads another (and before its end-of-call cleanup of
        payloads without residencies)."""
        for event in events:
            hidden: dict[OffloadKey, Any] = {}
            payloads = self._pending_event_metadata
            if (
                event.removed
                and event.removal_expected
                and not getattr(event, "metadata_only", False)  # 0.33
            ):
                residency = (event.medium, event.ownership)
                for key in event.keys:
                    meta = payloads.get(key)
                    if meta is not None and residency not in meta.active_residencies:
                        hidden[key] = payloads.pop(key)
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
