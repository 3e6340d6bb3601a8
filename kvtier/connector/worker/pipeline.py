"""The worker's load pipeline: the slow part of every load, on one thread
of its own.

``submit_load`` runs on the model runner's thread, between engine steps,
and must not block: the worker only plans a load there and hands its
:class:`LoadTask` to the pipeline's thread, which reads the disk slots batch
by batch into the reader's bounce area, verifies every slot, copies a
verified block with a promotion row into that CPU row, and copies the batch
into the KV cache: itself on the CPU platform (CPU-tier rows too), on
accelerators by issuing transfers on vLLM's handlers from a stream of its
own that follows the model's stream as it was at ``submit_load`` (the
task's ``after``).

The bounce area is a ring of parts (:class:`BounceRing`), one read batch
each, so later batches are read while one is verified and copied. The
thread is fed like vLLM's ``DualQueueThreadPool``: expedited tasks (vLLM
0.33's synchronous loads, waited on within the step) first, the others
taking turns, one unit (a read batch, or a run of CPU-row copies) per turn,
so a CPU-tier hit or a short prefix never waits for a long prefix to come
off disk. One thread and whole batches, because an
in-process engine's loop spins without sleeping: a background thread gets
the interpreter lock back only at the switch interval each time it blocks,
so work is handed over per batch and per task, never per block.

One deadline per batch (``deadline_s``, from when the thread starts it): a
batch whose reads have not returned by then is given up, its blocks fail as
I/O errors (their disk copies stay) and its part is STUCK until the reads
return; with every part stuck, disk blocks fail at once, unread, while
CPU-row copies go on. A thread stuck in one step (an open or a transfer
that does not return) is the worker's to handle (:meth:`LoadPipeline.overdue`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform

from kvtier.connector.load_store_specs import TierLoadSpec
from kvtier.connector.metrics import Samples
from kvtier.connector.worker.jobs import IO_FAILED, UNREAD, failure_of
from kvtier.connector.worker.plans import GroupPlan, select_rows
from kvtier.host.block_copy import CopyPath, CopyPlan
from kvtier.host.placement import name_this_thread, place_background_thread
from kvtier.log import get_logger
from kvtier.store.reader import SlotReads
from kvtier.store.slot import ReadOutcome
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK

logger = get_logger("connector")

# A batch not back this long after it started is given up.
BATCH_DEADLINE_S = 15.0
# The engine's step wins a busy core, the load takes the slack.
LOAD_THREAD_NICE = 10
# The thread looks at deadlines, cancellations and new work at least this often.
TICK_S = 0.05
# How often an idle load thread tries to open slabs that do not exist yet.
OPEN_RETRY_S = 1.0
# CPU-row copies per unit: a long CPU-tier hit takes turns with short ones.
COPY_UNIT_BYTES = 32 << 20
# The last part's checks and copies follow the last read, so parts stay small.
PART_BYTES = 8 << 20
# A large area makes larger parts, not more to track.
MAX_PARTS = 16

# A bounce part's states.
FREE, READING, COPYING, STUCK = "free", "reading", "copying", "stuck"


def part_layout(capacity: int, slot_bytes: int) -> tuple[int, int]:
    """``(parts, slots per part)`` for a bounce area of ``capacity`` slots of
    ``slot_bytes``: parts of about :data:`PART_BYTES`, at least two where the
    area holds two slots (a batch is read while the one before it is
    verified), at most :data:`MAX_PARTS`."""
    if capacity < 2:
        return 1, max(1, capacity)
    per = max(1, min(PART_BYTES // max(1, slot_bytes), capacity // 2))
    parts = min(MAX_PARTS, capacity // per)
    return parts, capacity // parts


@dataclass(eq=False)
class LoadTask:
    """One ``submit_load``'s slow part.

    Given: ``groups`` (the job's plans per KV-cache group), ``spec`` (its
    load spec when it has disk blocks), ``cpu_plans`` (CPU-row copies the
    thread performs: synchronous copy paths only; on accelerators the worker
    issues them at submission), ``expedited``, and ``after`` (on
    accelerators, the model runner's stream at submission,
    :meth:`~kvtier.host.block_copy.CopyPath.mark`: the task's copies follow it).

    Results, once taken back: ``failed`` (per block of the spec, 0 or why
    it failed: :data:`~kvtier.connector.worker.jobs.CORRUPT`, ``IO_FAILED``,
    ``UNREAD``), ``error`` (an exception it raised: the whole job failed),
    ``seconds`` (wall time from its first unit to its last), ``nbytes``
    (bytes it copied into the KV cache itself).

    ``cancelled`` (:meth:`LoadPipeline.cancel`): the worker gave the job up;
    the thread issues nothing more for it. ``copies``, its transfers in
    flight, changes under ``lock`` like ``cancelled``: with ``cancelled`` set
    and none in flight, nothing of the thread's can still write the job's
    blocks, so the worker may report it without the thread. The fields
    after ``copies`` are the thread's progress: CPU-row copies left, disk
    blocks not yet read (positions in the spec)."""

    job_id: int
    groups: list[GroupPlan]
    spec: TierLoadSpec | None = None
    cpu_plans: list[tuple[int, CopyPlan]] = field(default_factory=list)
    expedited: bool = False
    after: Any = None
    failed: np.ndarray | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    nbytes: int = 0
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    copies: int = field(default=0, init=False)
    cpu_left: deque[tuple[int, CopyPlan]] = field(default_factory=deque, init=False)
    disk_left: np.ndarray | None = field(default=None, init=False)
    started: float | None = field(default=None, init=False)

    def cut(self, per_unit: int) -> None:
        """Cut the task's work into units of at most ``per_unit`` blocks of
        CPU-row copies (``cpu_left``), and note the disk blocks to read."""
        for group, plan in self.cpu_plans:
            for lo in range(0, len(plan), per_unit):
                span = slice(lo, lo + per_unit)
                unit = CopyPlan(plan.gpu_ids[span], plan.row_ids[span], plan.sub_ids[span])
                self.cpu_left.append((group, unit))
        if self.spec is not None:
            self.disk_left = np.flatnonzero(self.spec.on_disk)

    def has_work(self) -> bool:
        """Units left to start (CPU-row copies or disk reads)."""
        disk = self.disk_left
        return bool(self.cpu_left) or (disk is not None and len(disk) > 0)

    def delivered(self, positions: np.ndarray, results: list[Any]) -> np.ndarray:
        """Note a read batch's outcomes (one per block at ``positions`` of the
        spec): the bounce row of every block it delivered verified, -1
        elsewhere; the others are marked in ``failed`` with their cause."""
        assert self.spec is not None and self.failed is not None
        bounce_row = np.full(len(self.spec.block_ids), -1, dtype=np.int64)
        for p, result in zip(positions, results):
            if result.outcome is ReadOutcome.OK:
                bounce_row[p] = result.row
            else:
                self.failed[p] = failure_of(result.outcome)
        return bounce_row

    def promote(self, bounce_row: np.ndarray, rows: Any, cpu_buffer: Any) -> None:
        """Copy the delivered blocks that have a promotion row from the
        reader's ``rows`` into those CPU rows: one gathered copy per batch."""
        assert self.spec is not None
        up = np.flatnonzero((bounce_row >= 0) & (self.spec.promote_rows >= 0))
        if len(up):
            src = rows[bounce_row[up]]
            if isinstance(src, torch.Tensor):  # a device staging area
                src = src.cpu().numpy()
            dst = cpu_buffer.array  # not kept: the buffer may unmap later
            dst[self.spec.promote_rows[up]] = src
            del dst


