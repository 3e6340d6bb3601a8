"""Asynchronous execution of transfer jobs between the CPU buffer and disk.

The scheduler-side connector turns its decisions into jobs (spill: CPU rows ->
disk slots; promote: disk slots -> CPU rows). Jobs must never block the model
step, so ``submit*`` only enqueue, and the connector polls ``get_finished``.

A job's items are fanned out individually onto the worker threads so one big
job keeps every thread (and the disk queue) busy. Promotes are latency
critical (a request is waiting for them) while spills run
ahead of need, so the queue is a priority queue and promote items run first.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.host.cpu_buffer import CpuBlockBuffer
from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.store.slot import ReadOutcome
from kvtier.store.store import DiskStore

logger = get_logger("store")

# Read outcomes that mean the slot's own bytes are damaged.
_CORRUPT = frozenset(
    {ReadOutcome.CHECKSUM_MISMATCH, ReadOutcome.BAD_HEADER, ReadOutcome.TRUNCATED}
)

PROMOTE_PRIORITY = 0
SPILL_PRIORITY = 1
_STOP_PRIORITY = 1 << 30  # sorts after every real task: shutdown drains first

# (key, cpu_slot, disk_slot) for spills, (key, disk_slot, cpu_slot) for promotes.
TransferItem = tuple[bytes, int, int]

# What moving one item returns when it failed with an I/O error (or was
# never done: an abandoned engine, an exception) rather than on bytes shown
# bad: the block's copy is not suspect (``JobResult.io_failed_keys``).
IO_FAILED = -1


@dataclass(frozen=True)
class JobOutcome:
    """What a job function reports: overall success, bytes moved, failed keys."""

    success: bool
    bytes: int = 0
    failed_keys: list[bytes] = field(default_factory=list)
    io_failed_keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class JobResult:
    """A finished job.

    ``bytes`` counts logical block bytes moved by the successful items (not
    on-disk bytes, which DiskStore.stats reports), ``seconds`` runs from
    submission to completion (so it includes queueing), and ``failed_keys``
    lists the keys whose transfer did not happen; ``success`` is False iff
    anything failed. ``io_failed_keys`` (of ``failed_keys``) failed with an
    I/O error or were never moved, not on bytes shown bad: a promotion's
    slot may be read again.
    """

    job_id: int
    success: bool
    bytes: int
    seconds: float
    failed_keys: list[bytes]
    io_failed_keys: list[bytes] = field(default_factory=list)


class _FanOut:
    """Aggregates the per-item results of one spill/promote job."""

    def __init__(self, job_id: int, count: int, started: float) -> None:
        self.job_id = job_id
        self.remaining = count
        self.started = started
        self.bytes = 0
        self.failed: list[bytes] = []
        self.io_failed: list[bytes] = []
        self.lock = threading.Lock()

    def item_done(self, key: bytes, nbytes: int | None) -> bool:
        """Record one item (bytes moved; None: failed on bad bytes;
        ``IO_FAILED``); True when it was the last."""
        with self.lock:
            if nbytes is None or nbytes == IO_FAILED:
                self.failed.append(key)
                if nbytes == IO_FAILED:
                    self.io_failed.append(key)
            else:
                self.bytes += nbytes
            self.remaining -= 1
            return self.remaining == 0


class _StagedTooLate(Exception):
    """A spill's row copy outlasted ``abandon()``: its block is not written."""


