"""Spills (host rows -> disk slots) and promotions (disk slots -> host rows)
of every TP rank, run on background threads off the scheduler's path.

The scheduler side turns the hierarchy's decisions into jobs; they must
never block its step, so submitting only enqueues and finished jobs are
polled. The host rows are the CPU tier's shared memory (or, in tiering
mode, vLLM's primary tier), mapped in the scheduler process (or in its
spill process, :mod:`kvtier.store.spill_process`, which runs this same
engine), so the workers take no part. Each rank has its own store and rows; a job's items are fanned
out per rank onto one pool of threads (a spill in batches, one per thread,
written by ``DiskStore.write_blocks``; a promotion per item), so one large
job keeps every thread and disk busy, and promotions (a request waits for
them) run ahead of spills (which run ahead of need). A key that failed on
any rank failed.

:class:`TransferEngine` runs the jobs;
:class:`~kvtier.store.runtime.DiskRuntime` owns what they run on.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.store.slot import ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.tiers.plans import TransferItem

logger = get_logger("store")

PROMOTE_PRIORITY = 0
SPILL_PRIORITY = 1
_STOP_PRIORITY = 1 << 30  # sorts after every real task: shutdown drains first

# Read outcomes that mean the slot's own bytes are damaged: the slot is
# invalidated, so a restart never adopts it again.
_CORRUPT = frozenset(
    {ReadOutcome.CHECKSUM_MISMATCH, ReadOutcome.BAD_HEADER, ReadOutcome.TRUNCATED}
)
# What moving one item returns when it failed with an I/O error or was never
# done (an abandoned engine, an exception), not on bytes shown bad.
IO_FAILED = -1
# What an item returns when ``cancel_queued`` came before it started: never
# moved (so an I/O failure to the caller too), and named in the job's
# ``cancelled_keys``.
CANCELLED = -2

# Bound on waiting for the I/O threads at close(): a hung disk must not hang
# the engine's shutdown.
CLOSE_TIMEOUT_S = 10.0


class HostRows(Protocol):
    """One rank's host rows: ``array[row]`` is a contiguous ``block_bytes``
    view (the CPU tier's :class:`~kvtier.host.cpu_tier.CpuBlockBuffer`,
    :class:`~kvtier.host.cpu_tier.AttachedRows`, or a view of vLLM's primary
    tier). ``array`` may raise OSError where the rows cannot be mapped."""

    block_bytes: int

    @property
    def array(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ArrayRows:
    """:class:`HostRows` over an array already at hand: a view of vLLM's
    primary tier, or the CPU tier's rows mapped in the spill process."""

    array: np.ndarray
    block_bytes: int


@dataclass(frozen=True)
class FinishedJob:
    """A job every rank finished.

    ``lost_keys``: every key whose transfer did not happen on some rank,
    whatever the cause (each once); ``success`` is False iff there is one.
    ``io_failed_keys`` (of them): keys whose failure says nothing against
    their disk copy on any rank (an I/O error, or never moved: refused,
    given up), so a promotion's slot may be read again; the others' bytes
    were shown corrupt on some rank. ``bytes``: block bytes moved by the
    items that succeeded, every rank's (DiskStore.stats has the on-disk
    bytes); ``seconds`` from submission to the last item (queueing included).
    ``cancelled_keys`` (of the I/O-failed ones): keys not moved on some rank
    because :meth:`TransferEngine.cancel_queued` came before their item
    started, not for anything the drive did.
    """

    job_id: int
    success: bool
    bytes: int
    seconds: float
    lost_keys: list[bytes]
    io_failed_keys: list[bytes] = field(default_factory=list)
    spill: bool = False
    cancelled_keys: list[bytes] = field(default_factory=list)


