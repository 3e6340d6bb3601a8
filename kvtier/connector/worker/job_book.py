"""The worker's jobs in flight: their transfers, their failures, their report.

A job (one ``submit_store`` or ``submit_load``) may be several transfers on
the copy path (one per KV-cache group and host area, one per read batch)
plus, for a load, host work on the load thread. :class:`JobBook` tracks
which transfers each job still waits for and reports the job to vLLM (a
``TransferResult``) once nothing of it is in flight, with the time and bytes
it took and whether it succeeded. What a failed job could not do is kept
for the connector: a load's :class:`~kvtier.connector.worker.job_errors.LoadError`
(the keys and GPU blocks it left unfilled), a store's CPU rows.

Thread-safety: the model runner's thread only (the load thread never sees
the book; the worker hands its results over in ``get_finished``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, TransferResult

from kvtier.connector.worker.job_errors import LoadError, whole_load_error
from kvtier.connector.worker.load_task import LoadTask
from kvtier.host.block_copy import CopyPath, CopyPlan


@dataclass
class Job:
    """A submitted job: its transfers still in flight, its work on the load
    thread (``task``, until that finished), the bytes it moves and the time
    it took so far (device time of finished transfers, plus the host work
    done for it: CPU-platform copies, disk reads)."""

    job_id: int
    transfers: set[int] = field(default_factory=set)
    nbytes: int = 0
    seconds: float = 0.0
    success: bool = True
    task: LoadTask | None = None
    deadline: float = 0.0
    # A load's specs, for the error of a load that fails whole.
    src: LoadStoreSpec | None = None
    dst: GPULoadStoreSpec | None = None

    def whole_error(self) -> LoadError:
        """Every block of this load failed."""
        assert self.src is not None and self.dst is not None
        return whole_load_error(self.src, self.dst)


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
        """Report the job once its host work finished and every transfer
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

    def empty(self) -> bool:
        """No job and no transfer in flight."""
        return not self.jobs and not self._owner

    def clear(self) -> None:
        """Forget every job in flight (shutdown)."""
        self.jobs.clear()
        self._owner.clear()
