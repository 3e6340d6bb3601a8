"""The residency that kvtier's own events (:class:`TierEvent`) imply, and a
hierarchy's: a faithful event log replays to what the hierarchy holds."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK, TierEvent
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.slots import BlockState
from kvtier.tiers.tier import Tier


def replay(events: Iterable[TierEvent]) -> dict[str, set[Hashable]]:
    """Residency per medium implied by an event stream that starts empty.

    Raises ``ValueError`` on an event that contradicts the state so far (a
    store of a key already there, a removal of a key that is not): the
    stream is then not a faithful log.
    """
    state: dict[str, set[Hashable]] = {MEDIUM_CPU: set(), MEDIUM_DISK: set()}
    for ev in events:
        held = state[ev.medium]
        for key in ev.keys:
            if ev.removed:
                if key not in held:
                    raise ValueError(f"removed {key!r} from {ev.medium} twice")
                held.discard(key)
            else:
                if key in held:
                    raise ValueError(f"stored {key!r} on {ev.medium} twice")
                held.add(key)
    return state


def residency(h: TierHierarchy) -> dict[str, set[Hashable]]:
    """The keys READY per medium of ``h`` (O(n)): what :func:`replay` of all
    its events must give."""

    def ready(tier: Tier | None) -> set[Hashable]:
        items = tier.items() if tier is not None else ()
        return {k for k, b in items if b.state is BlockState.READY}

    return {MEDIUM_CPU: ready(h.cpu), MEDIUM_DISK: ready(h.disk)}