class _Job:
    """One job in flight (its keys, its items left) and what they did."""

    def __init__(self, job_id: int, keys: list[bytes], count: int, spill: bool) -> None:
        self.job_id, self.keys, self.remaining, self.spill = job_id, keys, count, spill
        self.started = time.perf_counter()
        self.bytes = 0
        self.lost: dict[bytes, None] = {}  # ordered, each key once
        self.corrupt: set[bytes] = set()  # failed on bytes shown bad on some rank
        self.cancelled: set[bytes] = set()  # not moved on some rank: cancelled
        self.broke: set[bytes] = set()  # failed on some rank for another reason
        self.lock = threading.Lock()
        self.final: FinishedJob | None = None

    def item_done(self, key: bytes, nbytes: int | None) -> bool:
        """Record one item (bytes moved; None: failed on bad bytes;
        ``IO_FAILED``; ``CANCELLED``); True when it was the last."""
        with self.lock:
            if nbytes is None or nbytes < 0:
                self.lost[key] = None
                if nbytes == CANCELLED:
                    self.cancelled.add(key)
                else:
                    self.broke.add(key)
                    if nbytes is None:
                        self.corrupt.add(key)
            else:
                self.bytes += nbytes
            self.remaining -= 1
            return self.remaining == 0

    def given_up(self) -> FinishedJob:
        """Failed whole, every key unread: nothing shows its bytes bad."""
        return FinishedJob(self.job_id, False, 0, 0.0, self.keys, self.keys, self.spill)

    def result(self) -> FinishedJob:
        return FinishedJob(
            self.job_id,
            not self.lost,
            self.bytes,
            time.perf_counter() - self.started,
            list(self.lost),
            [k for k in self.lost if k not in self.corrupt],
            self.spill,
            # Cancelled on every rank it failed on: a real failure elsewhere
            # makes it a failure, whatever the cancel did.
            [k for k in self.lost if k in self.cancelled and k not in self.broke],
        )


class _StagedTooLate(Exception):
    """A spill's row copy outlasted ``abandon()``: its block is not written."""


