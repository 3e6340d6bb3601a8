"""The worker's jobs in flight, and what a job that did not deliver reports.

A job (one ``submit_store`` or ``submit_load``) may be several transfers on
the copy path (one per KV-cache group and host area, one per read batch)
plus, for a load, a task on the load pipeline. :class:`JobBook` tracks
which transfers each job still waits for and reports the job to vLLM (a
``TransferResult``) once nothing of it is in flight, with the time and bytes
it took and whether it succeeded. What a failed job could not do is kept
for the connector: a load's :class:`LoadError`, a store's CPU rows.

Two kinds of failure reach a load. A disk block that fails (I/O error,
checksum, header, another key's slot) is expected: the reader reports it per
block and only that block is given up; why it failed (:data:`CORRUPT`,
:data:`IO_FAILED` or :data:`UNREAD`) tells the scheduler whether its disk
copy goes or stays (the disk core's read-failure rule). Anything *raised*
while a job runs (a bug, an error no one foresaw in the reader or the copy
path) is unexpected: the worker contains it, so that it never reaches vLLM's
model runner, and fails the whole job, as nothing the job wrote can be
trusted. :class:`JobExceptions` logs and counts those; :meth:`Job.whole_error`
is what such a load reports.

Thread-safety: the model runner's thread only (the load pipeline never sees
the book; the worker hands its results over in ``get_finished``).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, TransferResult

from kvtier.connector.load_store_specs import TierLoadSpec
from kvtier.connector.worker.plans import GroupPlan
from kvtier.host.block_copy import CopyPath, CopyPlan
from kvtier.log import get_logger
from kvtier.store.slot import ReadOutcome

if TYPE_CHECKING:
    from kvtier.connector.worker.pipeline import LoadTask

logger = get_logger("connector")

# Distinct causes remembered for the log; past that, every one is a repeat.
MAX_CAUSES = 64

# Why a disk block of a load was not delivered (``LoadTask.failed``, one
# per block of the spec; 0: delivered, or not failed so far).
# Read, and its bytes failed verification (or the slot holds another block):
# the disk copy is dropped.
CORRUPT = 1
# Its read failed (any errno, a batch given up at its deadline, a device's
# short read): the copy stays, counted.
IO_FAILED = 2
# Never read (every bounce part held by reads given up): the copy stays.
UNREAD = 3


def failure_of(outcome: ReadOutcome) -> int:
    """The failure a slot's read outcome (not OK) means."""
    return IO_FAILED if outcome is ReadOutcome.IO_ERROR else CORRUPT


@dataclass
class LoadError:
    """What a failed load could not deliver: ``corrupt``, the disk blocks
    shown bad (failed verification: their copies are dropped);
    ``io_failed``, disk blocks whose read failed (an I/O error: their copies
    stay, counted); ``unread``, disk blocks not delivered for a reason that
    says nothing about their copies (not read, or the job raised: the
    copies stay); and the GPU blocks that were left unfilled. ``whole``: the job
    failed whole (it raised or was given up), so no block of it landed,
    its CPU-tier blocks included (which no key here names)."""

    corrupt: list[bytes] = field(default_factory=list)
    gpu_block_ids: set[int] = field(default_factory=set)
    unread: list[bytes] = field(default_factory=list)
    io_failed: list[bytes] = field(default_factory=list)
    whole: bool = False

    def merge(self, other: LoadError) -> LoadError:
        """One error with everything both name (a job fails once)."""
        return LoadError(
            corrupt=list(dict.fromkeys(self.corrupt + other.corrupt)),
            gpu_block_ids=self.gpu_block_ids | other.gpu_block_ids,
            unread=list(dict.fromkeys(self.unread + other.unread)),
            io_failed=list(dict.fromkeys(self.io_failed + other.io_failed)),
            whole=self.whole or other.whole,
        )


def disk_load_error(
    spec: TierLoadSpec, groups: list[GroupPlan], failed: np.ndarray
) -> LoadError:
    """A load whose disk blocks ``failed`` (per block of the spec: 0, or
    why it failed: :data:`CORRUPT`, :data:`IO_FAILED`, :data:`UNREAD`)
    could not be delivered: their keys by cause and the GPU blocks they were
    to fill, in every KV-cache group."""
    def keys(cause: int) -> list[bytes]:
        return [spec.keys[p] for p in np.flatnonzero(failed == cause)]

    error = LoadError(
        corrupt=keys(CORRUPT), unread=keys(UNREAD), io_failed=keys(IO_FAILED)
    )
    for gp in groups:
        mask = failed[gp.plan.row_ids] != 0
        error.gpu_block_ids.update(int(b) for b in gp.plan.gpu_ids[mask])
    return error


