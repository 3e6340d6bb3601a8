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
  that CPU row. Prefixes larger than the bounce area are read in chunks.

A disk block that fails (I/O error, checksum, header, wrong key) is never
copied anywhere: the job is reported failed with the keys and GPU blocks it
could not fill (:meth:`take_load_error`), and kvtier's connector turns that
into vLLM's load-error path, so the tokens are recomputed.

All work of a job happens inside ``submit_*`` on the calling (model-runner)
thread, with no hand-off per block: on the CPU platform the copies complete
there; on CUDA they are queued on a side stream and finish when all their
events fired. Disk reads hand off to the back end's threads only when a
chunk has several runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

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

from kvtier.connector.specs import TierLoadSpec
from kvtier.io.block_copy import BlockCopier, CopyPlan, plan_copy
from kvtier.io.cpu_buffer import CpuBlockBuffer
from kvtier.io.disk_store import ReadOutcome
from kvtier.io.slot_reader import SlotReader

logger = logging.getLogger("kvtier.connector")


@dataclass
class LoadError:
    """What a failed load could not deliver: the keys of the disk blocks
    that failed, and the GPU blocks that were left unfilled."""

    keys: list[bytes] = field(default_factory=list)
    gpu_block_ids: set[int] = field(default_factory=set)


@dataclass
class _InFlight:
    job_id: int
    events: list[torch.cuda.Event]
    nbytes: int
    started: float
    success: bool


@dataclass
class _GroupPlan:
    """One KV-cache group's part of a job: GPU blocks and, per block, the
    position of its offloaded block in the job's spec."""

    group: int
    plan: CopyPlan  # row_ids are spec positions


def _split_by_group(
    gpu: GPULoadStoreSpec, num_rows: int, blocks_per_chunk: int
) -> list[_GroupPlan]:
    """Map every GPU block of a job onto its offloaded block's position.

    vLLM lists a job's GPU blocks group by group (``group_sizes``), each
    group's blocks logically consecutive from ``block_indices[g]``, and the
    offloaded blocks (rows) in the same group order."""
    gpu_ids = gpu.block_ids
    group_sizes = list(gpu.group_sizes) if gpu.group_sizes else [len(gpu_ids)]
    block_indices = list(gpu.block_indices) if gpu.block_indices else [0]
    plans: list[_GroupPlan] = []
    g_start = r_start = 0
    for group, (size, first) in enumerate(zip(group_sizes, block_indices)):
        if size == 0:
            continue
        n_rows = (first + size - 1) // blocks_per_chunk - first // blocks_per_chunk + 1
        positions = np.arange(r_start, r_start + n_rows, dtype=np.int64)
        plans.append(
            _GroupPlan(
                group,
                plan_copy(
                    gpu_ids[g_start : g_start + size],
                    positions,
                    blocks_per_chunk,
                    first,
                ),
            )
        )
        g_start += size
        r_start += n_rows
    if r_start != num_rows:
        raise ValueError(f"job lists {num_rows} offloaded blocks, GPU spec {r_start}")
    return plans


def _select(plan: CopyPlan, mask: np.ndarray, rows: np.ndarray) -> CopyPlan:
    return CopyPlan(plan.gpu_ids[mask], rows, plan.sub_ids[mask])


