"""The victim index of one tier: which blocks may be evicted, in policy order.

A :class:`~kvtier.tiers.tier.Tier` owns one :class:`VictimIndex` and tells
it about every change of a resident key's policy position and of whether
the key may be a victim (*eligible*: READY, unpinned, allowed by the tier's
filter). The index keeps the eligible keys ordered exactly as the policy
ranks them, by the positions the policy hands out (ints that order keys by
segment, then stamp: :class:`kvtier.tiers.policy.EvictionPolicy`'s victim
order). Choosing victims walks only that index, following the policy's
``victim_order`` runs, so a tier whose blocks are nearly all dirty, pinned
or being written answers at once instead of scanning every block it holds.

How the keys of one segment are held: a policy stamps a key when it is
inserted or used, so keys mostly become eligible in stamp order (a stored
block, a block read and released, a spill's blocks in the order they were
queued). Each segment has a few *runs*, sequences of keys whose positions
increase from front to back: a key is appended to the run whose last
position is the largest one below its own, in O(1). A run is a list of
*buckets*, insertion-ordered dicts (key -> position) of at most
``BUCKET_KEYS`` keys, not one dict: a dict rebuilds its whole table,
O(entries), inside whichever call inserts past its room, and a run holds up
to the tier's every block (a million-block run's rebuild was a 0.15 s pause
of the call admitting a key). Each new bucket tidies two older ones, round
robin: an emptied bucket is dropped, a sparse one compacted (a dict's table
never shrinks otherwise); the front's emptied buckets are dropped when they
get there. Only a key older than the last position of every run goes to the
segment's heap. A key that stops being eligible, is touched or leaves is
deleted from its run at once; a heap entry of such a key goes stale and is
dropped when it reaches the top (heaps are rebuilt when stale entries
outnumber live ones). The segment's oldest eligible key is the smallest of
the run fronts and the heap top. So admitting, dropping and re-placing a
key cost O(1) (O(log n) when it goes to the heap), and each victim O(runs)
plus the stale heap entries dropped, each once, and the emptied buckets
stepped over, at most a run's bucket count (about its keys / 4,096) a
call.

Not thread-safe: the tier's owner serializes calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import filterfalse, repeat
from typing import Any

from kvtier.tiers.policy import SEGMENT_SHIFT, Run

# Ordered runs per segment: with three, no admission of the trace replay
# goes to a heap (docs/benchmarks.md, "Scheduler cost"); more would only add
# a comparison per victim.
RUNS_PER_SEGMENT = 3

# Keys per bucket of a run: the most a bucket's table rebuild walks (a
# rebuild's cost grows with its table: one of a million keys would stall a
# step, one of a few thousand does not). Read at each use (tests shrink it).
BUCKET_KEYS = 4096

# Buckets of its run that a new bucket's creation tidies, round robin (the
# new one excluded): an emptied bucket is dropped, a bucket an eighth full or
# less is compacted in place. A dict keeps its largest table until it is
# rebuilt, and a bucket of old keys never is, so without this a tier whose
# keys are touched keeps a full bucket's table for each bucket's few
# survivors, and buckets emptied behind a long-lived front key pile up.
# At most 2 x BUCKET_KEYS / 8 keys moved per new bucket: O(1) per key.
_TIDY_BUCKETS = 2

Bucket = OrderedDict  # key -> position, increasing front to back


def _prune(run: list[Bucket]) -> None:
    """Drop the emptied buckets at ``run``'s front (its first is empty):
    afterwards the run is empty or its first bucket holds its oldest key.
    Never while keys taken out of a bucket are held to be put back."""
    i = 1
    while i < len(run) and not run[i]:
        i += 1
    del run[:i]


class VictimIndex:
    """Eligible keys of one tier, by position (segment, then stamp).

    ``pos[key]`` is the policy position of every resident key as of its
    last insert/touch: the policy's own ``positions`` when it exposes them
    (``owns_pos`` False: the policy keeps them current), else the index's
    dict, which the tier keeps. ``eligible[key]`` is, for each key that
    may be a victim now, the container holding it: a bucket of one of its
    segment's runs (``runs[seg][r]``: a list of buckets), or the dict of its
    segment's live heap entries (``heaped[seg]``: key -> position). Deleting
    ``key`` from that container makes it ineligible; the tier does that
    (and ``in``/``len`` on ``eligible``) directly in its hot batch loops,
    and otherwise changes the index only through the methods below."""

    def __init__(
        self, segments: int, positions: dict[Hashable, int] | None = None
    ) -> None:
        self.owns_pos = positions is None
        self.pos: dict[Hashable, int] = {} if positions is None else positions
        self.eligible: dict[Hashable, dict[Hashable, int]] = {}
        self.runs: list[list[list[Bucket[Hashable, int]]]] = [
            [[] for _ in range(RUNS_PER_SEGMENT)] for _ in range(segments)
        ]
        # The last position appended to each run (valid while it is not
        # empty), and where each run's tidying goes on.
        self.tails: list[list[int]] = [[-1] * RUNS_PER_SEGMENT for _ in range(segments)]
        self.cursors: list[list[int]] = [
            [0] * RUNS_PER_SEGMENT for _ in range(segments)
        ]
        self.heaps: list[list[tuple[int, Hashable]]] = [[] for _ in range(segments)]
        self.heaped: list[dict[Hashable, int]] = [{} for _ in range(segments)]
        # Entries examined by ``victims``, for tests and benchmarks.
        self.inspected = 0

    # --- admitting and dropping keys ---

    def admit_many(self, keys: Iterable[Hashable]) -> None:
        """The keys (positioned) may be victims now; a key already eligible
        or listed twice is admitted once. O(1) per key, O(log n) for one
        that goes to the heap. The keys are sorted by position first, so a
        batch that arrives newest first still appends to one run: each
        segment's keys go, in one batch, to the run chosen for its oldest
        key."""
        eligible, pos = self.eligible, self.pos
        # (filterfalse: a comprehension is a function call of its own.)
        fresh = list(filterfalse(eligible.__contains__, keys))
        if not fresh:
            return
        if len(fresh) > 1:
            fresh.sort(key=pos.__getitem__)
        positions = list(map(pos.__getitem__, fresh))
        end = len(fresh)
        i = 0
        heaped_into: set[int] = set()
        while i < end:
            position = positions[i]
            seg = position >> SEGMENT_SHIFT
            # The run whose last position is the largest one below this one
            # (an empty run fits anything); the keys after this one in the
            # segment are newer, so they append to it too.
            runs, tails = self.runs[seg], self.tails[seg]
            run: list[Bucket[Hashable, int]] | None = None
            best = -2
            for j, candidate in enumerate(runs):
                if candidate and not candidate[0]:
                    _prune(candidate)
                tail = tails[j] if candidate else -1
                if best < tail < position:
                    best, run, r = tail, candidate, j
            if run is None:
                # Older than every run's tail: this key goes to the heap,
                # the next one looks for a run again.
                key = fresh[i]
                i += 1
                while i < end and fresh[i] == key:
                    i += 1  # listed twice (adjacent once sorted)
                live = self.heaped[seg]
                live[key] = position
                heapq.heappush(self.heaps[seg], (position, key))
                eligible[key] = live
                heaped_into.add(seg)
                continue
            j = i + 1
            if positions[-1] >> SEGMENT_SHIFT != seg:
                while j < end and positions[j] >> SEGMENT_SHIFT == seg:
                    j += 1
            else:
                j = end
            if i or j != end:
                group, placed = fresh[i:j], positions[i:j]
            else:
                group, placed = fresh, positions
            tails[r] = placed[-1]  # the group's last, its newest
            self._append(run, group, placed, seg, r)
            i = j
        for seg in heaped_into:
            if len(self.heaps[seg]) > 2 * len(self.heaped[seg]) + 64:
                self._rebuild(seg)

    def _append(
        self,
        run: list[Bucket[Hashable, int]],
        group: list[Hashable],
        placed: list[int],
        seg: int,
        r: int,
    ) -> None:
        """Append ``group`` (positions ``placed``, increasing, all newer
        than ``run``'s keys) to ``run`` (``runs[seg][r]``): to its last
        bucket while it has room, then to new buckets, each tidying
        ``_TIDY_BUCKETS`` older ones."""
        eligible, size = self.eligible, BUCKET_KEYS
        bucket = run[-1] if run else None
        k, end = 0, len(group)
        while k < end:
            if bucket is None or len(bucket) >= size:
                if k and group[k] == group[k - 1]:
                    k += 1  # listed twice, the first in the bucket just filled
                    continue
                bucket = Bucket()
                run.append(bucket)
                self._tidy(run, seg, r)
            upto = min(end, k + size - len(bucket))
            if k or upto != end:
                part, where = group[k:upto], placed[k:upto]
            else:
                part, where = group, placed
            # A key listed twice gets the same position twice: one entry. (A
            # loop of stores: OrderedDict.update takes the slower generic
            # MutableMapping path.)
            for key, position in zip(part, where):
                bucket[key] = position
            eligible.update(zip(part, repeat(bucket)))
            k = upto

    def _tidy(self, run: list[Bucket[Hashable, int]], seg: int, r: int) -> None:
        """Visit the next ``_TIDY_BUCKETS`` buckets of ``run`` before its
        last: drop an empty one, compact one an eighth full or less in
        place (the same object: ``eligible`` points to it). Never while
        keys taken out of a bucket are held to be put back."""
        at, last = self.cursors[seg][r], len(run) - 1
        for _ in range(_TIDY_BUCKETS):
            if at >= last:
                at = 0
                if last <= 0:
                    break
            bucket = run[at]
            if not bucket:
                del run[at]
                last -= 1
                continue
            if len(bucket) <= BUCKET_KEYS >> 3:
                items = list(bucket.items())
                bucket.clear()  # frees the table; refilled at its size
                for key, position in items:
                    bucket[key] = position
            at += 1
        self.cursors[seg][r] = at

    def drop_many(self, keys: Iterable[Hashable]) -> None:
        """The keys may not be victims any more (pinned, filtered out);
        their positions stay. O(1) per key."""
        pop = self.eligible.pop
        for key in keys:
            held = pop(key, None)
            if held is not None:
                del held[key]

    def place_many(self, keys: Sequence[Hashable]) -> None:
        """Each key (eligible or not) is, from now on, eligible at its
        recorded position: an eligible key's old place is dropped first."""
        self.drop_many(keys)
        self.admit_many(keys)

    def forget_many(self, keys: Iterable[Hashable]) -> None:
        """The keys left the tier. O(1) per key."""
        if self.owns_pos:
            pos_pop = self.pos.pop
            for key in keys:
                pos_pop(key, None)
        self.drop_many(keys)

    def _rebuild(self, seg: int) -> None:
        """Drop the stale entries of ``seg``'s heap: O(live entries), after
        at least as many pushes."""
        heap = [(position, key) for key, position in self.heaped[seg].items()]
        heapq.heapify(heap)
        self.heaps[seg] = heap

    def _live_top(self, seg: int, fronts: list[list[Any]]) -> int:
        """Drop the stale entries off the top of ``seg``'s heap and add its
        live top to ``fronts``, if any; returns the entries dropped."""
        heap, live = self.heaps[seg], self.heaped[seg]
        dropped = 0
        while heap:
            position, key = heap[0]
            if live.get(key) == position:
                fronts.append([position, key, live])
                break
            heapq.heappop(heap)  # stale: gone for good
            dropped += 1
        return dropped

    def clear(self) -> None:
        if self.owns_pos:
            self.pos.clear()
        self.eligible.clear()
        for runs in self.runs:
            for run in runs:
                run.clear()
        self.cursors = [[0] * RUNS_PER_SEGMENT for _ in self.cursors]
        for live in self.heaped:
            live.clear()
        self.heaps = [[] for _ in self.heaps]

    # --- choosing victims ---

    def _drain_run(
        self,
        front: list[Any],
        fronts: list[list[Any]],
        stop: int | None,
        n: int,
        chosen: list[Hashable],
        held: list[tuple[Any, Hashable, int, Any]],
        exclude: set[Hashable] | frozenset[Hashable],
        take: bool,
    ) -> int:
        """The inner loop of :meth:`victims` for a run whose front is the
        oldest: take its keys in turn, bucket after bucket (each chosen, or
        held to be put back) while they are older than ``stop`` and every
        other front, until ``chosen`` has ``n``; then update or remove
        ``front``. Buckets emptied here stay in the run (the keys held go
        back into them); the next call's pruning drops those left empty.
        Returns the entries inspected."""
        _, _, bucket, run, at = front
        bound = stop
        for other in fronts:
            if other is not front and (bound is None or other[0] < bound):
                bound = other[0]
        eligible = self.eligible
        inspected = 0
        done = False
        while True:
            popitem = bucket.popitem
            while bucket:
                key, position = popitem(False)
                if bound is not None and position >= bound:
                    bucket[key] = position  # not this one's turn: back in front
                    bucket.move_to_end(key, last=False)
                    done = True
                    break
                inspected += 1
                if key in exclude:
                    held.append((bucket, key, position, None))
                    continue
                chosen.append(key)
                if take:
                    del eligible[key]
                else:
                    held.append((bucket, key, position, None))
                if len(chosen) >= n:
                    done = True
                    break
            if done:
                break
            # This bucket is spent: the run goes on in its next one with keys.
            at += 1
            while at < len(run) and not run[at]:
                at += 1
            if at == len(run):
                break
            bucket = run[at]
        if bucket:
            front[1] = after = next(iter(bucket))
            front[0], front[2], front[4] = bucket[after], bucket, at
        else:
            fronts.remove(front)
        return inspected

    def victims(
        self,
        n: int,
        order: Sequence[Run],
        exclude: set[Hashable] | frozenset[Hashable],
        take: bool,
    ) -> list[Hashable]:
        """Up to ``n`` eligible keys not in ``exclude``, in the order of
        ``order`` (the policy's victim order).

        ``take=False``: nothing changes but the dropping of stale heap
        entries. ``take=True``: the chosen keys leave the index (no longer
        eligible); the caller removes them from the tier or re-admits them.
        Cost: O(runs) per entry inspected (the chosen and the excluded),
        O(log n) more for one from a heap, and the
        stale heap entries, each dropped once."""
        chosen: list[Hashable] = []
        # Entries taken out to be looked at and put back afterwards:
        # (container, key, position, heap or None for a run).
        held: list[tuple[Any, Hashable, int, Any]] = []
        eligible = self.eligible
        heappop = heapq.heappop
        inspected = 0
        for runs in self.runs:
            for run in runs:
                if run and not run[0]:
                    _prune(run)
        for seg, stop in order:
            heap, live = self.heaps[seg], self.heaped[seg]
            # Each non-empty run's front, [position, key, bucket, run, index of
            # the bucket in the run], and the heap's live top, [position, key,
            # live]: the segment's oldest key is the smallest (stamps are
            # unique, so no comparison goes past the position), and only the
            # front taken moves on.
            # (A segment's runs may be visited twice; the second time, the
            # buckets the first emptied are skipped, not dropped: the keys
            # held go back into them.)
            fronts = []
            for run in self.runs[seg]:
                at = 0
                while at < len(run) and not run[at]:
                    at += 1
                if at < len(run):
                    bucket = run[at]
                    key = next(iter(bucket))
                    fronts.append([bucket[key], key, bucket, run, at])
            inspected += self._live_top(seg, fronts)
            while fronts and len(chosen) < n:
                front = min(fronts) if len(fronts) > 1 else fronts[0]
                position, key, source = front[0], front[1], front[2]
                if stop is not None and position >= stop:
                    break  # the rest of this segment comes in a later run
                if source is not live:
                    # A run: its keys are taken in turn while they stay
                    # older than every other front (and ``stop``), without
                    # comparing the fronts again for each one.
                    inspected += self._drain_run(
                        front, fronts, stop, n, chosen, held, exclude, take
                    )
                    continue
                inspected += 1
                del source[key]  # in hand: in no container until put back
                heappop(heap)
                fronts.remove(front)
                inspected += self._live_top(seg, fronts)
                if key in exclude:
                    held.append((source, key, position, heap))
                    continue
                chosen.append(key)
                if take:
                    del eligible[key]
                else:
                    held.append((source, key, position, heap))
            if len(chosen) >= n:
                break
        self.inspected += inspected
        # Newest first, so that each run gets its oldest key back in front.
        for source, key, position, from_heap in reversed(held):
            source[key] = position
            if from_heap is None:
                source.move_to_end(key, last=False)
            else:
                heapq.heappush(from_heap, (position, key))
        return chosen

    def scan(
        self,
        n: int,
        candidates: Iterable[Hashable],
        exclude: set[Hashable] | frozenset[Hashable],
    ) -> list[Hashable]:
        """Victims among ``candidates`` (a bounded prefix of the policy's
        order): the first ``n`` eligible ones not excluded; stops once every
        eligible key was seen. Nothing changes but ``inspected``.
        O(candidates consumed)."""
        eligible = self.eligible
        chosen: list[Hashable] = []
        left = len(eligible)
        inspected = 0
        for key in candidates:
            inspected += 1
            if key not in eligible:
                continue
            left -= 1
            if key not in exclude:
                chosen.append(key)
                if len(chosen) >= n:
                    break
            if left == 0:
                break
        self.inspected += inspected
        return chosen