class JobExceptions:
    """The exceptions a worker contained: ``count`` of them, and a log line
    with the traceback for the first of each distinct cause (exception type
    and the line that raised it); repeats go to DEBUG, so a persistent bug
    costs one ERROR line, not one per request."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[tuple[str, str, int]] = set()

    def note(self, exc: Exception, kind: str, job_id: int) -> None:
        self.count += 1
        frames = traceback.extract_tb(exc.__traceback__)
        where = (frames[-1].filename, frames[-1].lineno or 0) if frames else ("", 0)
        cause = (type(exc).__qualname__, *where)
        first = cause not in self._seen and len(self._seen) < MAX_CAUSES
        if first:
            self._seen.add(cause)
        cost = "recomputed" if kind == "load" else "not offloaded"
        logger.log(
            logging.ERROR if first else logging.DEBUG,
            "kvtier: %s job %d raised %s: %s; the job is reported failed, its "
            "blocks are %s%s",
            kind,
            job_id,
            type(exc).__name__,
            exc,
            cost,
            "; repeats of this cause are logged at debug" if first else "",
            exc_info=exc if first else None,
        )


@dataclass
class Job:
    """A submitted job: its transfers still in flight, its task on the load
    pipeline (``task``, until that came back), the bytes it moves and the
    time it took so far (device time of finished transfers, plus the host
    work done for it: CPU-platform copies, disk reads)."""

    job_id: int
    transfers: set[int] = field(default_factory=set)
    nbytes: int = 0
    seconds: float = 0.0
    success: bool = True
    task: LoadTask | None = None
    # A load's specs, for the error of a load that fails whole.
    src: LoadStoreSpec | None = None
    dst: GPULoadStoreSpec | None = None

    def whole_error(self) -> LoadError:
        """Every block of this load failed (it raised, or was given up):
        every disk key as *unread* (their promotion rows are given back
        unwritten; nothing showed the disk copies bad, so they stay for a
        later request) and every GPU block, whether meant for a disk or a CPU
        block (a partial load counts for nothing)."""
        src, dst = self.src, self.dst
        assert src is not None and dst is not None
        keys = [k for k in src.keys if k] if isinstance(src, TierLoadSpec) else []
        return LoadError(
            unread=keys, gpu_block_ids={int(b) for b in dst.block_ids}, whole=True
        )


class JobBook:
    """Jobs in flight and the results and errors of finished ones.

    ``block_bytes``: bytes of one offloaded block per KV-cache group (what
    a transfer of ``n`` blocks moves, for ``TransferResult``).

    Contract:
      - :meth:`copy` submits one transfer for a job on the copy path and
        remembers it; :meth:`landed` credits a landed transfer to its job.
      - :meth:`settle` reports a job once its task is done and no transfer
        of it is in flight (:meth:`take_finished`), else keeps it in flight.
      - :meth:`fail` marks a job failed; a load's errors merge, so a job
        that fails twice reports every block either failure named.
      - Each error is taken once (:meth:`take_load_error`,
        :meth:`take_store_error`)."""

    def __init__(self, block_bytes: list[int]):
        self.block_bytes = block_bytes
        self.jobs: dict[int, Job] = {}  # in flight, by job id
        self._owner: dict[int, Job] = {}  # transfer id -> its job
        self._finished: list[TransferResult] = []
        self._load_errors: dict[int, LoadError] = {}
        self._store_errors: dict[int, list[int]] = {}

    def copy(
        self,
        copies: CopyPath,
        job: Job,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> int | None:
        """Submit ``plan`` on ``copies`` for ``job``: the transfer id, or None
        when nothing was submitted (an empty plan) or the copy already
        landed (a synchronous copy path)."""
        if len(plan) == 0:
            return None
        transfer = copies.submit(area, group, plan, to_host, expedited)
        job.nbytes += len(plan) * self.block_bytes[group]
        if transfer is not None:
            job.transfers.add(transfer)
            self._owner[transfer] = job
        return transfer

    def landed(self, transfer: int, seconds: float) -> None:
        """A transfer landed after ``seconds`` of device time."""
        job = self._owner.pop(transfer, None)
        if job is None:
            return
        job.seconds += seconds
        job.transfers.discard(transfer)
        self.settle(job)

    def fail(self, job: Job, error: LoadError | None = None) -> None:
        """Mark ``job`` failed; ``error``: what a load could not deliver."""
        if error is not None:
            old = self._load_errors.get(job.job_id)
            self._load_errors[job.job_id] = error if old is None else old.merge(error)
        job.success = False

    def fail_store(self, job: Job, rows: list[int]) -> None:
        """Mark a store failed: none of its CPU ``rows`` may be read."""
        self._store_errors[job.job_id] = rows
        job.success = False

    def settle(self, job: Job) -> None:
        """Report the job once its task came back and every transfer
        landed; until then it stays in flight."""
        if job.task is not None or job.transfers:
            self.jobs[job.job_id] = job
            return
        self.jobs.pop(job.job_id, None)
        self._finished.append(
            TransferResult(job.job_id, job.success, job.nbytes, job.seconds)
        )

    def take_finished(self) -> list[TransferResult]:
        """The jobs reported since the last call."""
        done, self._finished = self._finished, []
        return done

    def take_load_error(self, job_id: int) -> LoadError | None:
        return self._load_errors.pop(job_id, None)

    def take_store_error(self, job_id: int) -> list[int] | None:
        return self._store_errors.pop(job_id, None)

    def clear(self) -> None:
        """Forget every job in flight (shutdown)."""
        self.jobs.clear()
        self._owner.clear()