class RowGuard:
    """Fences every touch of host rows by transfer threads.

    A thread calls ``enter()`` before it reads or writes a row and
    ``leave()`` right after; ``close()`` makes every later ``enter()`` fail
    and waits for the touches in progress, which are memory copies and never
    wait for a disk. After a successful ``close()`` no thread of the engine
    touches a row again, even one that is still blocked in a read or write
    of a hung disk, so the caller may hand the rows to someone else."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._overrun = False

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def close(self, timeout: float | None = 5.0) -> bool:
        with self._cond:
            self._closed = True
            done = self._cond.wait_for(lambda: self._active == 0, timeout)
            if not done:
                self._overrun = True
            return done

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def overrun(self) -> bool:
        """Whether ``close()`` stopped waiting while a touch was in progress:
        that touch may have overlapped the rows' next owner, so what it read
        must not be used (a thread checks after its ``leave()``)."""
        return self._overrun


class TransferEngine:
    """Runs transfer jobs over ``rows[r]`` and ``stores[r]`` of every rank
    on ``threads`` threads.

    Contract:
      - ``submit_spill``/``submit_promote`` return immediately.
        A ``job_id`` must not be reused while that job is pending. Items are
        ``(key, src, dst)``: CPU row -> disk slot for spills, disk slot ->
        CPU row for promotions, the same on every rank.
      - Every submitted job produces exactly one :class:`FinishedJob`,
        returned once by ``get_finished`` (which drains); an item that
        raises fails (with a log line), it never kills a thread. A rank whose rows cannot be mapped fails its items at once
        as I/O failures (logged once).
      - For promote, a key whose read is not OK is in ``lost_keys`` and its
        row was not written (DiskStore.read_block guarantees it), so the
        caller must not mark that row valid. It is in ``io_failed_keys`` too
        when the read failed with an I/O error or was never done; its slot
        is then left as it is. A slot whose bytes failed verification (a bad
        header or checksum, a truncated slab) is invalidated.
      - Rows and slots named by a job belong to it until its result is
        returned: the caller must not reuse them before that.
      - ``shutdown`` runs all queued work to completion, then stops the
        threads, waiting at most ``timeout``; threads still busy then (a hung
        disk) are abandoned (see ``abandon``) and it returns False. Rows and
        stores are borrowed, not closed.
      - ``abandon`` stops all row access for good: queued items fail without
        I/O, and once it returned True no thread touches a row again, even
        one still blocked in a disk read or write.
      - ``cancel_queued`` fails, without I/O, every item submitted before it
        that has not started yet (``CANCELLED``); the engine goes on taking
        and running jobs.
    """

    def __init__(
        self, stores: Sequence[DiskStore], rows: Sequence[HostRows], threads: int = 4
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        for r, s in zip(rows, stores, strict=True):
            if r.block_bytes != s.block_bytes:
                raise ValueError(
                    f"CPU buffer rows are {r.block_bytes} B but disk blocks are "
                    f"{s.block_bytes} B"
                )
        self.rows, self.stores = list(rows), list(stores)
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()  # FIFO among equal priorities
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # submitted, not finished yet
        self._finished: list[_Job] = []  # finished, not returned yet
        self._closed = False
        # Bumped by cancel_queued: a task submitted under an older epoch
        # that has not started yet moves nothing.
        self._epoch = 0
        self._guard = RowGuard()
        self._warned: set[int] = set()
        self._threads = [
            threading.Thread(target=self._worker, name=f"kvtier-xfer-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # -- plumbing -------------------------------------------------------------

    def _worker(self) -> None:
        name_this_thread()
        while True:
            _, _, task = self._queue.get()
            if task is None:
                return
            try:
                task()
            except BaseException:  # tasks handle their own errors; belt and braces
                logger.exception("kvtier transfer task crashed")

    def _enqueue(self, priority: int, task: Callable[[], None]) -> None:
        self._queue.put((priority, next(self._order), task))

    def _begin(self, job_id: int, keys: list[bytes], count: int, spill: bool) -> _Job:
        with self._cond:
            if self._closed:
                raise RuntimeError("TransferEngine is shut down")
            if job_id in self._jobs:
                raise ValueError(f"job {job_id} is already pending")
            job = self._jobs[job_id] = _Job(job_id, keys, count, spill)
        return job

    def _finish(self, job: _Job) -> None:
        job.final = job.result()
        with self._cond:
            if self._jobs.pop(job.job_id, None) is job:  # else given up
                self._finished.append(job)
            self._cond.notify_all()

    def _rows_of(self, rank: int) -> np.ndarray | None:
        """Rank ``rank``'s rows, or None (logged once) where they cannot be
        mapped: its items fail as I/O failures, a miss, not a crash."""
        try:
            return self.rows[rank].array
        except Exception as exc:
            if rank not in self._warned:
                self._warned.add(rank)
                logger.warning(
                    "kvtier disk tier: cannot map the CPU tier of rank %d (%s); "
                    "its transfers fail (recomputed), the engine keeps running",
                    rank,
                    exc,
                )
            return None

    # -- public API -----------------------------------------------------------

    def submit_spill(
        self,
        job_id: int,
        items: Iterable[TransferItem | tuple],
        first_seqs: Sequence[int] | None = None,
    ) -> None:
        """Copy CPU rows to disk slots: ``items`` are (key, cpu_slot, disk_slot).
        Rank ``r`` writes item ``i`` with seq ``first_seqs[r] + i`` (reserved
        by the caller's store, :meth:`DiskStore.reserve_seqs`), or, without
        ``first_seqs``, with its own store's next ones.

        Each rank's items go out in batches (``DiskStore.write_blocks``) of
        at most ``ceil(items / threads)`` blocks each, so about as many as
        there are threads (fewer when there are fewer items than threads,
        more when such a batch would exceed the store's ``batch_capacity``,
        which then bounds each): a thread stages and writes a batch with a
        few hand-offs of the interpreter lock, not ten per block, which is
        what a spill gets next to an engine loop that holds the lock
        (docs/benchmarks.md, "Spills next to a busy loop")."""
        self._fan_out(job_id, list(items), spill=True, first_seqs=first_seqs)

    def submit_promote(self, job_id: int, items: Iterable[TransferItem | tuple]) -> None:
        """Load disk slots into CPU rows: ``items`` are (key, disk_slot, cpu_slot),
        one block per task (the tiering mode's disk tier: vLLM asks for its
        blocks one at a time)."""
        self._fan_out(job_id, list(items), spill=False)

    def _spill_batch(
        self,
        store: DiskStore,
        rows: np.ndarray,
        batch: list[Any],
        seqs: Sequence[int] | None = None,
    ) -> list[int | None]:
        """Write one batch of (key, cpu_slot, disk_slot), with ``seqs`` if
        given; per item the bytes written or None (failed). The rows are
        read only between the guard's ``enter`` and the batch being staged."""
        guard = self._guard
        if not guard.enter():
            return [None] * len(batch)  # abandoned: the rows may be others' now
        held = [True]

        def leave() -> None:
            if held[0]:
                held[0] = False
                guard.leave()

        def staged() -> None:  # the rows are in the batch area now
            leave()
            if guard.overrun:
                # abandon() stopped waiting for this copy: the rows may have
                # been reused under it, so the staged bytes may mix blocks.
                # Never write them under these keys.
                raise _StagedTooLate

        try:
            written = store.write_blocks(
                [dst for _, _, dst in batch],
                [key for key, _, _ in batch],
                rows,
                [src for _, src, _ in batch],
                on_staged=staged,
                seqs=seqs,
            )
            return [store.block_bytes if ok else None for ok in written]
        except _StagedTooLate:
            return [None] * len(batch)
        finally:
            leave()

    def _promote_one(
        self, store: DiskStore, rows: np.ndarray, key: bytes, disk_slot: int, cpu_slot: int
    ) -> int | None:
        guard = self._guard
        if guard.closed:
            return IO_FAILED
        outcome = store.read_block(disk_slot, key, rows[cpu_slot], guard=guard)
        if guard.closed:
            return IO_FAILED  # abandoned meanwhile: no bookkeeping either
        if outcome is ReadOutcome.OK:
            return store.block_bytes
        logger.debug("promote of slot %d failed: %s", disk_slot, outcome.name)
        if outcome is ReadOutcome.IO_ERROR:
            return IO_FAILED
        if outcome in _CORRUPT:
            # Erase the bad header while the job still owns the slot. A key
            # or fingerprint mismatch is someone else's intact block: left.
            with contextlib.suppress(OSError):
                store.invalidate(disk_slot)
        return None

    def _promote_batch(
        self,
        store: DiskStore,
        rows: np.ndarray,
        batch: list[Any],
        seqs: Sequence[int] | None = None,
    ) -> list[int | None]:
        return [self._promote_one(store, rows, *item) for item in batch]

    def _fan_out(
        self,
        job_id: int,
        items: list[Any],
        spill: bool,
        first_seqs: Sequence[int] | None = None,
    ) -> None:
        """Each rank's items as tasks on the pool: a spill's in batches (see
        :meth:`submit_spill`), a promotion's one block each. A task that
        raises fails its items as never moved (logged), never a thread."""
        keys = list(dict.fromkeys(item[0] for item in items))
        job = self._begin(job_id, keys, len(items) * len(self.stores), spill)
        if not items or not self.stores:
            self._finish(job)
            return
        move = self._spill_batch if spill else self._promote_batch
        priority = SPILL_PRIORITY if spill else PROMOTE_PRIORITY
        epoch = self._epoch
        for rank, store in enumerate(self.stores):
            rows = self._rows_of(rank)
            if rows is None:
                for key, _, _ in items:
                    if job.item_done(key, IO_FAILED):
                        self._finish(job)
                continue
            per = 1
            if spill:
                per = min(store.batch_capacity(), -(-len(items) // len(self._threads)))
            for first in range(0, len(items), per):
                batch = items[first : first + per]
                seqs = None
                if first_seqs is not None:
                    seq0 = first_seqs[rank] + first
                    seqs = range(seq0, seq0 + len(batch))

                def task(
                    store: DiskStore = store,
                    rows: np.ndarray = rows,
                    batch: list = batch,
                    seqs: Sequence[int] | None = seqs,
                ) -> None:
                    try:
                        if self._epoch != epoch:
                            moved = [CANCELLED] * len(batch)  # cancel_queued
                        else:
                            moved = move(store, rows, batch, seqs)
                    except Exception:
                        logger.exception(
                            "kvtier transfer of %d block(s) in job %d failed",
                            len(batch),
                            job_id,
                        )
                        moved = [IO_FAILED] * len(batch)  # nothing showed them bad
                    for (key, _, _), nbytes in zip(batch, moved, strict=True):
                        if job.item_done(key, nbytes):
                            self._finish(job)

                self._enqueue(priority, task)

    def cancel_queued(self) -> None:
        """Fail every item submitted so far that has not started yet, without
        I/O (``CANCELLED``: in ``lost_keys``, ``io_failed_keys`` and
        ``cancelled_keys``). Items already moving finish as they would, so
        a ``wait`` after this lasts as long as the batches in progress, not
        the queue. For a caller that is about to forget every block (a
        connector reset): what is queued would write the drive, or rows,
        for nothing. Never blocks; the engine keeps taking jobs."""
        with self._cond:
            self._epoch += 1

    def get_finished(self, timeout: float = 0.0) -> list[FinishedJob]:
        """Results of jobs finished since the last call (drains them),
        waiting up to ``timeout`` seconds for one."""
        with self._cond:
            if timeout > 0:
                self._cond.wait_for(lambda: self._finished, timeout)
            done, self._finished = self._finished, []
        return [job.final for job in done]

    def wait(
        self, job_ids: Iterable[int] | None = None, timeout: float | None = None
    ) -> bool:
        """Block until none of ``job_ids`` (None: of the jobs) is pending;
        False on timeout. Does not consume results; ids never submitted count
        as finished."""
        ids = None if job_ids is None else set(job_ids)
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._jobs.keys() if ids is None else ids & self._jobs.keys()),
                timeout,
            )

    def pending(self) -> int:
        """Number of submitted jobs not finished yet."""
        with self._cond:
            return len(self._jobs)

    def give_up(self) -> list[FinishedJob]:
        """``abandon``, then every job not returned yet, failed whole (all
        its keys, as I/O failures, every result it had dropped): none of them
        is reported again, whatever its I/O does later."""
        self.abandon()
        with self._cond:
            held = [*self._finished, *self._jobs.values()]
            self._finished, self._jobs = [], {}
        return [job.given_up() for job in held]

    def abandon(self, timeout: float | None = 5.0) -> bool:
        """Stop touching rows for good (a drain or shutdown timed out).

        Items not started yet fail without I/O; items blocked in a disk read
        or write finish later without writing any row (a spill batch blocked
        in one write still writes its other runs of slots then, from the
        bytes it staged before). Returns True once no
        row copy is in progress (copies are memory-bound, so this is quick);
        False only if one is still running after ``timeout``."""
        return self._guard.close(timeout)

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Finish queued work, then stop the threads; idempotent.

        Waits at most ``timeout`` seconds in all (None: forever). Threads
        still busy then (a hung disk) are abandoned: they are daemon threads
        and never touch a row again (``abandon``). Returns True when every
        thread stopped; on False the caller must keep the rows mapped and
        the stores' descriptors open, since a blocked thread still uses them."""
        with self._cond:
            first = not self._closed
            self._closed = True
        if first:
            for _ in self._threads:
                self._queue.put((_STOP_PRIORITY, next(self._order), None))
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            return True
        self.abandon()
        # Queued items now fail fast; threads blocked in I/O stay blocked.
        for t in self._threads:
            t.join(0.5)
        alive = [t.name for t in self._threads if t.is_alive()]
        if not alive:
            return True
        logger.warning(
            "kvtier: %d disk I/O thread(s) still blocked after %.0f s (a hung "
            "disk?); shutting down without them (they will never touch the CPU "
            "tier again)",
            len(alive),
            timeout or 0.0,
        )
        return False
