"""Worker-side adapter: vLLM's OffloadingWorker over kvtier's tiers.

A worker (one TP rank) moves the bytes of every transfer the scheduler
planned:

- stores: KV cache -> CPU-tier rows (the shared host buffer);
- loads: CPU-tier rows -> KV cache, and disk slots -> KV cache. A load is
  one job per request whatever its media: the disk slots are read with one
  ``preadv`` per run of consecutive slots into a bounded bounce area
  (:class:`~kvtier.io.slot_reader.SlotReader`), each block is verified, and
  the verified blocks are scattered from the bounce area straight into the
  KV cache. A block the scheduler gave a promotion row is also copied into
  that CPU row. Prefixes larger than the bounce area are read in chunks;
  with asynchronous (accelerator) copies the area is double buffered, so
  reading a chunk overlaps copying the previous one.

A disk block that fails (I/O error, checksum, header, wrong key) is never
copied anywhere: the job is reported failed with the keys and GPU blocks it
could not fill (:meth:`take_load_error`), and kvtier's connector turns that
into vLLM's load-error path, so the tokens are recomputed. Under kvtier's
connector (``contain_exceptions``) an exception raised while a job is
submitted (a bug, an unforeseen error of the reader or the copy path) never
leaves ``submit_*``: it is logged and counted
(:mod:`kvtier.connector.job_errors`) and fails the whole job, a load with
every one of its blocks, a store with every CPU row it was to fill
(:meth:`take_store_error`).

All work of a job happens inside ``submit_*`` on the calling (model-runner)
thread, with no hand-off per block. The copies between the KV cache and the
host (CPU rows, the bounce area) go through a copy path: on accelerators
vLLM's own transfer code (:class:`~kvtier.connector.device_copy.
DeviceCopies`: batched copies on pooled streams, timed by CUDA events), on
the CPU platform kvtier's word-sized copier (:class:`~kvtier.io.block_copy.
HostCopies`, complete on return). A job may be several transfers (one per
KV-cache group and host area); it is reported done only when every one of
them is. Disk reads hand off to the back end's threads only when a chunk
has several runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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

from kvtier.connector.job_errors import JobExceptions, LoadError, whole_load_error
from kvtier.connector.job_plan import GroupPlan, select_rows, split_by_group
from kvtier.connector.kv_layout import group_views
from kvtier.connector.specs import TierLoadSpec
from kvtier.io.block_copy import (
    CopyPath,
    CopyPlan,
    HostArea,
    HostCopies,
)
from kvtier.io.cpu_buffer import CpuBlockBuffer
from kvtier.io.layout import ReadOutcome
from kvtier.io.slot_reader import SlotReader

logger = logging.getLogger("kvtier.connector")


@dataclass
class _Job:
    """A submitted job: its transfers still in flight, the bytes it moves
    and the time it took so far (device time of finished transfers, plus
    the host work done for it: CPU-platform copies, disk reads)."""

    job_id: int
    transfers: set[int] = field(default_factory=set)
    nbytes: int = 0
    seconds: float = 0.0
    success: bool = True


class TieredOffloadingWorker(OffloadingWorker):
    """Transfers between the KV cache and kvtier's tiers for one rank.

    ``device_copies`` builds the accelerator copy path from the validated
    group views and host areas (the spec passes vLLM's, see
    :mod:`kvtier.connector.device_copy`); without it the KV cache must live
    in host memory (the CPU platform) and kvtier's own copier runs.
    Construction validates the KV cache (:mod:`kvtier.connector.kv_layout`)
    and owns nothing until it returns: the caller releases ``cpu_buffer``
    and ``reader`` if it raises.

    ``contain_exceptions``: whether ``submit_*`` turn an exception into a
    failed job (see the module doc) instead of raising it. Only kvtier's
    connector handles a failed job; vLLM's stock connector asserts success
    (``python -O`` would drop that check), so the spec sets it only under
    kvtier's connector."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_buffer: CpuBlockBuffer,
        blocks_per_chunk: int,
        reader: SlotReader | None = None,
        device_copies: Callable[..., CopyPath] | None = None,
        contain_exceptions: bool = False,
    ):
        views = group_views(
            kv_caches,
            cpu_buffer.block_bytes,
            blocks_per_chunk,
            device_kind="cpu" if device_copies is None else None,
        )
        areas = [HostArea("cpu", cpu_buffer.tensor)]
        if reader is not None:
            areas.append(
                HostArea("disk", torch.from_numpy(reader.rows), pinned=reader.pinned)
            )
        make = HostCopies if device_copies is None else device_copies
        self._set_up(
            make(views, areas, blocks_per_chunk),
            cpu_buffer,
            blocks_per_chunk,
            reader,
            [sum(v.shape[1] for v in g) for g in views],
        )
        self.contain_exceptions = contain_exceptions

    def _set_up(
        self,
        copies: CopyPath,
        cpu_buffer: Any,
        blocks_per_chunk: int,
        reader: SlotReader | None,
        block_bytes: list[int],
    ) -> None:
        """The state every worker shares, whatever its host rows: the copy
        path, what ``shutdown`` closes (``cpu_buffer``), the disk reader,
        the bytes of one offloaded block per KV-cache group, and the job
        bookkeeping. Subclasses with other host rows call it instead of
        ``__init__``."""
        self.copies = copies
        self.cpu_buffer = cpu_buffer
        self.blocks_per_chunk = blocks_per_chunk
        self.reader = reader
        self.block_bytes = block_bytes
        self._jobs: dict[int, _Job] = {}  # in flight, by job id
        self._owner: dict[int, _Job] = {}  # transfer id -> its job
        self._finished: list[TransferResult] = []
        self._load_errors: dict[int, LoadError] = {}
        self._store_errors: dict[int, list[int]] = {}
        self.contain_exceptions = False
        self.exceptions = JobExceptions()
        # Transfers still reading each half of the bounce area: a disk read
        # into a half waits for them, whichever job they belong to. With
        # asynchronous copies the halves alternate, so one chunk's read
        # overlaps the previous chunk's copies (double buffering).
        self._bounce_readers: list[set[int]] = [set(), set()]
        self._next_half = 0

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
        job = _Job(job_id)
        rows = np.asarray(dst_spec.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
        try:
            for gp in split_by_group(src_spec, len(rows), self.blocks_per_chunk):
                plan = CopyPlan(gp.plan.gpu_ids, rows[gp.plan.row_ids], gp.plan.sub_ids)
                self._copy(job, "cpu", gp.group, plan, to_host=True)
        except Exception as exc:
            if not self.contain_exceptions:
                raise
            self.exceptions.note(exc, "store", job_id)
            self._store_errors[job_id] = [int(r) for r in rows]
            job.success = False
        self._settle(job, started)
        return True

    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Fill the job's GPU blocks from CPU rows and disk slots; returns
        True.

        A disk block that fails is left unfilled. With
        ``contain_exceptions``, an exception raised on the way is logged,
        counted (``exceptions``) and fails every block of the job
        (:func:`~kvtier.connector.job_errors.whole_load_error`); without, it
        propagates. A failed job is reported once the copies it had already
        submitted landed, and :meth:`take_load_error` names the keys and
        GPU blocks it could not deliver."""
        started = time.perf_counter()
        job = _Job(job_id)
        try:
            error = self._load(job, src_spec, dst_spec, expedited)
        except Exception as exc:
            if not self.contain_exceptions:
                raise
            self.exceptions.note(exc, "load", job_id)
            error = whole_load_error(src_spec, dst_spec)
        if error is not None:
            self._load_errors[job_id] = error
            job.success = False
        self._settle(job, started)
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        for transfer, seconds in self.copies.poll().items():
            for readers in self._bounce_readers:
                readers.discard(transfer)
            job = self._owner.pop(transfer, None)
            if job is None:
                continue
            job.seconds += seconds
            job.transfers.discard(transfer)
            if not job.transfers:
                self._finish(job)
        done, self._finished = self._finished, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        transfers: set[int] = set()
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                transfers |= job.transfers
        if transfers:
            self.copies.wait(transfers)

    @override
    def shutdown(self) -> None:
        try:
            # Drains every transfer still in flight before the host areas
            # they read or write go away.
            self.copies.shutdown()
        finally:
            self._jobs.clear()
            self._owner.clear()
            if self.reader is not None:
                self.reader.close()
            self.cpu_buffer.close()

    # ---------------------------------------------------------------- extras

    def take_load_error(self, job_id: int) -> LoadError | None:
        """What a job reported failed by ``get_finished`` could not load."""
        return self._load_errors.pop(job_id, None)

    def take_store_error(self, job_id: int) -> list[int] | None:
        """The CPU rows of a store reported failed by ``get_finished``: the
        manager must give them back unwritten (``note_worker_report``)."""
        return self._store_errors.pop(job_id, None)

    # ------------------------------------------------------------- internals

    def _load(
        self,
        job: _Job,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool,
    ) -> LoadError | None:
        # ``expedited`` (vLLM >= 0.33): the load is waited on within the
        # step; on accelerators it runs on its own streams.
        if isinstance(src_spec, TierLoadSpec):
            slots, on_disk = src_spec.block_ids, src_spec.on_disk
        else:  # a plain row spec: every block from the CPU tier
            slots = np.asarray(src_spec.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
            on_disk = np.zeros(len(slots), dtype=np.bool_)
        groups = split_by_group(dst_spec, len(slots), self.blocks_per_chunk)
        for gp in groups:
            mask = ~on_disk[gp.plan.row_ids]
            if mask.any():
                plan = select_rows(gp.plan, mask, slots[gp.plan.row_ids[mask]])
                self._copy(
                    job, "cpu", gp.group, plan, to_host=False, expedited=expedited
                )
        if not on_disk.any():
            return None
        assert isinstance(src_spec, TierLoadSpec)
        return self._load_from_disk(job, src_spec, groups, expedited)

    def _copy(
        self,
        job: _Job,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> int | None:
        if len(plan) == 0:
            return None
        transfer = self.copies.submit(area, group, plan, to_host, expedited)
        job.nbytes += len(plan) * self.block_bytes[group]
        if transfer is not None:
            job.transfers.add(transfer)
            self._owner[transfer] = job
        return transfer

    def _settle(self, job: _Job, started: float) -> None:
        # As vLLM measures: device transfers count their CUDA-event time
        # when they finish; host work counts its wall time (the whole job
        # on the CPU platform, the disk reads on accelerators).
        if self.copies.synchronous:
            job.seconds += time.perf_counter() - started
        if job.transfers:
            self._jobs[job.job_id] = job
        else:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._jobs.pop(job.job_id, None)
        self._finished.append(
            TransferResult(job.job_id, job.success, job.nbytes, job.seconds)
        )

    def _load_from_disk(
        self,
        job: _Job,
        spec: TierLoadSpec,
        groups: list[GroupPlan],
        expedited: bool,
    ) -> LoadError | None:
        """Read, verify and scatter a job's disk blocks, chunk by chunk."""
        positions = np.flatnonzero(spec.on_disk)
        failed = np.zeros(len(spec.block_ids), dtype=np.bool_)
        reader = self.reader
        if reader is None:
            # No disk tier on this worker: nothing can be read.
            failed[positions] = True
            return self._error(spec, groups, failed)
        bounce_row = np.full(len(spec.block_ids), -1, dtype=np.int64)
        halves = 1 if self.copies.synchronous or reader.capacity < 2 else 2
        per_read = reader.capacity // halves
        for start in range(0, len(positions), per_read):
            half = self._next_half % halves
            self._next_half = half + 1
            readers = self._bounce_readers[half]
            if readers:
                # This half is reused: copies still reading it (an earlier
                # chunk, or an earlier job) must have left it.
                self.copies.wait(readers)
                readers.clear()
            chunk = positions[start : start + per_read]
            read_started = time.perf_counter()
            results = reader.read(
                [(int(spec.block_ids[p]), spec.keys[p]) for p in chunk],
                first_row=half * per_read,
            )
            if not self.copies.synchronous:
                job.seconds += time.perf_counter() - read_started
            bounce_row[:] = -1
            for p, result in zip(chunk, results):
                if result.outcome is ReadOutcome.OK:
                    bounce_row[p] = result.row
                    row = int(spec.promote_rows[p])
                    if row >= 0:
                        self.cpu_buffer.array[row] = reader.rows[result.row]
                else:
                    failed[p] = True
            for gp in groups:
                rows = bounce_row[gp.plan.row_ids]
                mask = rows >= 0
                if mask.any():
                    plan = select_rows(gp.plan, mask, rows[mask])
                    transfer = self._copy(
                        job, "disk", gp.group, plan, to_host=False, expedited=expedited
                    )
                    if transfer is not None:
                        readers.add(transfer)
        if failed.any():
            return self._error(spec, groups, failed)
        return None

    @staticmethod
    def _error(
        spec: TierLoadSpec, groups: list[GroupPlan], failed: np.ndarray
    ) -> LoadError:
        error = LoadError(keys=[spec.keys[p] for p in np.flatnonzero(failed)])
        for gp in groups:
            mask = failed[gp.plan.row_ids]
            error.gpu_block_ids.update(int(b) for b in gp.plan.gpu_ids[mask])
        return error