class RowGuard:
    """Fences every touch of CPU rows by transfer threads.

    A thread calls ``enter()`` before it reads or writes a row and
    ``leave()`` right after; ``close()`` makes every later ``enter()`` fail
    and waits for the touches in progress, which are memory copies and never
    wait for a disk. After a successful ``close()`` no thread of the engine
    touches a CPU row again, even one that is still blocked in a read or
    write of a hung disk, so the caller may hand the rows to someone else."""

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
    """Runs transfer jobs on ``threads`` worker threads.

    Contract:
      - ``submit``/``submit_spill``/``submit_promote`` return immediately.
        A ``job_id`` must not be reused while that job is pending.
      - Every submitted job produces exactly one JobResult, returned once by
        ``get_finished`` (which drains); a job function that raises yields a
        failed result, it never kills a worker.
      - For promote, a key whose read is not OK is in ``failed_keys`` and its
        CPU row was not written (DiskStore.read_block guarantees it), so the
        caller must not mark that row valid. It is in ``io_failed_keys`` too
        when the read failed with an I/O error (IO_ERROR: any errno, or a
        short read of a full-size slab) or was never done; its slot is then
        left as it is. A slot whose bytes failed verification (a bad
        header or checksum, a truncated slab) is invalidated.
      - CPU rows and disk slots named by a job belong to it until its
        JobResult is returned: the caller must not reuse them before that.
      - ``shutdown`` runs all queued work to completion, then stops the
        threads, waiting at most ``timeout``; threads still busy then (a hung
        disk) are abandoned (see ``abandon``) and it returns False. The
        buffer and store are borrowed, not closed.
      - ``abandon`` stops all row access for good: queued items fail without
        I/O, and once it returned True no thread touches a CPU row again,
        even one still blocked in a disk read or write.
    """

    def __init__(
        self, cpu_buffer: CpuBlockBuffer, disk_store: DiskStore, threads: int = 4
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if cpu_buffer.block_bytes != disk_store.block_bytes:
            raise ValueError(
                f"CPU buffer rows are {cpu_buffer.block_bytes} B but disk blocks are "
                f"{disk_store.block_bytes} B"
            )
        self.cpu_buffer = cpu_buffer
        self.disk_store = disk_store
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()  # FIFO among equal priorities
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._finished: list[JobResult] = []
        self._closed = False
        self._guard = RowGuard()
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

    def _begin(self, job_id: int) -> float:
        with self._cond:
            if self._closed:
                raise RuntimeError("TransferEngine is shut down")
            if job_id in self._pending:
                raise ValueError(f"job {job_id} is already pending")
            self._pending.add(job_id)
        return time.perf_counter()

    def _finish(self, job_id: int, started: float, outcome: JobOutcome) -> None:
        result = JobResult(
            job_id=job_id,
            success=outcome.success and not outcome.failed_keys,
            bytes=outcome.bytes,
            seconds=time.perf_counter() - started,
            failed_keys=list(outcome.failed_keys),
            io_failed_keys=list(outcome.io_failed_keys),
        )
        with self._cond:
            self._pending.discard(job_id)
            self._finished.append(result)
            self._cond.notify_all()

    # -- public API -----------------------------------------------------------

    def submit(
        self,
        job_id: int,
        fn: Callable[[], JobOutcome],
        *,
        priority: int = SPILL_PRIORITY,
    ) -> None:
        """Run ``fn`` on a worker thread; its JobOutcome becomes the JobResult."""
        started = self._begin(job_id)

        def task() -> None:
            try:
                outcome = fn()
            except Exception:
                logger.exception("kvtier transfer job %d failed", job_id)
                outcome = JobOutcome(success=False)
            self._finish(job_id, started, outcome)

        self._enqueue(priority, task)

    def submit_spill(self, job_id: int, items: Iterable[TransferItem]) -> None:
        """Copy CPU rows to disk slots: ``items`` are (key, cpu_slot, disk_slot)."""
        store, rows, guard = self.disk_store, self.cpu_buffer.array, self._guard

        def spill_one(key: bytes, cpu_slot: int, disk_slot: int) -> int | None:
            if not guard.enter():
                return None  # abandoned: the row may belong to someone else
            held = [True]

            def leave() -> None:
                if held[0]:
                    held[0] = False
                    guard.leave()

            def staged() -> None:  # the row is in the bounce buffer now
                leave()
                if guard.overrun:
                    # abandon() stopped waiting for this copy: the row may
                    # have been reused under it, so the staged bytes may mix
                    # two blocks. Never write them under this key.
                    raise _StagedTooLate

            try:
                store.write_block(
                    disk_slot, key, rows[cpu_slot], store.next_seq(), on_staged=staged
                )
            except OSError:
                return None  # the store already logged errno and path
            except _StagedTooLate:
                return None
            finally:
                leave()
            return store.block_bytes

        self._fan_out(job_id, list(items), spill_one, SPILL_PRIORITY)

    def submit_promote(self, job_id: int, items: Iterable[TransferItem]) -> None:
        """Load disk slots into CPU rows: ``items`` are (key, disk_slot, cpu_slot)."""
        store, rows, guard = self.disk_store, self.cpu_buffer.array, self._guard

        def promote_one(key: bytes, disk_slot: int, cpu_slot: int) -> int | None:
            if guard.closed:
                return IO_FAILED
            outcome = store.read_block(disk_slot, key, rows[cpu_slot], guard=guard)
            if guard.closed:
                return IO_FAILED  # abandoned meanwhile: no bookkeeping either
            if outcome is ReadOutcome.IO_ERROR:
                logger.debug("promote of slot %d failed: I/O error", disk_slot)
                return IO_FAILED
            if outcome is not ReadOutcome.OK:
                logger.debug("promote of slot %d failed: %s", disk_slot, outcome.name)
                if outcome in _CORRUPT:
                    # Erase the bad header while the job still owns the slot,
                    # so a restart never adopts it again. A key or
                    # fingerprint mismatch is someone else's intact block:
                    # left alone.
                    with contextlib.suppress(OSError):
                        store.invalidate(disk_slot)
                return None
            return store.block_bytes

        self._fan_out(job_id, list(items), promote_one, PROMOTE_PRIORITY)

    def _fan_out(
        self,
        job_id: int,
        items: list[TransferItem],
        move: Callable[[bytes, int, int], int | None],
        priority: int,
    ) -> None:
        started = self._begin(job_id)
        if not items:
            self._finish(job_id, started, JobOutcome(success=True))
            return
        job = _FanOut(job_id, len(items), started)

        def finish() -> None:
            self._finish(
                job_id,
                started,
                JobOutcome(not job.failed, job.bytes, job.failed, job.io_failed),
            )

        for key, src, dst in items:

            def task(key: bytes = key, src: int = src, dst: int = dst) -> None:
                try:
                    nbytes = move(key, src, dst)
                except Exception:
                    logger.exception(
                        "kvtier transfer of one block in job %d failed", job_id
                    )
                    nbytes = IO_FAILED  # nothing showed its bytes bad
                if job.item_done(key, nbytes):
                    finish()

            self._enqueue(priority, task)

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (drains them)."""
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is pending; False on timeout.

        Does not consume results (``get_finished`` still returns them). Ids
        that were never submitted count as finished.
        """
        ids = set(job_ids)
        with self._cond:
            return self._cond.wait_for(lambda: not (ids & self._pending), timeout)

    def pending(self) -> int:
        """Number of submitted jobs not finished yet."""
        with self._cond:
            return len(self._pending)

    def abandon(self, timeout: float | None = 5.0) -> bool:
        """Stop touching CPU rows for good (a drain or shutdown timed out).

        Items not started yet fail without I/O; items blocked in a disk read
        or write finish later without writing any row. Returns True once no
        row copy is in progress (copies are memory-bound, so this is quick);
        False only if one is still running after ``timeout``."""
        return self._guard.close(timeout)

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Finish queued work, then stop the worker threads; idempotent.

        Waits at most ``timeout`` seconds in all (None: forever). Threads
        still busy then (a hung disk) are abandoned: they are daemon threads
        and never touch a CPU row again (``abandon``). Returns True when every
        thread stopped; on False the caller must keep the buffer mapped and
        the store's descriptors open, since a blocked thread still uses them."""
        with self._cond:
            first = not self._closed
            self._closed = True
        if first:
            for _ in self._threads:
                self._queue.put((_STOP_PRIORITY, next(self._order), None))
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if not alive:
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