class TieredOffloadingWorker(OffloadingWorker):
    """Transfers between the KV cache and kvtier's tiers for one rank."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_buffer: CpuBlockBuffer,
        blocks_per_chunk: int,
        reader: SlotReader | None = None,
    ):
        self.cpu_buffer = cpu_buffer
        self.blocks_per_chunk = blocks_per_chunk
        self.reader = reader
        # One copier per KV-cache group and source: a group's rows hold that
        # group's tensors (layers sharing memory appear once), unpadded
        # pages only. The disk copiers read the bounce area's payloads.
        group_views = [_group_views(kv_caches, refs) for refs in kv_caches.group_data_refs]
        self.copiers = [
            BlockCopier(views, cpu_buffer.tensor, blocks_per_chunk)
            for views in group_views
        ]
        self.disk_copiers: list[BlockCopier] = []
        if reader is not None:
            bounce_rows = torch.from_numpy(reader.rows)
            self.disk_copiers = [
                BlockCopier(views, bounce_rows, blocks_per_chunk)
                for views in group_views
            ]
        self._finished: list[TransferResult] = []
        self._in_flight: list[_InFlight] = []
        self._load_errors: dict[int, LoadError] = {}

    # ------------------------------------------------------------- contract

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        started = time.perf_counter()
        rows = np.asarray(dst_spec.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
        events: list[torch.cuda.Event] = []
        nbytes = 0
        for gp in _split_by_group(src_spec, len(rows), self.blocks_per_chunk):
            copier = self.copiers[gp.group]
            plan = CopyPlan(gp.plan.gpu_ids, rows[gp.plan.row_ids], gp.plan.sub_ids)
            self._note_event(events, copier.to_cpu(plan))
            nbytes += len(plan) * copier.block_bytes
        self._settle(job_id, events, nbytes, started, success=True)
        return True

    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # ``expedited`` (vLLM >= 0.33): the load is waited on within the
        # step. kvtier's loads already complete their disk reads here.
        started = time.perf_counter()
        if isinstance(src_spec, TierLoadSpec):
            slots, on_disk = src_spec.block_ids, src_spec.on_disk
        else:  # a plain row spec: every block from the CPU tier
            slots = np.asarray(src_spec.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
            on_disk = np.zeros(len(slots), dtype=np.bool_)
        groups = _split_by_group(dst_spec, len(slots), self.blocks_per_chunk)
        events: list[torch.cuda.Event] = []
        nbytes = 0
        for gp in groups:
            mask = ~on_disk[gp.plan.row_ids]
            if mask.any():
                copier = self.copiers[gp.group]
                plan = _select(gp.plan, mask, slots[gp.plan.row_ids[mask]])
                self._note_event(events, copier.to_gpu(plan))
                nbytes += len(plan) * copier.block_bytes
        success = True
        if on_disk.any():
            assert isinstance(src_spec, TierLoadSpec)
            moved, error = self._load_from_disk(src_spec, groups, events)
            nbytes += moved
            if error is not None:
                self._load_errors[job_id] = error
                success = False
        self._settle(job_id, events, nbytes, started, success)
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        still: list[_InFlight] = []
        for job in self._in_flight:
            if all(event.query() for event in job.events):
                self._finished.append(
                    TransferResult(
                        job.job_id,
                        job.success,
                        job.nbytes,
                        time.perf_counter() - job.started,
                    )
                )
            else:
                still.append(job)
        self._in_flight = still
        done, self._finished = self._finished, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        for job in self._in_flight:
            if job.job_id in job_ids:
                for event in job.events:
                    event.synchronize()

    @override
    def shutdown(self) -> None:
        for job in self._in_flight:
            for event in job.events:
                event.synchronize()
        self._in_flight.clear()
        # Drop the views into the buffers before unmapping them.
        self.copiers = []
        self.disk_copiers = []
        if self.reader is not None:
            self.reader.close()
        self.cpu_buffer.close()

    # ---------------------------------------------------------------- extras

    def take_load_error(self, job_id: int) -> LoadError | None:
        """What a job reported failed by ``get_finished`` could not load."""
        return self._load_errors.pop(job_id, None)

    # ------------------------------------------------------------- internals

    @staticmethod
    def _note_event(
        events: list[torch.cuda.Event],
        event: torch.cuda.Event | list[torch.cuda.Event] | None,
    ) -> None:
        # A copier returns its stream's event (CUDA), several (one per
        # tensor's stream), or None (copies already complete).
        if isinstance(event, list):
            events.extend(event)
        elif event is not None:
            events.append(event)

    def _settle(
        self,
        job_id: int,
        events: list[torch.cuda.Event],
        nbytes: int,
        started: float,
        success: bool,
    ) -> None:
        # A job is done when every group's and every tensor's copy landed:
        # each copier runs on its own stream, so every event counts.
        if events:
            self._in_flight.append(_InFlight(job_id, events, nbytes, started, success))
        else:
            self._finished.append(
                TransferResult(job_id, success, nbytes, time.perf_counter() - started)
            )

    def _load_from_disk(
        self,
        spec: TierLoadSpec,
        groups: list[_GroupPlan],
        events: list[torch.cuda.Event],
    ) -> tuple[int, LoadError | None]:
        """Read, verify and scatter a job's disk blocks, chunk by chunk."""
        positions = np.flatnonzero(spec.on_disk)
        failed = np.zeros(len(spec.block_ids), dtype=np.bool_)
        reader = self.reader
        if reader is None:
            # No disk tier on this worker: nothing can be read.
            failed[positions] = True
            return 0, self._error(spec, groups, failed)
        bounce_row = np.full(len(spec.block_ids), -1, dtype=np.int64)
        nbytes = 0
        for start in range(0, len(positions), reader.capacity):
            if events and start:
                # The next chunk reuses the bounce area: its copies must
                # have left it (CUDA only; CPU copies are already done).
                for event in events:
                    event.synchronize()
            chunk = positions[start : start + reader.capacity]
            results = reader.read(
                [(int(spec.block_ids[p]), spec.keys[p]) for p in chunk]
            )
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
                    copier = self.disk_copiers[gp.group]
                    plan = _select(gp.plan, mask, rows[mask])
                    self._note_event(events, copier.to_gpu(plan))
                    nbytes += len(plan) * copier.block_bytes
        if failed.any():
            return nbytes, self._error(spec, groups, failed)
        return nbytes, None

    @staticmethod
    def _error(
        spec: TierLoadSpec, groups: list[_GroupPlan], failed: np.ndarray
    ) -> LoadError:
        error = LoadError(keys=[spec.keys[p] for p in np.flatnonzero(failed)])
        for gp in groups:
            mask = failed[gp.plan.row_ids]
            error.gpu_block_ids.update(int(b) for b in gp.plan.gpu_ids[mask])
        return error


def _group_views(kv_caches: CanonicalKVCaches, refs) -> list[torch.Tensor]:
    """Byte views ``(num_blocks, unpadded page)`` of one group's tensors,
    each tensor once (layers sharing memory appear once)."""
    seen: set[int] = set()
    views: list[torch.Tensor] = []
    for ref in refs:
        if ref.tensor_idx in seen:
            continue
        seen.add(ref.tensor_idx)
        tensor = kv_caches.tensors[ref.tensor_idx].tensor
        as_bytes = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        as_bytes = as_bytes.reshape(as_bytes.shape[0], -1)
        views.append(as_bytes[:, : ref.page_size_bytes])
    return views
