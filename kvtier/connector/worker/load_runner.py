"""The worker's load thread: the part of a load that takes time, off the
model runner's thread.

vLLM calls ``submit_load`` on the model runner's thread, between engine
steps; every running request waits for what it does there (vLLM 0.33:
"Submission itself must still not block"). The worker only plans a load
there and hands its :class:`~kvtier.connector.worker.load_task.LoadTask` to
this thread, which reads the disk slots batch by batch into the reader's
bounce area, pipelined over the area's parts (later batches are read while
batch k is verified and copied), verifies every slot, copies a verified
block with a promotion row into that CPU row, and copies the batch into the
KV cache: itself on the CPU platform (CPU-tier rows too), on accelerators
by issuing its transfers on vLLM's handlers from a stream of its own that
follows the model's stream as it was at ``submit_load`` (the task's
``after``). A part is read into again, and a task goes back, only once the
transfers reading it landed: the model runner's thread only collects
finished tasks (issuing the transfers there had cost 45-57 ms per loaded
GiB on an H200: docs/benchmarks.md, "GPU").

Why one thread and whole batches: an in-process engine's loop spins without
sleeping, so a background thread gets the GIL back only at the
interpreter's switch interval (5 ms) each time it blocks. Work handed over
per batch and per job, never per block, keeps that cost per batch.

Several jobs are in flight at once: the thread works in units (one read
batch, or one batch of CPU-row copies) and takes turns between the jobs it
holds, so a CPU-tier hit or a short prefix never waits for a long prefix to
come off disk; expedited loads (vLLM 0.33's synchronous loads, waited on
within the step) take the next unit. A read that does not return within
``LoadRunner.stall_s`` costs its blocks (reported failed, as I/O errors:
their disk copies stay) and, until it returns, its bounce part; with every
part held so, disk blocks fail at once, unread (a recompute), while CPU-row
copies go on.

Finished tasks travel back through :meth:`LoadRunner.take`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from kvtier.connector.metrics import Samples
from kvtier.connector.worker.bounce_parts import BounceParts, bounce_parts
from kvtier.connector.worker.job_errors import UNREAD
from kvtier.connector.worker.job_plan import select_rows
from kvtier.connector.worker.load_task import LoadTask, ReadBatch
from kvtier.host.block_copy import CopyPath, CopyPlan
from kvtier.host.placement import name_this_thread, place_background_thread
from kvtier.log import get_logger
from kvtier.store.reader import SlotReads
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK

logger = get_logger("connector")

# How much lower the load thread's CPU priority is than the thread that
# started it (Linux nice levels; raising one's own is always permitted).
# When the cores are busy, the engine's step (and, under ``vllm serve``, the
# API server process) wins them and the load takes the slack: measured on a
# 2-core host, multiprocess engine, the longest decode step while a 256 MiB
# prefix loaded from disk went from 60 ms to 22 ms (decode step 9 ms),
# while the load took 20 % longer (docs/benchmarks.md, "Step stalls").
LOAD_THREAD_NICE = 10
# A read batch not back after this many seconds is given up (see the module
# doc): a hung read (a dying drive's retries, a hard-mounted network file
# system) costs its own blocks, not every load after it. A healthy drive
# reads a batch (tens of MiB) in well under a second.
READ_STALL_S = 15.0
# How long the thread blocks at a time on a read or on an idle queue before
# it looks again at stalls, cancellations and new work.
POLL_S = 0.05
# About how many bytes of CPU-row copies make one unit of work: the thread
# takes turns between jobs per unit, so a long CPU-tier hit never holds up
# a short one for long, while a copy still moves tens of MiB per call.
HOST_UNIT_BYTES = 32 << 20


class LoadRunner:
    """The worker-owned load thread (see the module doc).

    Contract:
      - :meth:`submit` queues a task and returns at once; the thread starts
        on the first task, or earlier with :meth:`warm_up`.
      - :meth:`take` returns, without blocking, the tasks finished since
        the last call. Every submitted task comes back exactly once, also
        when it raised, was cancelled or its reads stalled, unless the
        runner was stopped first; never while a copy it issued is in flight.
      - The thread never reads into a bounce part while a copy reads it.
      - :meth:`cancel` returns once the thread issues nothing more for the
        task (a copy under way finishes first; one in flight on the device
        lands before the task comes back).
      - :meth:`stop` ends the thread within a deadline; reads in flight are
        waited for. It returns False if the thread did not stop in time (a
        read that never returns): then the host areas must stay mapped.
      - ``submit``, ``take``, ``cancel`` and ``stop`` are called from the
        worker's thread; everything else runs on the load thread, which
        alone calls ``copies`` (an asynchronous path is the load thread's
        own, see :class:`~kvtier.host.block_copy.CopyPath`).
    """

    def __init__(
        self,
        reader: SlotReads | None,
        copies: CopyPath,
        cpu_buffer: Any,
        block_bytes: list[int],
    ) -> None:
        self.reader = reader
        self.copies = copies
        # Read through ``.array`` at each use: a view kept here would stop
        # the buffer from unmapping at shutdown.
        self.cpu_buffer = cpu_buffer
        self.block_bytes = block_bytes
        self.stall_s = READ_STALL_S
        self._cond = threading.Condition()
        self._queue: deque[LoadTask] = deque()
        self._out: deque[LoadTask] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # The load thread's own state.
        self._urgent: deque[LoadTask] = deque()  # expedited, first come first
        self._tasks: deque[LoadTask] = deque()  # the others, taking turns
        self._inflight: deque[ReadBatch] = deque()
        self._bounce = BounceParts()  # and the transfers in flight
        # Seconds from issuing each read batch to having it verified, for
        # the worker's report (added here, taken on the worker's thread).
        self.read_latencies = Samples()

    @property
    def _in_use(self) -> int:
        """Bounce parts the reads take turns in."""
        return self._layout[0]

    @property
    def _per_read(self) -> int:
        """Blocks per read batch (one bounce part)."""
        return self._layout[1]

    @property
    def _layout(self) -> tuple[int, int]:
        reader = self.reader
        if reader is None:
            return 1, 1
        return bounce_parts(reader.capacity, reader.slot_size)

    @property
    def _per_host_unit(self) -> int:
        """Blocks per unit of CPU-row copies."""
        return max(1, HOST_UNIT_BYTES // max([1, *self.block_bytes]))

    # ------------------------------------------------- worker's thread side

    def submit(self, task: LoadTask) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("kvtier load thread is stopped")
            self._queue.append(task)
            if self._thread is None:
                self._start_thread()
            self._cond.notify_all()

    def warm_up(self) -> None:
        """Start the thread ahead of the first load; it opens the reader's
        slab files first (the first open probes O_DIRECT, tens of ms: run
        during the first disk hit, it stretched a decoding step to 45 ms).
        A file not created yet is opened at its first read."""
        with self._cond:
            if self._thread is None and not self._stopping:
                self._start_thread()

    def take(self) -> list[LoadTask]:
        if not self._out:
            return []  # the common case, every engine step
        out: list[LoadTask] = []
        while self._out:
            out.append(self._out.popleft())
        return out

    def wait_output(self, timeout: float) -> None:
        """Block until something can be taken, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._out), timeout)

    def cancel(self, task: LoadTask) -> None:
        with task.lock:
            task.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float) -> bool:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # ------------------------------------------------------ the load thread

    def _start_thread(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvtier-load", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        name_this_thread()  # its Python name, kvtier-load
        place_background_thread(LOAD_THREAD_NICE)
        try:
            device = getattr(self.copies, "device", None)
            if device is not None and device.type == "cuda":
                # Copies (and a device staging reader's checks) are queued
                # after this thread's current stream: its own, never the
                # legacy default stream that would serialise with the
                # model's work. Each task's copies follow its ``after`` mark.
                torch.cuda.set_stream(torch.cuda.Stream(device))
            if self.reader is not None:
                start = getattr(self.reader, "start", None)
                if start is not None:
                    start()  # a read process (kvtier.store.read_process)
                self.reader.files.open_all()
            while self._turn():
                pass
        except BaseException as exc:
            # A bug outside any one task: every task held or still to come
            # fails whole (a recompute) rather than waiting for a thread that
            # is gone.
            logger.exception("kvtier: the load thread failed; loads are recomputed")
            self._fail_all(exc)
        finally:
            for batch in [*self._inflight, *self._bounce.stuck]:
                self._bounce.abandon(self.reader, batch)

    def _turn(self) -> bool:
        """One unit of work (or a bounded wait for one); False once stopping."""
        with self._cond:
            while self._queue:
                self._hold(self._queue.popleft())
            if self._stopping:
                return False
        if self.reader is not None:
            self._bounce.reap(self.reader)
        self._land()
        task = self._pick()
        if task is not None:
            self._unit(task)
        elif self._inflight and self._finish_ready():
            pass
        elif not self._bounce.idle():
            # A batch's copies take about a millisecond: wait for the oldest
            # transfer (on its event) rather than poll.
            self.copies.wait({self._bounce.oldest()})
            self._land()
        elif self._inflight:
            self._wait_oldest()
        else:
            with self._cond:
                if not self._queue and not self._stopping:
                    busy = self._urgent or self._tasks or self._bounce.stuck
                    self._cond.wait(POLL_S if busy else None)
        return True

    def _hold(self, task: LoadTask) -> None:
        """Take a submitted task in, its work cut into units."""
        task.cut(self._per_host_unit)
        (self._urgent if task.expedited else self._tasks).append(task)

    def _pick(self) -> LoadTask | None:
        """The task whose unit runs next: the oldest expedited task that can
        run one, else the next of the others in turn. Tasks that are done
        (or cancelled) leave here, returned to the worker."""
        for queue in (self._urgent, self._tasks):
            for _ in range(len(queue)):
                task = queue.popleft()
                if not self._bounce.copying(task) and (
                    task.cancelled or (not task.has_work() and not task.batches)
                ):
                    self._done(task)
                    continue
                if self._runnable(task):
                    if queue is self._urgent:
                        queue.appendleft(task)
                    else:
                        queue.append(task)  # its turn is used
                    return task
                queue.append(task)
        return None

    def _runnable(self, task: LoadTask) -> bool:
        if task.cancelled:
            return False  # waits for its copies in flight, then leaves
        if task.host_left:
            return True
        if task.disk_left is None or not len(task.disk_left):
            return False
        if len(self._bounce.stuck) >= self._in_use:
            return True  # every part held by a hung read: fails at once
        return self._bounce.any_free(self._in_use)

    def _unit(self, task: LoadTask) -> None:
        """Run one unit of ``task``; an exception fails the task whole."""
        if task.started is None:
            task.started = time.perf_counter()
        try:
            if task.host_left:
                group, plan = task.host_left.popleft()
                with task.lock:
                    if task.cancelled:
                        return
                    self._copy(task, MEDIUM_CPU, group, plan, None)
            else:
                self._start_batch(task)
        except BaseException as exc:
            self._fail(task, exc)

    def _start_batch(self, task: LoadTask) -> None:
        assert task.spec is not None and task.failed is not None
        assert task.disk_left is not None
        batch, task.disk_left = (
            task.disk_left[: self._per_read],
            task.disk_left[self._per_read :],
        )
        if len(self._bounce.stuck) >= self._in_use:
            task.failed[batch] = UNREAD  # no part left to read into
            return
        reader = self.reader
        assert reader is not None
        part = self._bounce.take(self._in_use)
        try:
            spec = task.spec
            read = reader.submit(
                [(int(spec.block_ids[p]), spec.keys[p]) for p in batch],
                first_row=part * self._per_read,
            )
        except BaseException:
            self._bounce.release(part)
            raise
        task.batches += 1
        self._inflight.append(ReadBatch(task, read, batch, part, time.monotonic()))

    def _finish_ready(self) -> bool:
        """Finish a batch whose reads returned (the oldest first), if any."""
        reader = self.reader
        assert reader is not None
        for batch in self._inflight:
            if reader.ready(batch.read):
                self._inflight.remove(batch)
                self._finish(batch)
                return True
        return False

    def _wait_oldest(self) -> None:
        """No read returned (:meth:`_finish_ready` found none): wait a
        little for the oldest, giving it up once it stalled or its task was
        cancelled."""
        reader = self.reader
        assert reader is not None
        oldest = self._inflight[0]
        if oldest.task.cancelled or time.monotonic() - oldest.since > self.stall_s:
            self._inflight.popleft()
            self._bounce.give_up(oldest, self._in_use)
            return
        reader.wait(oldest.read, POLL_S)

    def _finish(self, batch: ReadBatch) -> None:
        """Verify a batch whose reads returned, copy its promotions, and copy
        it into the KV cache (or issue those copies); an exception fails its
        task whole. The part goes back once no copy reads it."""
        reader, task, part = self.reader, batch.task, batch.part
        assert reader is not None and task.spec is not None
        task.batches -= 1
        try:
            bounce_row = task.delivered(batch.positions, reader.complete(batch.read))
            self.read_latencies.add(time.monotonic() - batch.since)
            with task.lock:
                if task.cancelled:
                    return
                task.promote(bounce_row, reader.rows, self.cpu_buffer)
                for gp in task.groups:
                    rows = bounce_row[gp.plan.row_ids]
                    mask = rows >= 0
                    if mask.any():
                        plan = select_rows(gp.plan, mask, rows[mask])
                        self._copy(task, MEDIUM_DISK, gp.group, plan, part)
        except BaseException as exc:
            self._fail(task, exc)
        finally:
            if not self._bounce.read_by_copies(part):
                self._bounce.release(part)

    def _copy(
        self, task: LoadTask, area: str, group: int, plan: CopyPlan, part: int | None
    ) -> None:
        """Copy ``plan`` into the KV cache for ``task`` (or issue the copy:
        the transfer is tracked until it lands, with the bounce ``part`` it
        reads)."""
        if task.after is not None:
            self.copies.follow(task.after)
            task.after = None
        transfer = self.copies.submit(area, group, plan, False, task.expedited)
        task.nbytes += len(plan) * self.block_bytes[group]
        if transfer is not None:
            self._bounce.issued(transfer, task, part)

    def _land(self) -> None:
        """Note the transfers that landed: their tasks may finish, their
        parts be read into again."""
        if not self._bounce.idle():
            self._bounce.landed(self.copies.poll())

    def _fail(self, task: LoadTask, exc: BaseException) -> None:
        """``task`` raised: it fails whole; its other batches are dropped."""
        task.error = exc
        for batch in [b for b in self._inflight if b.task is task]:
            self._inflight.remove(batch)
            task.batches -= 1
            if self.reader is not None and self.reader.ready(batch.read):
                self._bounce.abandon(self.reader, batch)
            else:  # never wait here for a read that may not return
                self._bounce.set_aside(batch)
        task.host_left.clear()
        task.disk_left = None

    def _fail_all(self, exc: BaseException) -> None:
        """The thread is going away: every task it holds or is handed fails
        whole, now and from now on."""
        with self._cond:
            self._stopping = True
            held = [*self._urgent, *self._tasks, *self._queue]
            self._urgent.clear()
            self._tasks.clear()
            self._queue.clear()
        try:
            # No task goes back while its copies may still write its blocks.
            self.copies.wait(set(self._bounce.in_flight()))
        except Exception:
            logger.exception("kvtier: waiting for the load thread's copies failed")
        for task in held:
            task.error = exc
            self._done(task)

    def _done(self, task: LoadTask) -> None:
        """Return ``task`` to the worker (once)."""
        if task.started is not None:
            task.seconds += time.perf_counter() - task.started
        with self._cond:
            self._out.append(task)
            self._cond.notify_all()
