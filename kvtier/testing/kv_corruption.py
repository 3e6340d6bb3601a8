"""Wrong bytes in the KV cache after a load: the negative control of every
load path.

An end-to-end test that compares greedy outputs with a no-offload run
proves a load path only if wrong loaded bytes would have changed those
outputs. :class:`LoadCorruptor` makes them wrong where every path ends,
whatever moved the bytes (the CPU platform's copy, vLLM's transfer handler
from CPU rows or from the host bounce area, the device staging area's
scatter): when the worker reports a load job finished
(``OffloadingWorker.get_finished``, on the model runner's thread, before
the scheduler can run the request that waits for it), it flips bits in
every GPU block the job filled, through the KV cache's own tensors (the
block views vLLM built the worker with), with torch operations queued on
the calling thread's current stream, so it works on any device.

The flip: bit 7 of every odd byte of a block's page. For float32 that is
the sign and a mantissa bit of every element, for bf16 and fp16 the sign,
for 8-bit types the sign of every other element; finite values stay
finite, and keys and values change sign, which changes the attention of
every token that reads them.

Asynchronous loads only: vLLM (>= 0.33) reports a synchronous load
(``sync_load_budget_bytes``) after the step that already read its blocks.
A job that failed (some block recomputed) is left alone.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from kvtier.connector.worker.kv_layout import group_views
from kvtier.connector.worker.worker import TieredOffloadingWorker


def _group_block_ids(spec: GPULoadStoreSpec) -> list[list[int]]:
    """The spec's GPU block ids, split by KV-cache group."""
    ids = list(spec.block_ids)
    sizes = list(spec.group_sizes) if spec.group_sizes else [len(ids)]
    out, start = [], 0
    for size in sizes:
        out.append(ids[start : start + size])
        start += size
    return out


def flip_blocks(views: list[torch.Tensor], block_ids: list[int]) -> None:
    """Flip bit 7 of every odd byte of blocks ``block_ids`` in each byte
    view ``(num_blocks, page_bytes)`` of ``views`` (one KV-cache group's
    tensors), in place."""
    if not block_ids:
        return
    for view in views:
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=view.device)
        mask = torch.zeros(view.shape[1], dtype=torch.uint8, device=view.device)
        mask[1::2] = 0x80
        view[ids] = torch.bitwise_xor(view[ids], mask)


class LoadCorruptor:
    """Flips bits in what each finished load put into the KV cache (see the
    module doc), while :attr:`enabled`.

    :meth:`install` patches :class:`TieredOffloadingWorker` (construction,
    ``submit_load``, ``get_finished``) for the life of ``monkeypatch``;
    install it before the engine is built. It counts what it changed:
    :attr:`jobs` and :attr:`blocks` (GPU blocks, over all groups). Called
    on the model runner's thread only, like the worker."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.jobs = 0
        self.blocks = 0
        self._views: dict[int, list[list[torch.Tensor]]] = {}  # per worker
        self._loads: dict[tuple[int, int], GPULoadStoreSpec] = {}

    def install(self, monkeypatch: Any) -> LoadCorruptor:
        cls = TieredOffloadingWorker
        init, submit_load, get_finished = (
            cls.__init__,
            cls.submit_load,
            cls.get_finished,
        )
        corruptor = self

        def recording_init(worker, kv_caches, cpu_buffer, *args, **kwargs):
            init(worker, kv_caches, cpu_buffer, *args, **kwargs)
            # The KV cache's own memory, as byte views per group (the
            # worker validated the layout above).
            corruptor._views[id(worker)] = group_views(
                kv_caches, cpu_buffer.block_bytes, worker.blocks_per_chunk
            )

        def recording_submit_load(worker, job_id, src_spec, dst_spec, *args, **kwargs):
            corruptor._loads[(id(worker), job_id)] = dst_spec
            return submit_load(worker, job_id, src_spec, dst_spec, *args, **kwargs)

        def corrupting_get_finished(worker):
            results = get_finished(worker)
            for result in results:
                dst = corruptor._loads.pop((id(worker), result.job_id), None)
                if dst is not None and result.success and corruptor.enabled:
                    corruptor._corrupt(worker, dst)
            return results

        monkeypatch.setattr(cls, "__init__", recording_init)
        monkeypatch.setattr(cls, "submit_load", recording_submit_load)
        monkeypatch.setattr(cls, "get_finished", corrupting_get_finished)
        return self

    def _corrupt(self, worker: TieredOffloadingWorker, dst: GPULoadStoreSpec) -> None:
        views = self._views[id(worker)]
        for group, block_ids in enumerate(_group_block_ids(dst)):
            flip_blocks(views[group], block_ids)
            self.blocks += len(block_ids)
        self.jobs += 1