@dataclass(eq=False)
class Part:
    """One part of the bounce area (rows ``first_row`` on) and the batch it
    holds: READING ``task``'s blocks at ``positions`` (the reader's
    ``pending``) from ``since``; then COPYING while ``transfers`` read it; or
    STUCK, given up, until its reads return."""

    first_row: int
    state: str = FREE
    task: LoadTask | None = None
    pending: Any = None
    positions: np.ndarray | None = None
    since: float = 0.0
    transfers: set[int] = field(default_factory=set)


class BounceRing:
    """The bounce area as a ring of parts, and the thread's transfers in
    flight (``transfers``: id -> its task and the part it reads, oldest first).

    Contract (the load thread only: no locking):
      - :meth:`lay_out` cuts the area (:func:`part_layout`) ahead of a task's
        reads, again only while every part is FREE; :meth:`take` returns the
        next FREE part in ring order, or None.
      - :meth:`issued` notes a transfer of a task (reading a part, or None
        for a copy from elsewhere); :meth:`landed` notes the ids that landed
        (unknown ids are ignored): a COPYING part whose last transfer landed
        is FREE again.
      - :meth:`reap` frees the STUCK parts whose reads returned.
    """

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.per_part = 1
        self.transfers: dict[int, tuple[LoadTask, Part | None]] = {}
        self._next = 0

    def lay_out(self, capacity: int, slot_bytes: int) -> None:
        count, per = part_layout(capacity, slot_bytes)
        if (count, per) == (len(self.parts), self.per_part):
            return
        if all(p.state is FREE for p in self.parts):
            self.parts = [Part(i * per) for i in range(count)]
            self.per_part, self._next = per, 0

    def take(self) -> Part | None:
        n = len(self.parts)
        for i in range(n):
            part = self.parts[(self._next + i) % n]
            if part.state is FREE:
                self._next = (self._next + i + 1) % n
                return part
        return None

    def reading(self, task: LoadTask | None = None) -> list[Part]:
        """The READING parts (``task``'s only, if given), oldest batch first."""
        parts = [p for p in self.parts if p.state is READING]
        if task is not None:
            parts = [p for p in parts if p.task is task]
        return sorted(parts, key=lambda p: p.since)

    def stuck(self) -> list[Part]:
        return [p for p in self.parts if p.state is STUCK]

    def issued(self, transfer: int, task: LoadTask, part: Part | None) -> None:
        """A transfer issued for ``task`` (its lock held: ``task.copies``)."""
        task.copies += 1
        self.transfers[transfer] = (task, part)
        if part is not None:
            part.transfers.add(transfer)

    def landed(self, transfers: Any) -> None:
        for transfer in transfers:
            task, part = self.transfers.pop(transfer, (None, None))
            if task is not None:
                with task.lock:  # the worker reads it to settle a given-up job
                    task.copies -= 1
            if part is not None:
                part.transfers.discard(transfer)
                if not part.transfers:  # COPYING until its last one landed
                    self.free(part)

    def free(self, part: Part) -> None:
        part.state, part.task, part.pending, part.positions = FREE, None, None, None

    def abandon(self, part: Part, reader: SlotReads) -> None:
        """Wait for a part's reads without using them, then free it."""
        try:
            reader.abandon(part.pending)
        finally:
            self.free(part)

    def reap(self, reader: SlotReads) -> None:
        for part in self.parts:
            if part.state is STUCK and reader.ready(part.pending):
                logger.warning(
                    "kvtier: a stalled disk read returned after %.0f s; its bounce "
                    "part is in use again",
                    time.monotonic() - part.since,
                )
                self.abandon(part, reader)


