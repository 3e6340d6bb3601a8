"""The load thread's bookkeeping of its bounce parts, of the transfers it
issued and of the reads it gave up (see
:mod:`kvtier.connector.worker.load_runner`).

The reader's bounce area is cut into parts (:func:`bounce_parts`); a read
batch takes a free part. The part is free again once the batch was verified
and no transfer issued from it is in flight (asynchronous copy paths), or
once a given-up read finally returned. A task may go back to the worker only
once none of its transfers is in flight: until then they may still write its
KV blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvtier.connector.worker.job_errors import IO_ERROR
from kvtier.connector.worker.load_task import LoadTask, ReadBatch
from kvtier.log import get_logger

logger = get_logger("connector")

# About how many bytes one read batch (one part of the bounce area) reads.
# A batch is verified and copied only once all of it is read, so the last
# batch of a load is never overlapped with a read: small parts keep that tail
# short and start the first verification early, large ones cost more turns
# per byte. Measured on a 2-core VM, in-process engine, 64 MiB disk hit with
# a 64 MiB area (docs/benchmarks.md, "Step stalls"): two 32 MiB halves
# finished 13 ms of verifying and copying after the last read returned; eight
# parts of about 8 MiB overlap all but the last part's ~2 ms.
PART_BYTES = 8 << 20
# At most this many parts (a large area makes larger parts, not more).
MAX_PARTS = 16


def bounce_parts(capacity: int, slot_bytes: int) -> tuple[int, int]:
    """``(parts, slots per part)`` for a bounce area of ``capacity`` slots of
    ``slot_bytes``: parts of about :data:`PART_BYTES`, at least two where the
    area holds two slots (a batch is read while the one before it is
    verified), at most :data:`MAX_PARTS`."""
    if capacity < 2:
        return 1, max(1, capacity)
    per = max(1, min(PART_BYTES // max(1, slot_bytes), capacity // 2))
    parts = min(MAX_PARTS, capacity // per)
    return parts, capacity // parts


class BounceParts:
    """Which bounce parts are free, the transfers in flight, and the parts
    set aside for given-up reads.

    Contract:
      - :meth:`take` marks the first free part of the first ``parts`` in use
        (at most ``MAX_PARTS``) and returns it (one must be free:
        :meth:`any_free`); :meth:`release` frees it again.
      - :meth:`issued` notes a transfer of ``task`` (reading ``part``, or
        None for a copy from elsewhere); :meth:`landed` notes the ids that
        landed (unknown ids are ignored), and a part whose last reader
        landed is released. :meth:`copying` says whether a task still has
        a transfer in flight (it may go back to the worker only once not).
      - :meth:`give_up` fails a batch whose reads have not returned and
        keeps its part taken (:meth:`set_aside`: without failing it) until
        :meth:`reap` sees its reads returned; :meth:`abandon` waits for a
        batch's reads without using them, then frees its part.
      - Used by the load thread only: no locking.
    """

    def __init__(self) -> None:
        self.free = [True] * MAX_PARTS
        # id -> (task, part or -1), oldest first; the ids reading each part.
        self._in_flight: dict[int, tuple[LoadTask, int]] = {}
        self._readers: list[set[int]] = [set() for _ in range(MAX_PARTS)]
        self.stuck: list[ReadBatch] = []  # given up, reads not yet returned

    def any_free(self, parts: int) -> bool:
        return any(self.free[:parts])

    def take(self, parts: int) -> int:
        part = self.free.index(True, 0, parts)
        self.free[part] = False
        return part

    def release(self, part: int) -> None:
        self.free[part] = True

    def read_by_copies(self, part: int) -> bool:
        """Whether a transfer in flight still reads ``part``."""
        return bool(self._readers[part])

    def issued(self, transfer: int, task: LoadTask, part: int | None) -> None:
        """A transfer issued for ``task`` (its lock held: ``task.copies``)."""
        task.copies += 1
        self._in_flight[transfer] = (task, -1 if part is None else part)
        if part is not None:
            self._readers[part].add(transfer)

    def landed(self, transfers: Iterable[int]) -> None:
        for transfer in transfers:
            entry = self._in_flight.pop(transfer, None)
            if entry is None:
                continue
            task, part = entry
            with task.lock:  # the worker reads it to settle a given-up job
                task.copies -= 1
            if part >= 0:
                readers = self._readers[part]
                readers.discard(transfer)
                if not readers:
                    self.release(part)

    def copying(self, task: LoadTask) -> bool:
        """Whether a transfer ``task`` issued has not landed yet."""
        return task.copies > 0

    def oldest(self) -> int:
        """The transfer in flight the longest (one must be: :meth:`idle`)."""
        return next(iter(self._in_flight))

    def in_flight(self) -> list[int]:
        """The transfers in flight, oldest first."""
        return list(self._in_flight)

    def idle(self) -> bool:
        """No transfer in flight."""
        return not self._in_flight

    def set_aside(self, batch: ReadBatch) -> None:
        self.stuck.append(batch)

    def give_up(self, batch: ReadBatch, parts: int) -> None:
        """A batch whose reads have not returned: its blocks fail, its part
        stays set aside until they return."""
        task = batch.task
        task.batches -= 1
        if task.failed is not None:
            task.failed[batch.positions] = IO_ERROR  # a stall: the copies stay
        self.set_aside(batch)
        if task.cancelled:
            return  # the worker gave the job up and said so
        logger.error(
            "kvtier: disk reads of load job %d have not returned after %.0f s: its "
            "%d blocks are recomputed; %d of %d bounce parts wait for the reads",
            task.job_id,
            time.monotonic() - batch.since,
            len(batch.positions),
            len(self.stuck),
            parts,
        )

    def reap(self, reader: Any) -> None:
        """Free the parts of given-up batches whose reads finally returned."""
        for batch in [b for b in self.stuck if reader.ready(b.read)]:
            self.stuck.remove(batch)
            self.abandon(reader, batch)
            logger.warning(
                "kvtier: a stalled disk read returned after %.0f s; its bounce "
                "part is in use again",
                time.monotonic() - batch.since,
            )

    def abandon(self, reader: Any, batch: ReadBatch) -> None:
        """Wait for a batch's reads without using them, then free its part."""
        try:
            reader.abandon(batch.read)
        finally:
            self.release(batch.part)
