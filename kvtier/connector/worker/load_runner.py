"""The worker's load thread: the part of a load that takes time, off the
model runner's thread.

vLLM calls ``submit_load`` on the model runner's thread, between engine
steps; whatever it does there, every running request waits for (vLLM 0.33:
"Submission itself must still not block"). The worker therefore only plans
a load there (index arithmetic, microseconds per block) and hands the job to
this thread, which does what takes time:

- reads the job's disk slots batch by batch into the reader's bounce area,
  pipelined over the area's two halves: batch k+1's reads run on the back
  end's threads (one ``preadv`` per run of consecutive slots) while batch k
  is verified and copied;
- verifies every slot (:meth:`~kvtier.io.slot_reader.SlotReader.complete`)
  and copies a verified block that has a promotion row into that CPU row;
- with a synchronous copy path (the CPU platform, where the "GPU" KV cache
  is host memory) also copies into the KV cache, from CPU rows and from the
  bounce area, then frees the half;
- with an asynchronous copy path (CUDA: vLLM's transfer handlers, used by
  one thread only) posts each verified batch instead: the model runner's
  thread issues its copies from ``get_finished`` and frees the half with
  :meth:`LoadRunner.release` once they landed.

Why one thread and whole batches: an in-process engine's loop spins without
sleeping, so a background thread gets the GIL back only at the
interpreter's switch interval (5 ms) each time it blocks. Work handed over
per batch and per job, never per block, keeps that cost per batch. Jobs run
one after another in submission order; expedited loads (vLLM 0.33's
synchronous loads, waited on within the step) go first.

Results travel back through :meth:`LoadRunner.take`: :class:`BatchReady`
items (asynchronous copy paths only) and then the finished
:class:`LoadTask`, in that order, so a task's batches are always taken before
the task itself.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.connector.specs import TierLoadSpec
from kvtier.connector.worker.job_plan import GroupPlan, select_rows
from kvtier.io.block_copy import CopyPath, CopyPlan
from kvtier.io.device_staging import DeviceStagingReader, PendingStage
from kvtier.io.layout import ReadOutcome
from kvtier.io.slot_reader import PendingRead, SlotReader
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK

logger = logging.getLogger("kvtier.connector")

# How much lower the load thread's CPU priority is than the thread that
# started it (Linux nice levels; raising one's own is always permitted).
# When the cores are busy, the engine's step (and, under ``vllm serve``, the
# API server process) wins them and the load takes the slack: measured on a
# 2-core host, multiprocess engine, the longest decode step while a 256 MiB
# prefix loaded from disk went from 60 ms to 22 ms (decode step 9 ms),
# while the load took 20 % longer (docs/benchmarks.md, "Step stalls").
LOAD_THREAD_NICE = 10


class _Stopped(Exception):
    """The runner is stopping: the task is given up where it stands."""


@dataclass(eq=False)
class LoadTask:
    """One load job's work on the load thread.

    ``host_plans``: CPU-row copies the thread performs (synchronous copy
    paths only; on accelerators the worker issues them at submission).
    ``spec``: the job's load spec when it has disk blocks. After the thread
    took it: ``failed`` (per block of the spec, the disk blocks that failed
    a read or a check), ``error`` (an exception it raised: the whole job
    failed), ``seconds`` (wall time of its host work), ``nbytes`` (bytes it
    copied into the KV cache itself).

    ``cancelled`` (set through :meth:`LoadRunner.cancel`): the worker gave
    the job up; from then on the thread writes nothing more for it."""

    job_id: int
    groups: list[GroupPlan]
    spec: TierLoadSpec | None = None
    host_plans: list[tuple[int, CopyPlan]] = field(default_factory=list)
    expedited: bool = False
    failed: np.ndarray | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    nbytes: int = 0
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class BatchReady:
    """A verified batch in half ``half`` of the bounce area, for the model
    runner's thread to copy: ``bounce_row[p]`` is the bounce row of block
    ``p`` of the task's spec, -1 where the block is not in this batch or
    failed."""

    task: LoadTask
    half: int
    bounce_row: np.ndarray


class LoadRunner:
    """The worker-owned load thread (see the module doc).

    Contract:
      - :meth:`submit` queues a task and returns at once; the thread starts
        on the first task, or earlier with :meth:`warm_up`.
      - :meth:`take` returns, without blocking, what finished since the last
        call (:class:`BatchReady` items, then finished :class:`LoadTask`
        objects). Every submitted task comes back exactly once, also when it
        raised or was cancelled, unless the runner was stopped first.
      - :meth:`release` frees a bounce half posted in a :class:`BatchReady`
        (asynchronous copy paths): the thread never reads into a half before
        its copies were released.
      - :meth:`cancel` returns once the thread writes nothing more for the
        task (a copy under way finishes first).
      - :meth:`stop` ends the thread within a deadline; reads in flight are
        waited for. It returns False if the thread did not stop in time (a
        read that never returns): then the host areas must stay mapped.
      - ``submit``, ``take``, ``release``, ``cancel`` and ``stop`` are called
        from the worker's thread; everything else runs on the load thread.
    """

    def __init__(
        self,
        reader: SlotReader | DeviceStagingReader | None,
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
        self._cond = threading.Condition()
        self._queue: deque[LoadTask] = deque()
        self._out: deque[BatchReady | LoadTask] = deque()
        self._free = [True, True]  # bounce halves not read by any copy
        self._next_half = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------- worker's thread side

    def submit(self, task: LoadTask) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("kvtier load thread is stopped")
            if task.expedited:
                self._queue.appendleft(task)
            else:
                self._queue.append(task)
            if self._thread is None:
                self._start_thread()
            self._cond.notify_all()

    def warm_up(self) -> None:
        """Start the thread ahead of the first load; it opens the reader's
        slab files first. The first open in a process probes O_DIRECT (a
        file created, written, read back and removed) and costs tens of
        milliseconds; measured in the first disk hit after start-up, a
        decoding step stretched to 45 ms while it ran. A file not created
        yet is opened at its first read."""
        with self._cond:
            if self._thread is None and not self._stopping:
                self._start_thread()

    def take(self) -> list[BatchReady | LoadTask]:
        out: list[BatchReady | LoadTask] = []
        while self._out:
            out.append(self._out.popleft())
        return out

    def wait_output(self, timeout: float) -> None:
        """Block until something can be taken, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._out), timeout)

    def release(self, half: int) -> None:
        with self._cond:
            self._free[half] = True
            self._cond.notify_all()

    def cancel(self, task: LoadTask) -> None:
        with task.lock:
            task.cancelled = True

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
        _lower_priority(LOAD_THREAD_NICE)
        device = getattr(self.reader, "device", None)
        if device is not None and device.type == "cuda":
            # A device staging reader copies and checks on this thread's
            # current stream: its own, never the legacy default stream that
            # would serialise with the model's work.
            torch.cuda.set_stream(torch.cuda.Stream(device))
        if self.reader is not None:
            self.reader.files.open_all()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                task = self._queue.popleft()
            started = time.perf_counter()
            try:
                self._run_task(task)
            except _Stopped:
                return
            except BaseException as exc:  # reported on the worker's thread
                task.error = exc
            finally:
                task.seconds += time.perf_counter() - started
            with self._cond:
                self._out.append(task)
                self._cond.notify_all()

    def _run_task(self, task: LoadTask) -> None:
        with task.lock:
            if task.cancelled:
                return
            for group, plan in task.host_plans:
                self.copies.submit(MEDIUM_CPU, group, plan, False, task.expedited)
                task.nbytes += len(plan) * self.block_bytes[group]
        if task.spec is not None:
            self._run_disk(task, task.spec)

    def _run_disk(self, task: LoadTask, spec: TierLoadSpec) -> None:
        reader = self.reader
        assert reader is not None and task.failed is not None
        positions = np.flatnonzero(spec.on_disk)
        halves = 2 if reader.capacity >= 2 else 1
        per_read = reader.capacity // halves
        # Batches read but not yet verified and copied, oldest first: at most
        # two (one per half), so batch k is finished while k+1 is read.
        inflight: deque[tuple[PendingRead | PendingStage, np.ndarray, int]] = deque()
        try:
            for start in range(0, len(positions), per_read):
                if task.cancelled:
                    break
                half = self._next_half % halves
                self._next_half = half + 1
                if inflight and inflight[0][2] == half:
                    # One half only: finish the batch that holds it first.
                    self._finish_batch(task, *inflight.popleft())
                self._acquire(half)
                batch = positions[start : start + per_read]
                try:
                    read = reader.submit(
                        [(int(spec.block_ids[p]), spec.keys[p]) for p in batch],
                        first_row=half * per_read,
                    )
                except BaseException:
                    self.release(half)
                    raise
                inflight.append((read, batch, half))
                if len(inflight) > 1:
                    self._finish_batch(task, *inflight.popleft())
            while inflight:
                self._finish_batch(task, *inflight.popleft())
        finally:
            for read, _chunk, half in inflight:  # raised or cancelled
                reader.abandon(read)  # its reads land before the half is free
                self.release(half)

    def _acquire(self, half: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._free[half] or self._stopping)
            if self._stopping:
                raise _Stopped
            self._free[half] = False

    def _finish_batch(
        self,
        task: LoadTask,
        read: PendingRead | PendingStage,
        batch: np.ndarray,
        half: int,
    ) -> None:
        reader = self.reader
        spec = task.spec
        assert reader is not None and spec is not None and task.failed is not None
        try:
            results = reader.complete(read)
        except BaseException:
            self.release(half)
            raise
        bounce_row = np.full(len(spec.block_ids), -1, dtype=np.int64)
        for p, result in zip(batch, results):
            if result.outcome is ReadOutcome.OK:
                bounce_row[p] = result.row
            else:
                task.failed[p] = True
        posted = False
        try:
            with task.lock:
                if task.cancelled:
                    return
                up = np.flatnonzero((bounce_row >= 0) & (spec.promote_rows >= 0))
                if len(up):  # one gathered copy for the batch, not one per block
                    src = reader.rows[bounce_row[up]]
                    if isinstance(src, torch.Tensor):  # a device staging area
                        src = src.cpu().numpy()
                    rows = self.cpu_buffer.array
                    rows[spec.promote_rows[up]] = src
                    del rows
                if not self.copies.synchronous:
                    with self._cond:
                        self._out.append(BatchReady(task, half, bounce_row))
                        self._cond.notify_all()
                    posted = True
                    return
                for gp in task.groups:
                    rows = bounce_row[gp.plan.row_ids]
                    mask = rows >= 0
                    if mask.any():
                        plan = select_rows(gp.plan, mask, rows[mask])
                        self.copies.submit(
                            MEDIUM_DISK, gp.group, plan, False, task.expedited
                        )
                        task.nbytes += len(plan) * self.block_bytes[gp.group]
        finally:
            if not posted:
                self.release(half)



def _lower_priority(by: int) -> None:
    """Raise the calling thread's nice level by ``by`` (Linux: per thread;
    elsewhere ``setpriority`` would reach the whole process, so nothing)."""
    if not sys.platform.startswith("linux") or by <= 0:
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
    except OSError as exc:  # a sandbox without setpriority: run as is
        logger.debug("kvtier: load thread priority unchanged: %s", exc)