class LoadPipeline:
    """The worker's load thread (see the module doc).

    Contract:
      - :meth:`submit` queues a task and returns at once; the thread starts
        on the first task, or earlier with :meth:`warm_up`.
      - :meth:`take` returns, without blocking, the tasks finished since the
        last call. Every submitted task comes back exactly once, also when it
        raised, was cancelled or its batches were given up, unless the
        pipeline was stopped first; never while a transfer it issued is in
        flight.
      - The thread never reads into a bounce part while a transfer reads it.
      - :meth:`cancel` returns once the thread issues nothing more for the
        task (a copy under way finishes first; one in flight on the device
        lands before the task comes back).
      - :meth:`overdue`: the thread has been inside one step (opening the
        reader, a unit, a batch's checks and copies, waiting for a transfer)
        longer than ``deadline_s``; nothing it holds or is handed moves
        until it comes back.
      - :meth:`stop` ends the thread within a deadline; reads in flight are
        waited for. It returns False if the thread did not stop in time (a
        read that never returns): then the host areas must stay mapped.
      - ``submit``, ``warm_up``, ``take``, ``wait_output``, ``cancel``,
        ``overdue`` and ``stop`` are called from the worker's thread;
        everything else runs on the load thread, which alone calls the
        reader and ``copies`` (an asynchronous path is the load thread's
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
        self.deadline_s = BATCH_DEADLINE_S
        self.ring = BounceRing()
        # Seconds from issuing each read batch to having it verified, for
        # the worker's report (added here, taken on the worker's thread).
        self.read_latencies = Samples()
        self.thread: threading.Thread | None = None
        self._per_unit = max(1, COPY_UNIT_BYTES // max([1, *block_bytes]))
        self._cond = threading.Condition()
        self._queue: deque[LoadTask] = deque()  # submitted, not yet held
        self._out: deque[LoadTask] = deque()
        self._stopping = False
        self._step_since: float | None = None
        # The load thread's own.
        self._expedited: deque[LoadTask] = deque()  # first come first
        self._turns: deque[LoadTask] = deque()  # the others, taking turns
        # When _open_slabs tries next (inf: every slab is open).
        self._open_at = 0.0

    # ------------------------------------------------- worker's thread side

    def submit(self, task: LoadTask) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("kvtier load thread is stopped")
            self._queue.append(task)
            if self.thread is None:
                try:
                    self._start_thread()
                except BaseException:
                    # No thread: the task leaves with the error (its job
                    # fails whole); a later submit tries again.
                    self._queue.remove(task)
                    raise
            self._cond.notify_all()

    def warm_up(self) -> None:
        """Start the thread ahead of the first load: it opens the reader's
        slab files first (the first open probes O_DIRECT, too slow for a
        disk hit's path). A file not created yet is tried again each
        ``OPEN_RETRY_S`` (:meth:`_open_slabs`) and at its first read."""
        with self._cond:
            if self.thread is None and not self._stopping:
                try:
                    self._start_thread()
                except RuntimeError as exc:  # no thread can start now
                    logger.warning(
                        "kvtier: the load thread cannot start yet (%s); "
                        "the first load tries again",
                        exc,
                    )

    def take(self) -> list[LoadTask]:
        out: list[LoadTask] = []
        while self._out:  # empty in the common case, every engine step
            out.append(self._out.popleft())
        return out

    def wait_output(self, timeout: float) -> None:
        """Block until something can be taken, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._out), timeout)

    def cancel(self, task: LoadTask) -> None:
        # A plain store, read by the thread under ``task.lock`` before each
        # copy: the worker never waits for that lock, which a thread stuck
        # in one of the task's copies holds.
        task.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def overdue(self) -> bool:
        since = self._step_since
        return since is not None and time.monotonic() - since > self.deadline_s

    def stop(self, timeout: float) -> bool:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # ------------------------------------------------------ the load thread

    def _start_thread(self) -> None:
        """Start the load thread; ``self.thread`` is set only once it runs,
        so a start that fails (RuntimeError: no thread can start) is tried
        again instead of leaving loads queued for a thread that never ran."""
        thread = threading.Thread(target=self._run, name="kvtier-load", daemon=True)
        thread.start()
        self.thread = thread

    def _run(self) -> None:
        self._step_since = time.monotonic()
        name_this_thread()  # its Python name, kvtier-load
        place_background_thread(LOAD_THREAD_NICE)
        try:
            device = getattr(self.copies, "device", None)
            if device is not None and device.type != "cpu":
                # Copies (and a device staging reader's checks) are queued
                # after this thread's current stream: its own, never the
                # legacy default stream that would serialise with the
                # model's work (setting it sets this thread's device too).
                # Each task's copies follow its ``after`` mark.
                torch.accelerator.set_stream(current_platform.Stream(device))
            while self._turn():
                pass
        except BaseException as exc:
            # A bug outside any one task: every task held or still to come
            # fails whole (a recompute) rather than waiting for a thread that
            # is gone.
            logger.exception("kvtier: the load thread failed; loads are recomputed")
            self._fail_all(exc)
        finally:
            self._step_since = None
            for part in self.ring.parts:
                if part.state in (READING, STUCK):
                    self.ring.abandon(part, self.reader)

    def _open_slabs(self) -> None:
        """Until every slab is open, at most once per ``OPEN_RETRY_S``:
        ``reader.start()``, which opens the slabs that exist and asks for a
        read process's child once all are. Off the model's thread, before
        the first hit; and as soon as a new store's slabs exist rather
        than at the first disk hit, hours later maybe: the descriptors keep
        reading when the store directory is removed or swapped meanwhile."""
        now = time.monotonic()
        if now < self._open_at:
            return
        reader = self.reader
        if reader is None:
            self._open_at = math.inf
            return
        reader.start()
        done = all(h is not None for h in reader.files.handles)
        self._open_at = math.inf if done else now + OPEN_RETRY_S

    def _turn(self) -> bool:
        """One step: a unit of work, a returned batch, or a bounded wait for
        either; False once stopping."""
        if self._open_at != math.inf:
            self._open_slabs()
        with self._cond:
            while self._queue:
                task = self._queue.popleft()
                try:
                    task.cut(self._per_unit)
                    if task.disk_left is not None:
                        self.ring.lay_out(self.reader.capacity, self.reader.slot_size)
                except BaseException as exc:
                    # Out of the queue and not yet held: failed here, or no
                    # one would hand it back (_pick does, it has no work).
                    self._fail(task, exc)
                (self._expedited if task.expedited else self._turns).append(task)
            if self._stopping:
                return False
        self._step_since = time.monotonic()
        reader, ring = self.reader, self.ring
        if ring.parts:
            ring.reap(reader)
        if ring.transfers:  # landed: their tasks may finish, their parts free
            ring.landed(self.copies.poll())
        reading = ring.reading()
        if reading and self._overdue(reading[0]):
            # Checked every turn, not only when idle: a thread kept busy by
            # other loads must still give up a batch whose reads hang.
            self._give_up(reading[0])
            return True
        # An expedited task's batch that returned goes before any other
        # task's unit: the engine's step waits for it (and its request runs).
        urgent = next(
            (p for p in reading if p.task.expedited and reader.ready(p.pending)), None
        )
        if urgent is not None:
            self._finish(urgent)
        elif (task := self._pick()) is not None:
            self._unit(task)
        elif returned := next((p for p in reading if reader.ready(p.pending)), None):
            self._finish(returned)
        elif ring.transfers:
            # A batch's copies take about a millisecond: wait for the oldest
            # transfer (on its event) rather than poll.
            self.copies.wait({next(iter(ring.transfers))})
        elif reading:
            self._step_since = None
            reader.wait(reading[0].pending, TICK_S)
        else:
            self._step_since = None
            with self._cond:
                if not self._queue and not self._stopping:
                    held = self._expedited or self._turns or ring.stuck()
                    if held:
                        self._cond.wait(TICK_S)
                    elif self._open_at != math.inf:  # slabs to open yet
                        self._cond.wait(OPEN_RETRY_S)
                    else:
                        self._cond.wait()
        return True

    def _overdue(self, part: Part) -> bool:
        """Whether ``part``'s batch is past its deadline (or its task was
        cancelled) and has not returned meanwhile."""
        assert part.task is not None
        late = time.monotonic() - part.since > self.deadline_s
        return (late or part.task.cancelled) and not self.reader.ready(part.pending)

    def _pick(self) -> LoadTask | None:
        """The task whose unit runs next: the oldest expedited task that can
        run one, else the next of the others in turn. Tasks that are done
        (or cancelled) leave here, handed back to the worker."""
        for queue in (self._expedited, self._turns):
            for _ in range(len(queue)):
                task = queue.popleft()
                if not task.copies and (
                    task.cancelled or not (task.has_work() or self.ring.reading(task))
                ):
                    self._done(task)
                    continue
                if self._runnable(task):
                    if queue is self._expedited:
                        queue.appendleft(task)  # keeps the front until done
                    else:
                        queue.append(task)  # its turn is used
                    return task
                queue.append(task)
        return None

    def _runnable(self, task: LoadTask) -> bool:
        if task.cancelled or not task.has_work():
            return False  # waits for its reads or copies in flight, then leaves
        if task.cpu_left:
            return True
        states = {p.state for p in self.ring.parts}
        return FREE in states or states == {STUCK}  # all stuck: fails at once

    def _unit(self, task: LoadTask) -> None:
        """Run one unit of ``task``; an exception fails the task whole."""
        if task.started is None:
            task.started = time.perf_counter()
        try:
            if task.cpu_left:
                group, plan = task.cpu_left.popleft()
                with task.lock:
                    if not task.cancelled:
                        self._copy(task, MEDIUM_CPU, group, plan, None)
            else:
                self._read(task)
        except BaseException as exc:
            self._fail(task, exc)

    def _read(self, task: LoadTask) -> None:
        """Start reading ``task``'s next batch into the next free part."""
        spec = task.spec
        assert spec is not None and task.failed is not None
        assert task.disk_left is not None
        per = self.ring.per_part
        batch, task.disk_left = task.disk_left[:per], task.disk_left[per:]
        part = self.ring.take()
        if part is None:  # every part held by reads given up
            task.failed[batch] = UNREAD
            return
        part.since = time.monotonic()  # the batch's deadline counts from here
        items = [(int(spec.block_ids[p]), spec.keys[p]) for p in batch]
        part.pending = self.reader.submit(items, first_row=part.first_row)
        part.state, part.task, part.positions = READING, task, batch

    def _finish(self, part: Part) -> None:
        """Verify a batch whose reads returned, copy its promotions, and copy
        it into the KV cache (or issue those copies); an exception fails its
        task whole. The part is free again once no transfer reads it."""
        reader, task = self.reader, part.task
        assert task is not None and part.positions is not None
        part.state = COPYING
        try:
            bounce_row = task.delivered(part.positions, reader.complete(part.pending))
            self.read_latencies.add(time.monotonic() - part.since)
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
            if not part.transfers:
                self.ring.free(part)

    def _give_up(self, part: Part) -> None:
        """A batch past its deadline (or of a cancelled task): its blocks
        fail as I/O errors, its part is STUCK until the reads return."""
        task = part.task
        assert task is not None and task.failed is not None
        task.failed[part.positions] = IO_FAILED  # a stall: the copies stay
        part.state = STUCK
        if not task.cancelled:  # else the worker gave the job up and said so
            logger.error(
                "kvtier: disk reads of load job %d have not returned after %.0f s: its "
                "%d blocks are recomputed; %d of %d bounce parts wait for the reads "
                "(reads run in the %s: a hung drive or mount, or that process "
                "stopped?)",
                task.job_id,
                time.monotonic() - part.since,
                len(part.positions),
                len(self.ring.stuck()),
                len(self.ring.parts),
                self.reader.describe(),
            )

    def _copy(
        self, task: LoadTask, area: str, group: int, plan: CopyPlan, part: Part | None
    ) -> None:
        """Copy ``plan`` into the KV cache for ``task`` (or issue the copy:
        the transfer is tracked until it lands, with the ``part`` it reads)."""
        if task.after is not None:
            self.copies.follow(task.after)
            task.after = None
        transfer = self.copies.submit(area, group, plan, False, task.expedited)
        task.nbytes += len(plan) * self.block_bytes[group]
        if transfer is not None:
            self.ring.issued(transfer, task, part)

    def _fail(self, task: LoadTask, exc: BaseException) -> None:
        """``task`` raised: it fails whole; its other batches are dropped."""
        task.error = exc
        for part in self.ring.reading(task):
            if self.reader.ready(part.pending):
                self.ring.abandon(part, self.reader)
            else:  # never wait here for a read that may not return
                part.state = STUCK
        task.cpu_left.clear()
        task.disk_left = None

    def _fail_all(self, exc: BaseException) -> None:
        """The thread is going away: every task it holds or is handed fails
        whole, now and from now on."""
        with self._cond:
            self._stopping = True
            held = [*self._expedited, *self._turns, *self._queue]
            self._expedited.clear()
            self._turns.clear()
            self._queue.clear()
        try:
            # No task goes back while its copies may still write its blocks.
            self.copies.wait(set(self.ring.transfers))
        except Exception:
            logger.exception("kvtier: waiting for the load thread's copies failed")
        for task in held:
            task.error = exc
            self._done(task)

    def _done(self, task: LoadTask) -> None:
        """Hand ``task`` back to the worker (once)."""
        if task.started is not None:
            task.seconds += time.perf_counter() - task.started
        with self._cond:
            self._out.append(task)
            self._cond.notify_all()
