"""vLLM KV events of kvtier's tiers: what vLLM's event tracker names them by.

kvtier's managers announce their blocks as vLLM's ``OffloadingEvent``s
(keys, medium); vLLM's ``OffloadingEventsTracker`` turns them into KV events,
with ``self_describing_kv_events`` by the payload (every block hash and
token of a chunk) it recorded while a request described the block. Here:

- :func:`translate_after_reset`, one step's events after a connector reset,
  those owed from before it by the payloads vLLM's tracker held then;
- :func:`keep_secondary_payloads`, what a tiering-mode reset keeps of those.

The connector (``kvtier.connector.connector``) decides when each runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

from kvtier.connector.manager import BulkEvent


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
