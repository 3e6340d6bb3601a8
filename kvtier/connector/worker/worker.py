"""Worker-side adapter: vLLM's OffloadingWorker over kvtier's tiers.

A worker (one TP rank) moves the bytes of every transfer the scheduler
planned: stores (KV cache -> CPU-tier rows) and loads, one job per request
whatever its media (CPU-tier rows and disk slots -> KV cache; a verified
disk block the scheduler gave a promotion row is also copied into that CPU
row).

``submit_*`` never waits for I/O. A store's copies are issued on the
calling (model-runner) thread; a load is planned there (index arithmetic)
and its slow part runs on the load pipeline
(:mod:`kvtier.connector.worker.pipeline`). Copies between the KV cache and
the host go through a copy path: on accelerators vLLM's own transfer code
(:class:`~kvtier.connector.worker.device_copy.DeviceCopies`), one per
thread (the model runner's issues stores and CPU-tier rows, the load
thread's the disk batches); on the CPU platform kvtier's word-sized copier
(:class:`~kvtier.host.block_copy.HostCopies`), shared. A job is reported
done once its load task came back and every transfer of it landed
(:mod:`kvtier.connector.worker.jobs`).

What fails costs a recompute, never wrong KV or a hang (the kinds of
failure: :mod:`kvtier.connector.worker.jobs`). A disk block that fails is
copied nowhere; the job reports the keys and GPU blocks it could not fill
(:meth:`take_load_error`) and kvtier's connector turns that into vLLM's
load-error path. An exception raised by a job fails the whole job
(``contain_exceptions``). A load thread that does not come back from one
step (a hung open or transfer) costs every load it holds, failed whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.connector.worker.jobs import (
    CORRUPT,
    Job,
    JobBook,
    JobExceptions,
    LoadError,
    disk_load_error,
)
from kvtier.connector.worker.kv_layout import group_views
from kvtier.connector.worker.pipeline import TICK_S, LoadPipeline, LoadTask
from kvtier.connector.worker.plans import split_by_group, split_load
from kvtier.host.block_copy import (
    CopyPath,
    CopyPlan,
    HostArea,
    HostCopies,
)
from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.log import get_logger
from kvtier.store.reader import SlotReads
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK

logger = get_logger("connector")

# Shutdown waits no longer for the load thread; a read still out keeps its areas mapped.
STOP_DEADLINE_S = 10.0


class TieredOffloadingWorker(OffloadingWorker):
    """Transfers between the KV cache and kvtier's tiers for one rank.

    ``device_copies`` builds the accelerator copy path from the validated
    group views and host areas (the spec passes vLLM's, see
    :mod:`kvtier.connector.worker.device_copy`); without it the KV cache must live
    in host memory (the CPU platform) and kvtier's own copier runs.
    Construction validates the KV cache (:mod:`kvtier.connector.worker.kv_layout`)
    and owns nothing until it returns: the caller releases ``cpu_buffer``
    and ``reader`` if it raises.

    ``contain_exceptions``: whether an exception raised by a job (while it
    is submitted, or on the load thread) turns into a failed job (see the
    module doc) instead of propagating from ``submit_*`` or
    ``get_finished``. Only kvtier's connector handles a failed job; vLLM's
    stock connector asserts success (``python -O`` would drop that check),
    so the spec sets it only under kvtier's connector.

    Thread-safety: vLLM calls every method from the model runner's thread;
    the load thread shares only what :class:`LoadPipeline` hands over."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_buffer: CpuBlockBuffer,
        blocks_per_chunk: int,
        reader: SlotReads | None = None,
        device_copies: Callable[..., CopyPath] | None = None,
        contain_exceptions: bool = False,
    ):
        views = group_views(
            kv_caches,
            cpu_buffer.block_bytes,
            blocks_per_chunk,
            device_kind="cpu" if device_copies is None else None,
        )
        areas = [HostArea(MEDIUM_CPU, cpu_buffer.tensor)]
        if reader is not None:
            # A host bounce area (numpy), or a device staging area (torch).
            rows = reader.rows
            if not isinstance(rows, torch.Tensor):
                rows = torch.from_numpy(rows)
            areas.append(HostArea(MEDIUM_DISK, rows, pinned=reader.pinned))
        if device_copies is None:
            copies = load_copies = HostCopies(views, areas, blocks_per_chunk)
        else:
            # One per thread (an asynchronous path keeps per-thread state):
            # the model runner's (the CPU tier) and the load thread's (disk).
            copies = device_copies(views, areas[:1], blocks_per_chunk)
            try:
                load_copies = device_copies(views, areas[1:], blocks_per_chunk)
            except BaseException:
                copies.shutdown()
                raise
        self._set_up(
            copies,
            cpu_buffer,
            blocks_per_chunk,
            reader,
            [sum(v.shape[1] for v in g) for g in views],
            load_copies,
        )
        self.contain_exceptions = contain_exceptions

    def _set_up(
        self,
        copies: CopyPath,
        cpu_buffer: Any,
        blocks_per_chunk: int,
        reader: SlotReads | None,
        block_bytes: list[int],
        load_copies: CopyPath | None = None,
    ) -> None:
        """The state every worker shares, whatever its host rows: the copy
        paths (the model runner's thread's, and the load thread's:
        ``load_copies``, the same one by default), what ``shutdown`` closes
        (``cpu_buffer``), the disk reader, the bytes of one offloaded block
        per KV-cache group, the load thread and the job bookkeeping.
        Subclasses with other host rows call it instead of ``__init__``."""
        self.cpu_buffer = cpu_buffer
        self.blocks_per_chunk = blocks_per_chunk
        self.reader = reader
        self.block_bytes = block_bytes
        self.copies = copies
        self.loads = LoadPipeline(
            reader, copies if load_copies is None else load_copies, cpu_buffer, block_bytes
        )
        self.book = JobBook(block_bytes)
        self.contain_exceptions = False
        self.exceptions = JobExceptions()
        self._warm = reader is None  # nothing to open ahead without a disk tier

    # ------------------------------------------------------------- contract

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy the job's GPU blocks into its CPU rows; returns True.

        With ``contain_exceptions``, an exception raised on the way is
        logged, counted (``exceptions``) and fails the job: it is reported
        failed once the copies it had already submitted landed, and
        :meth:`take_store_error` names every CPU row of the job, none of
        which may be read. Without, it propagates."""
        started = time.perf_counter()
        job = Job(job_id)
        rows = np.asarray(dst_spec.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
        try:
            for gp in split_by_group(src_spec, len(rows), self.blocks_per_chunk):
                plan = CopyPlan(gp.plan.gpu_ids, rows[gp.plan.row_ids], gp.plan.sub_ids)
                self.book.copy(self.copies, job, MEDIUM_CPU, gp.group, plan, to_host=True)
        except Exception as exc:
            if not self.contain_exceptions:
                raise
            self.exceptions.note(exc, "store", job_id)
            self.book.fail_store(job, [int(r) for r in rows])
        if self.copies.synchronous:
            job.seconds += time.perf_counter() - started
        self.book.settle(job)
        return True

    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Plan the job and hand its slow part to the load thread; returns
        True without waiting for any I/O or (CPU platform) copy.

        A disk block that fails is left unfilled. With
        ``contain_exceptions``, an exception raised on the way (here or on
        the load thread) is logged, counted (``exceptions``) and fails every
        block of the job (:meth:`~kvtier.connector.worker.jobs.Job.
        whole_error`); without, it propagates (from here, or from
        ``get_finished``). A failed job is reported once the copies it had
        already submitted landed, and :meth:`take_load_error` names the
        keys and GPU blocks it could not deliver."""
        job = Job(job_id, src=src_spec, dst=dst_spec)
        self.book.jobs[job_id] = job
        try:
            task = self._plan_load(job, src_spec, dst_spec, expedited)
            if task is not None:
                self.loads.submit(task)
                job.task = task
        except Exception as exc:
            if not self.contain_exceptions:
                self.book.jobs.pop(job_id, None)
                raise
            self.exceptions.note(exc, "load", job_id)
            self.book.fail(job, job.whole_error())
            self.book.settle(job)
            return True
        if job.task is None:
            self.book.settle(job)
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        if not self._warm:
            # Called every step from the first on, when the scheduler side
            # has created the store: open it ahead of the first disk hit.
            self._warm = True
            self.loads.warm_up()
        self._pump()
        return self.book.take_finished()

    @override
    def wait(self, job_ids: set[int]) -> None:
        """Return once the given jobs finished (they are still reported by
        the next ``get_finished``). Loads are given up as in ``get_finished``."""
        while True:
            self._pump()
            jobs = [self.book.jobs[j] for j in job_ids if j in self.book.jobs]
            if not jobs:
                return
            if all(job.task is None for job in jobs):
                self.copies.wait(set().union(*(job.transfers for job in jobs)))
            else:
                self.loads.wait_output(TICK_S)

    @override
    def shutdown(self) -> None:
        stopped = self.loads.stop(STOP_DEADLINE_S)
        try:
            # Drains every transfer still in flight before the host areas
            # they read or write go away (the load thread's only once it
            # stopped: it may still be issuing).
            self.copies.shutdown()
            if stopped and self.loads.copies is not self.copies:
                self.loads.copies.shutdown()
        finally:
            self.book.clear()
            if stopped:
                if self.reader is not None:
                    self.reader.close()
                self.cpu_buffer.close()
            else:
                # A read that never returned still targets the bounce area
                # (and a promotion row after it): leave both mapped.
                logger.error(
                    "kvtier: the load thread did not stop within %.0f s (a disk "
                    "read that never returns); its host areas stay mapped "
                    "until the process exits",
                    STOP_DEADLINE_S,
                )

    # ---------------------------------------------------------------- extras

    def take_load_error(self, job_id: int) -> LoadError | None:
        """What a job reported failed by ``get_finished`` could not load."""
        return self.book.take_load_error(job_id)

    def take_read_latencies(self) -> list[float]:
        """Seconds each disk read batch took (issued to verified) since the
        last call."""
        return self.loads.read_latencies.take()

    def take_store_error(self, job_id: int) -> list[int] | None:
        """The CPU rows of a store reported failed by ``get_finished``: the
        manager must give them back unwritten (``note_worker_report``)."""
        return self.book.take_store_error(job_id)

    # ------------------------------------------------------------- internals

    def _plan_load(
        self,
        job: Job,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool,
    ) -> LoadTask | None:
        """Issue (accelerators) or plan (CPU platform) the CPU-row copies and
        plan the disk reads; the task for the load thread, or None when
        nothing is left for it. ``expedited`` (vLLM >= 0.33: waited on
        within the step) runs on its own streams on accelerators and goes
        ahead of queued loads on the load thread."""
        split = split_load(src_spec, dst_spec, self.blocks_per_chunk)
        task = LoadTask(job.job_id, split.groups, expedited=expedited)
        if split.spec is not None and not self.loads.copies.synchronous:
            task.after = self.copies.mark()
        for group, copy in split.cpu:
            if self.copies.synchronous:
                task.cpu_plans.append((group, copy))
            else:
                self.book.copy(self.copies, job, MEDIUM_CPU, group, copy, False, expedited)
        if split.spec is not None:
            if self.reader is None:
                # No disk tier on this worker: nothing can be read.
                bad = np.where(split.on_disk, CORRUPT, 0)
                self.book.fail(job, disk_load_error(split.spec, split.groups, bad))
            else:
                task.spec = split.spec
                task.failed = np.zeros(len(split.on_disk), dtype=np.int8)
        if task.spec is None and not task.cpu_plans:
            return None
        return task

    def _pump(self) -> None:
        """Take the tasks the load thread handed back, collect landed
        transfers, give up every load if the thread is stuck, and report
        finished jobs."""
        for task in self.loads.take():
            self._task_done(task)
        for transfer, seconds in self.copies.poll().items():
            self.book.landed(transfer, seconds)
        if self.loads.overdue():
            for job in list(self.book.jobs.values()):
                if job.task is not None:  # given up before too: not reported yet
                    self._give_up(job)

    def _task_done(self, task: LoadTask) -> None:
        job = self.book.jobs.get(task.job_id)
        if job is None or job.task is not task:
            return  # already reported
        job.task = None
        if task.cancelled:
            # Given up (failed whole in _give_up); reported now that no copy of
            # its task can still write its blocks.
            self.book.settle(job)
            return
        job.seconds += task.seconds
        job.nbytes += task.nbytes
        if task.error is not None:
            exc = task.error
            if not self.contain_exceptions or not isinstance(exc, Exception):
                self.book.jobs.pop(job.job_id, None)
                raise exc
            self.exceptions.note(exc, "load", job.job_id)
            self.book.fail(job, job.whole_error())
        elif task.failed is not None and task.failed.any():
            assert task.spec is not None
            self.book.fail(job, disk_load_error(task.spec, task.groups, task.failed))
        self.book.settle(job)

    def give_up_loads(self, job_ids: Collection[int]) -> None:
        """Fail whole the load jobs among ``job_ids`` that still read the
        disk, without waiting for their reads; each is reported now if no
        copy of it is in flight, else once its task came back.

        For vLLM's flush of the jobs in flight at a connector reset, which it
        waits for at the next step's start (``handle_preemptions``): a disk
        read that stalls would stall that step, up to the batch deadline.
        Their requests recompute those tokens, as after the reset they would
        have for every block it forgot."""
        for job_id in job_ids:
            job = self.book.jobs.get(job_id)
            task = job.task if job is not None else None
            if task is not None and task.spec is not None and not task.cancelled:
                self._cancel(job)

    def _give_up(self, job: Job) -> None:
        """Fail ``job`` whole, the load thread being stuck (see :meth:`_cancel`):
        copies of it the thread issued are waited for on the device, as only
        the stuck thread would ever poll them."""
        assert job.task is not None
        if not job.task.cancelled:  # else it was given up before, and said so
            logger.error(
                "kvtier: the load thread has not come back from one step for "
                "%.0f s (a disk open or transfer that does not return?); load "
                "job %d is recomputed",
                self.loads.deadline_s,
                job.job_id,
            )
        self._cancel(job, drain=True)

    def _cancel(self, job: Job, drain: bool = False) -> None:
        """Fail ``job`` whole: the load thread issues nothing more for it, and
        it is reported now if no copy of it is in flight (with ``drain``:
        once the copies it issued completed on the device), else once its
        task came back (the copies it issued landed)."""
        task = job.task
        assert task is not None
        self.loads.cancel(task)
        self.book.fail(job, job.whole_error())
        # The thread issues nothing for it from here on. If it holds the
        # task's lock it is inside one of the task's copies (perhaps the
        # step it is stuck in): the job is reported once the task is back,
        # never waited for here.
        idle = False
        if task.lock.acquire(blocking=False):
            try:
                idle = task.copies == 0
            finally:
                task.lock.release()
            if not idle and drain:
                # Issued before the lock was taken, so submitted to the
                # device: landed once it drained, whether or not the thread
                # ever polls them (a copy takes milliseconds).
                self.loads.copies.drain()
                idle = True
        if idle:
            # Report it now rather than when the thread hands it back, which
            # an open or a read that does not return may delay without end.
            job.task = None
            self.book.settle(job)
