"""The eviction-policy contract, the registry that names policies, and LRU.

The scan-resistant policies (ARC, 2Q, ARC with a doorkeeper) are in
:mod:`kvtier.tiers.scan_resistant`; the package imports it, so the registry
holds every built-in policy whenever ``kvtier.tiers`` is importable.

A policy only ranks keys; it knows nothing of slots, pins or I/O. The tier
asks it for candidates in eviction order and skips those it may not evict
(pinned, being written), so a policy never has to be told about pins.

Every policy describes its order in a form a tier can index incrementally
(see :class:`EvictionPolicy`: ``segments``, ``position`` and
``victim_order``), so choosing victims costs O(blocks touched) whatever the
policy. :func:`register_policy` refuses a class that does not, and
:data:`POLICY_REGISTRY` is the one list of policies: ``make_policy``, the
configuration keys, the CLI and the docs all read it.

Not thread-safe: a policy belongs to one tier, whose caller serializes calls.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

# A key's position is one int, ``segment << SEGMENT_SHIFT | stamp``, so that
# ordering positions orders keys by (segment, stamp). An int, not a tuple: a
# dict of ints is never tracked by the garbage collector, while a dict of a
# tier's (segment, stamp) tuples was untracked by each full collection and
# tracked again, in the youngest generation, by the next block stored, whose
# next collection then walked it whole (0.28 s at a million blocks); and
# the tuples were 56 bytes a block more.
SEGMENT_SHIFT = 56
STAMP_MASK = (1 << SEGMENT_SHIFT) - 1

# One run of a victim order: (segment, stop). The run yields the keys of
# ``segment`` not yet yielded whose position is below ``stop`` (a position
# in that segment; all of them when ``stop`` is None), oldest first.
Run = tuple[int, int | None]


class EvictionPolicy(ABC):
    """Ranks the keys resident in one tier.

    Contract: every resident key was ``insert``-ed exactly once and is
    ``remove``-d exactly once when it leaves; ``candidates`` yields each
    resident key exactly once, most evictable first, lazily (callers stop
    early, so the cost is proportional to what they consume).

    Victim order, what lets a tier keep an O(blocks touched) index of its
    evictable keys: the resident keys are split into ``segments`` ordered
    lists (LRU: one; ARC: T1 and T2). ``position(key)`` is a resident key's
    position, ``segment << SEGMENT_SHIFT | stamp`` (segment 0: the stamp),
    and

    - a key's position changes only when that key is ``insert``-ed or
      ``touch``-ed (never as a side effect of another key's call), and each
      such change gives it a stamp larger than every stamp given before;
    - ``victim_order()`` is a sequence of runs ``(segment, stop)`` such that
      ``candidates()`` equals: for each run in turn, the keys of ``segment``
      not yet yielded with position < ``stop`` (every one when ``stop`` is
      None), by increasing position. Every segment has a run with ``stop``
      None. It may depend on the policy's state (ARC's target ``p``).

    Both are O(1). ``name`` is what configurations and :func:`make_policy`
    accept, ``summary`` one sentence for the docs; subclasses register with
    :func:`register_policy`.

    ``positions``: a policy that keeps every resident key's position in a
    dict (key -> position, current after each call) may expose it
    there; a tier then reads it instead of keeping a copy of its own (one
    table of the tier's keys less to update and to rebuild). It must be
    the same dict for the policy's life (a ``clear`` empties it, never
    replaces it): the tier holds it. None (what ``EvictionPolicy.__init__``
    sets): the tier keeps the positions ``insert_many``/``touch_many``
    return.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    segments: ClassVar[int] = 1

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._clock = itertools.count()  # stamps, shared by all segments
        self.positions: dict[Hashable, int] | None = None

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """A key became resident (its store started)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """A resident key was used (hit, load, or re-offered for store); a
        key that is not resident is ignored."""

    @abstractmethod
    def remove(self, key: Hashable, evicted: bool) -> None:
        """A resident key left; ``evicted`` when the policy chose it."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Resident keys, most evictable first (a walk: O(keys consumed))."""

    # Batches: the per-key calls, in order; insert_many and touch_many
    # return each key's ``position`` right after its call (touch_many's keys
    # are all resident). A subclass may override them for speed, with
    # exactly that result (see _BULK_PATHS for what such an override may
    # assume).
    def insert_many(self, keys: Iterable[Hashable]) -> list[int]:
        return [self._position_after(self.insert, key) for key in keys]

    def touch_many(self, keys: Iterable[Hashable]) -> list[int]:
        return [self._position_after(self.touch, key) for key in keys]

    def remove_many(self, keys: Iterable[Hashable], evicted: bool) -> None:
        for key in keys:
            self.remove(key, evicted)

    # A subclass whose state can be dropped at once defines
    # ``_forget_all(self) -> None``: every resident key leaves, none
    # evicted, exactly as ``remove(key, False)`` for each would leave it.
    _forget_all: Callable[[EvictionPolicy], None] | None = None

    def clear(self, keys: Iterable[Hashable]) -> None:
        """Every resident key (``keys``, all of them) leaves, none evicted:
        a reset. ``_forget_all`` when the class has one (a reset of a
        million-block tier made a million calls), else the per-key
        removals."""
        if self._forget_all is not None:
            self._forget_all()
        else:
            self.remove_many(keys, evicted=False)

    # A fast bulk path inlines the per-key method its class defines beside
    # it (bulk name -> per-key name). A subclass that overrides the per-key
    # method and not the bulk one would see its override skipped; such a
    # class gets the per-key path back instead (EvictionPolicy's bulk
    # method, or no _forget_all), so an override always decides. Set per
    # class by __init_subclass__: the one place this rule lives.
    _BULK_PATHS: ClassVar[dict[str, str]] = {
        "insert_many": "insert",
        "touch_many": "touch",
        "remove_many": "remove",
        "_forget_all": "remove",
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for bulk, single in EvictionPolicy._BULK_PATHS.items():
            bulk_owner = _definer(cls, bulk)
            single_owner = _definer(cls, single)
            if (
                bulk_owner is not EvictionPolicy
                and single_owner is not bulk_owner
                and issubclass(single_owner, bulk_owner)
            ):
                setattr(cls, bulk, EvictionPolicy.__dict__[bulk])

    def _position_after(self, call: Any, key: Hashable) -> int:
        call(key)
        return self.position(key)

    @abstractmethod
    def position(self, key: Hashable) -> int:
        """The position of a resident key (``segment << SEGMENT_SHIFT |
        stamp``). O(1)."""

    @abstractmethod
    def victim_order(self) -> tuple[Run, ...]:
        """The current order of the segments, as runs. O(1)."""


def _definer(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own body defines ``name``."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


P = TypeVar("P", bound=type[EvictionPolicy])

# name -> policy class, in registration order (the built-ins first, lru the
# default). Read it through policy_names / make_policy; add with
# register_policy.
POLICY_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` selectable by ``cls.name``.

    Refuses (``TypeError``) a class without a name or summary, a name taken
    by another class, and a class that does not implement the victim order
    (``position``/``victim_order`` left abstract, or ``segments`` < 1): a
    tier could only scan such a policy, which breaks its O(blocks touched)
    promise."""
    label = f"eviction policy {cls.__qualname__}"
    if not cls.name or not cls.summary:
        raise TypeError(f"{label} needs a class attribute name and a summary")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(
            f"{label} ({cls.name!r}) cannot be registered: it does not "
            f"implement {', '.join(missing)}. A tier chooses victims from "
            "the policy's victim order (segments, position, victim_order; "
            "see EvictionPolicy) to stay O(blocks touched); it never scans."
        )
    if not isinstance(cls.segments, int) or cls.segments < 1:
        raise TypeError(f"{label} ({cls.name!r}): segments must be an int >= 1")
    other = POLICY_REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise TypeError(
            f"{label}: the name {cls.name!r} is taken by {other.__qualname__}"
        )
    POLICY_REGISTRY[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, in registration order."""
    return tuple(POLICY_REGISTRY)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a registered policy by name; unknown names raise ``ValueError``
    listing the accepted ones."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"unknown eviction policy {name!r}: accepted values are "
            f"{' | '.join(policy_names())}"
        )
    return cls(capacity)


# log2 of the stamps one bucket of a :class:`StampOrder` spans: its table
# rebuild walks at most this many keys. Read when a StampOrder is made
# (tests shrink it).
STAMP_BUCKET_BITS = 12


class StampOrder:
    """Keys in increasing order of their stamps (or of their positions in one
    segment, which order as the stamps do), without one table of them
    all: a dict rebuilds its whole table, O(entries), inside whichever call
    inserts past its room, and an ``OrderedDict`` of a million-block tier's
    keys was a 0.16 s pause of the call that stored a block. Keys are held
    in *buckets*, one dict per ``2**STAMP_BUCKET_BITS`` consecutive stamps
    (key -> None, in stamp order), found from the key's stamp, which the
    caller keeps; a bucket emptied is dropped. Stamps added must increase.

    A dict keeps its largest table until it is rebuilt, and a bucket of old
    stamps is never rebuilt (nothing is added to it), so a bucket shrunk to
    an eighth of its span is rebuilt at that size, O(its keys): a tier
    whose keys are touched would otherwise keep a full bucket's table for
    each bucket's few survivors.

    ``add``, ``discard`` and ``len`` are O(1) (amortized: the rebuild
    costs an eighth of a bucket's span per bucket); ``pop_last`` too, plus
    the places of buckets emptied at the end since the bucket map's last
    rebuild; ``pop_first`` walks the first bucket's emptied places (at most
    its span: a queue popped from its front wants small buckets, ``bits``)
    and is otherwise amortized O(1); iteration is O(keys yielded) plus the
    buckets' emptied places, at most a bucket's span each."""

    def __init__(self, bits: int | None = None) -> None:
        # bucket number (stamp >> bits) -> bucket. Numbers grow with stamps,
        # so the dict's insertion order is the buckets' order.
        self._buckets: dict[int, dict[Hashable, None]] = {}
        self._bits = STAMP_BUCKET_BITS if bits is None else bits
        # A bucket left with this many keys is rebuilt at its size (_took).
        self._eighth = (1 << self._bits) >> 3
        self._len = 0
        # The number of the newest bucket, the one adds go to: not compacted.
        self._newest = -1
        # No live bucket is numbered below this (None: not known yet).
        # pop_first steps it up instead of taking the bucket map's first
        # entry, which walks every bucket dropped from the front since the
        # map's last rebuild (a queue drops one per bucket's span).
        self._first: int | None = None

    def __len__(self) -> int:
        return self._len

    def add(self, key: Hashable, stamp: int) -> None:
        """Append ``key`` with ``stamp``, larger than every stamp added."""
        number = stamp >> self._bits
        bucket = self._buckets.get(number)
        if bucket is None:
            bucket = self._buckets[number] = {}
            self._newest = number
        bucket[key] = None
        self._len += 1

    def extend(self, keys: list[Hashable], start: int) -> None:
        """Append ``keys`` with the stamps ``start``, ``start + 1``, ...,
        each larger than every stamp added; one update per bucket."""
        bits, buckets = self._bits, self._buckets
        end = start + len(keys)
        at = start
        while at < end:
            number = at >> bits
            upto = min(end, (number + 1) << bits)
            part = (
                keys if at == start and upto == end else keys[at - start : upto - start]
            )
            bucket = buckets.get(number)
            if bucket is None:
                buckets[number] = dict.fromkeys(part)
                self._newest = number
            else:
                bucket.update(dict.fromkeys(part))
            at = upto
        self._len += len(keys)

    def discard(self, key: Hashable, stamp: int) -> None:
        """Take out ``key``, held with ``stamp``."""
        number = stamp >> self._bits
        bucket = self._buckets[number]
        del bucket[key]
        self._took(number, bucket)

    def discard_many(self, keys: Iterable[Hashable], stamps: Iterable[int]) -> None:
        """``discard`` of each key with its stamp, in one call."""
        # _took's test inlined: LRU's evictions and removes come here.
        buckets, bits, eighth = self._buckets, self._bits, self._eighth
        count = 0
        for key, stamp in zip(keys, stamps):
            number = stamp >> bits
            bucket = buckets[number]
            del bucket[key]
            count += 1
            left = len(bucket)
            if not left or left == eighth:
                self._shrunk(number, bucket)
        self._len -= count

    def move_many(
        self, keys: Sequence[Hashable], olds: Sequence[int], start: int
    ) -> None:
        """For each key in turn: take it out (held with ``olds[i]``) and
        append it with stamp ``start + i``, larger than every stamp added
        (a key listed twice: its later old stamp is its earlier new one).
        In one call: LRU's touches."""
        buckets, bits, eighth = self._buckets, self._bits, self._eighth
        newest = self._newest
        target = buckets.get(newest)
        for key, old, stamp in zip(keys, olds, range(start, start + len(keys))):
            number = old >> bits
            bucket = buckets[number]
            del bucket[key]
            left = len(bucket)
            if (not left or left == eighth) and number != newest:
                self._shrunk(number, bucket)
            number = stamp >> bits
            if number != newest or target is None:
                if target is not None and not target:
                    del buckets[newest]  # emptied here, never added to again
                target = buckets.get(number)
                if target is None:
                    target = buckets[number] = {}
                self._newest = newest = number
            target[key] = None

    def _took(self, number: int, bucket: dict[Hashable, None]) -> None:
        """A key was taken out of bucket ``number``: one fewer, and the bucket
        dropped or rebuilt once empty or down to an eighth (``_shrunk``)."""
        self._len -= 1
        left = len(bucket)
        if not left or left == self._eighth:
            self._shrunk(number, bucket)

    def _shrunk(self, number: int, bucket: dict[Hashable, None]) -> None:
        """Bucket ``number`` lost a key and is empty (dropped) or down to an
        eighth of its span (rebuilt at that size, unless it is the newest:
        adds go there)."""
        if not bucket:
            del self._buckets[number]
        elif number != self._newest:
            self._buckets[number] = dict.fromkeys(bucket)

    def pop_last(self) -> Hashable:
        """Take out and return the key with the largest stamp (the order
        must not be empty)."""
        number = next(reversed(self._buckets))
        bucket = self._buckets[number]
        key, _ = bucket.popitem()
        self._len -= 1
        if not bucket:
            del self._buckets[number]
        return key

    def pop_first(self) -> Hashable:
        """Take out and return the key with the smallest stamp (the order
        must not be empty)."""
        buckets = self._buckets
        number = self._first
        if number is None:
            number = next(iter(buckets))
        bucket = buckets.get(number)
        while bucket is None:  # each number is stepped over once
            number += 1
            if number > self._newest:  # never (no add goes below _first)
                number = next(iter(buckets))
            bucket = buckets.get(number)
        self._first = number
        key = next(iter(bucket))
        del bucket[key]
        self._took(number, bucket)
        return key

    def clear(self) -> None:
        self._buckets.clear()
        self._len = 0
        self._newest = -1
        self._first = None

    def __iter__(self) -> Iterator[Hashable]:
        return itertools.chain.from_iterable(self._buckets.values())


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first. One segment: the keys by last use (their
    positions in ``positions``, their order a :class:`StampOrder`)."""

    name = "lru"
    summary = "least recently used first."

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.positions: dict[Hashable, int] = {}
        self._order = StampOrder()

    # One segment: a key's position is its stamp.
    def insert(self, key: Hashable) -> None:
        self.positions[key] = stamp = next(self._clock)
        self._order.add(key, stamp)

    def touch(self, key: Hashable) -> None:
        old = self.positions.get(key)
        if old is not None:
            self._order.discard(key, old)
            self.positions[key] = stamp = next(self._clock)
            self._order.add(key, stamp)

    def remove(self, key: Hashable, evicted: bool) -> None:
        old = self.positions.pop(key, None)
        if old is not None:
            self._order.discard(key, old)

    # The batches inline insert/touch/position and remove (a subclass that
    # changes those gets the per-key calls: EvictionPolicy._BULK_PATHS).
    def insert_many(self, keys: Iterable[Hashable]) -> list[int]:
        # New keys (none resident, none twice: the tier's contract): each
        # appended with the next stamp.
        keys = list(keys)
        if not keys:
            return []
        start = next(self._clock)
        end = start + len(keys)
        self._clock = itertools.count(end)
        stamps = range(start, end)
        self.positions.update(zip(keys, stamps))
        self._order.extend(keys, start)
        return list(stamps)

    def touch_many(self, keys: Iterable[Hashable]) -> list[int]:
        # Each key (all resident) moves last, with the next stamp; a key
        # listed twice ends with its last.
        keys = list(keys)
        positions = self.positions
        start = next(self._clock)
        end = start + len(keys)
        self._clock = itertools.count(end)
        olds = list(map(positions.__getitem__, keys))
        if len(set(keys)) != len(keys):
            # A key's later old stamp is its earlier new one.
            seen: dict[Hashable, int] = {}
            for i, key in enumerate(keys):
                if key in seen:
                    olds[i] = seen[key]
                seen[key] = start + i
        stamps = range(start, end)
        positions.update(zip(keys, stamps))
        self._order.move_many(keys, olds, start)
        return list(stamps)

    def remove_many(self, keys: Iterable[Hashable], evicted: bool) -> None:
        pop = self.positions.pop
        keys = list(keys)
        olds = [pop(key, None) for key in keys]
        if None in olds:  # keys not resident (or listed twice): skipped
            keys = [k for k, old in zip(keys, olds) if old is not None]
            olds = [old for old in olds if old is not None]
        self._order.discard_many(keys, olds)

    def _forget_all(self) -> None:
        self.positions.clear()
        self._order.clear()

    def candidates(self) -> Iterator[Hashable]:
        # Callers collect first, then evict, so iterate directly.
        return iter(self._order)

    def position(self, key: Hashable) -> int:
        return self.positions[key]

    def victim_order(self) -> tuple[Run, ...]:
        return ((0, None),)
