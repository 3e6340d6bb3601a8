"""The load thread's bookkeeping of its bounce halves, of the transfers it
issued and of the reads it gave up (see
:mod:`kvtier.connector.worker.load_runner`).

A read batch takes a free half of the reader's area; the half is free again
once the batch was verified and no transfer issued from it is in flight
(asynchronous copy paths), or once a given-up read finally returned. A task
may go back to the worker only once none of its transfers is in flight:
until then they may still write its KV blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kvtier.connector.worker.load_task import LoadTask, ReadBatch

logger = logging.getLogger("kvtier.connector")


class BounceHalves:
    """Which bounce halves are free, the transfers in flight, and the
    halves set aside for given-up reads.

    Contract:
      - :meth:`take` marks the first free half of the first ``halves`` in
        use and returns it (one must be free: :meth:`any_free`);
        :meth:`release` frees it again.
      - :meth:`issued` notes a transfer of ``task`` (reading ``half``, or
        None for a copy from elsewhere); :meth:`landed` notes the ids that
        landed (unknown ids are ignored): their task's ``copies`` shrink,
        and a half whose last reader landed is released.
      - :meth:`give_up` fails a batch whose reads have not returned and
        keeps its half taken (:meth:`set_aside`: without failing it) until
        :meth:`reap` sees its reads returned; :meth:`abandon` waits for a
        batch's reads without using them, then frees its half.
      - Used by the load thread only: no locking.
    """

    def __init__(self) -> None:
        self.free = [True, True]
        # id -> (task, half or -1), oldest first; the ids reading each half.
        self._in_flight: dict[int, tuple[LoadTask, int]] = {}
        self._readers: list[set[int]] = [set(), set()]
        self.stuck: list[ReadBatch] = []  # given up, reads not yet returned

    def any_free(self, halves: int) -> bool:
        return any(self.free[:halves])

    def take(self, halves: int) -> int:
        half = self.free.index(True, 0, halves)
        self.free[half] = False
        return half

    def release(self, half: int) -> None:
        self.free[half] = True

    def read_by_copies(self, half: int) -> bool:
        """Whether a transfer in flight still reads ``half``."""
        return bool(self._readers[half])

    def issued(self, transfer: int, task: LoadTask, half: int | None) -> None:
        task.copies.add(transfer)
        self._in_flight[transfer] = (task, -1 if half is None else half)
        if half is not None:
            self._readers[half].add(transfer)

    def landed(self, transfers: Iterable[int]) -> None:
        for transfer in transfers:
            entry = self._in_flight.pop(transfer, None)
            if entry is None:
                continue
            task, half = entry
            task.copies.discard(transfer)
            if half >= 0:
                readers = self._readers[half]
                readers.discard(transfer)
                if not readers:
                    self.release(half)

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

    def give_up(self, batch: ReadBatch, halves: int) -> None:
        """A batch whose reads have not returned: its blocks fail, its half
        stays set aside until they return."""
        task = batch.task
        task.batches -= 1
        if task.failed is not None:
            task.failed[batch.positions] = True
        self.set_aside(batch)
        if task.cancelled:
            return  # the worker gave the job up and said so
        logger.error(
            "kvtier: disk reads of load job %d have not returned after %.0f s: its "
            "%d blocks are recomputed; %d of %d bounce halves wait for the reads",
            task.job_id,
            time.monotonic() - batch.since,
            len(batch.positions),
            len(self.stuck),
            halves,
        )

    def reap(self, reader: Any) -> None:
        """Free the halves of given-up batches whose reads finally returned."""
        for batch in [b for b in self.stuck if reader.ready(b.read)]:
            self.stuck.remove(batch)
            self.abandon(reader, batch)
            logger.warning(
                "kvtier: a stalled disk read returned after %.0f s; its bounce "
                "half is in use again",
                time.monotonic() - batch.since,
            )

    def abandon(self, reader: Any, batch: ReadBatch) -> None:
        """Wait for a batch's reads without using them, then free its half."""
        try:
            reader.abandon(batch.read)
        finally:
            self.release(batch.half)
