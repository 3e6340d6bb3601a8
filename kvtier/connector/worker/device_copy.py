"""GPU <-> host copies on accelerators, through vLLM's own transfer code.

On CUDA (and the other platforms vLLM's CPU offloading supports) kvtier does
not copy blocks itself: every transfer between the KV cache and a host area
goes through vLLM's ``SingleDirectionOffloadingHandler``
(``vllm/v1/kv_offload/cpu/gpu_worker.py``), the code behind vLLM's stock CPU
offloading. It builds one batch of copy descriptors per transfer and runs it
as one ``swap_blocks_batch`` call (the copy engine, or vLLM's Triton kernel
for small pages from pinned memory) on a pooled stream, ordered after the
model's stream and after the handler's previous transfer, timed by CUDA
events. kvtier only lays its host areas out as vLLM's handler expects:

- the CPU tier: one row per offloaded block, a group's tensors one after
  the other (``tensor 0: blocks_per_chunk pages | tensor 1: ... | pad``), so
  tensor ``i`` of a group is a strided ``(rows, blocks_per_chunk * page_i)``
  view whose row stride is the row size — vLLM's pointer arithmetic
  (``base + row * stride(0) + sub_block * page``) reads it as its own;
- the disk bounce area: the same layout inside each slot's payload.

A group's tensors sit at different offsets in different groups' rows, so
there is one handler per (host area, direction, KV-cache group), each seeing
one group; vLLM orders the transfers of one handler, and a kvtier job is
done when every one of its transfers is (:class:`DeviceCopies` tracks them
by transfer id). Loads and stores never share a handler (nor a stream), and
vLLM 0.33's expedited loads get handlers of their own, as in vLLM's worker.

The host areas are page-locked with vLLM's ``host_register`` in bounded
pieces, rolled back on a failure (pinning is an optimisation: the copies are
correct on pageable memory, and vLLM then avoids its Triton kernel).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister

from kvtier.host.block_copy import BlockCopier, CopyPlan, HostArea
from kvtier.log import get_logger

logger = get_logger("connector")

# Same bound as vLLM's pin_mmap_region: the driver limits one registration.
MAX_REGISTER_BYTES = 64 * 1024**3

# Host areas (and their registrations) of a DeviceCopies whose shutdown
# failed: kept mapped and registered for the life of the process.
_HELD_AREAS: list[tuple[dict, list[int]]] = []


def pin_host_area(array: np.ndarray) -> list[int]:
    """Page-lock ``array``'s memory in pieces with vLLM's ``host_register``.

    Returns the registered addresses (for :func:`unpin_host_area`); empty if
    any piece failed, in which case the pieces already registered are
    released again and the area stays pageable."""
    base, total = array.ctypes.data, array.nbytes
    addresses: list[int] = []
    for offset in range(0, total, MAX_REGISTER_BYTES):
        address = base + offset
        if host_register(address, min(MAX_REGISTER_BYTES, total - offset)):
            addresses.append(address)
            continue
        logger.warning(
            "kvtier: page-locking %d bytes of host memory failed at offset %d; "
            "transfers stay correct but use pageable memory",
            total,
            offset,
        )
        unpin_host_area(addresses)
        return []
    return addresses


def unpin_host_area(addresses: list[int]) -> None:
    for address in reversed(addresses):
        host_unregister(address)
    addresses.clear()


def vllm_block_spec(
    plan: CopyPlan, blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """A kvtier :class:`CopyPlan` as vLLM's handler takes it: the GPU blocks,
    the row of each chunk they fall into, and the sub-blocks skipped in the
    first chunk.

    vLLM enumerates sub-blocks contiguously from the skip: every chunk but
    the first and the last is whole. kvtier's plans always are (a chunk is
    on one medium, and only a request's first and last chunk are partial);
    anything else is refused rather than copied wrong."""
    n = len(plan)
    skip = int(plan.sub_ids[0]) if n else 0
    flat = skip + np.arange(n, dtype=np.int64)
    chunk = flat // blocks_per_chunk
    if not (
        np.array_equal(plan.sub_ids, flat % blocks_per_chunk)
        and np.array_equal(plan.row_ids, plan.row_ids[np.searchsorted(chunk, chunk)])
    ):
        raise ValueError("copy plan is not contiguous in its chunks")
    starts = np.flatnonzero(np.r_[True, chunk[1:] != chunk[:-1]]) if n else []
    return plan.gpu_ids, plan.row_ids[starts], skip


class DeviceCopies:
    r"""A worker's :class:`~kvtier.host.block_copy.CopyPath` on accelerators:
    transfers between its KV cache and its host areas through vLLM's
    handlers.

    ``group_views[g]`` are group ``g``'s KV-cache tensors as byte views
    ``(num_gpu_blocks, page_bytes)`` on the device (strided over padded
    pages), each tensor once. :meth:`submit` queues one transfer and returns
    its id; :meth:`poll` reports the transfers that completed with their
    device time; :meth:`wait` blocks until the given ones completed.
    An area whose rows live on the device (the staging area of
    ``disk_load_path: device``) is copied into the KV cache by kvtier's
    :class:`~kvtier.host.block_copy.BlockCopier` on a stream of its own,
    ordered after the current stream and timed by CUDA events, since vLLM's
    handlers copy between host and device only.

    Every transfer waits for the work queued on the calling thread's current
    stream (vLLM's handlers do, and so does the scatter): a worker keeps one
    instance per thread, the model runner's (stores, CPU-tier rows) and its
    load thread's (the disk area). The load thread runs on a stream of its
    own that waits (:meth:`follow`) for a :meth:`mark` taken on the model
    runner's thread at ``submit_load``, so its copies still land after the model's
    earlier work on their blocks (vLLM: loads wait for pending writes,
    zeroing included, to their destination blocks). Each instance is called
    from one thread only."""

    synchronous = False  # transfers finish later, reported by poll()

    def __init__(
        self,
        group_views: list[list[torch.Tensor]],
        areas: list[HostArea],
        blocks_per_chunk: int,
    ):
        if any(v.device.type == "cpu" for views in group_views for v in views):
            raise ValueError("DeviceCopies copies a KV cache on an accelerator")
        self.group_views = group_views
        self.blocks_per_chunk = blocks_per_chunk
        # Page-lock what is not yet (the CPU tier's shared mapping; the
        # bounce area comes from torch's pinned allocator), released again
        # in shutdown() after the last transfer drained.
        self._registered: list[int] = []
        self.areas: dict[str, HostArea] = {}
        # Areas in device memory: one copier per group (see the class doc).
        self._scatter: dict[str, list[BlockCopier]] = {}
        self._stream: torch.Stream | None = None
        self._events: dict[int, tuple[torch.Event, torch.Event]] = {}
        for area in areas:
            if area.rows.device.type != "cpu":
                self._scatter[area.name] = [
                    BlockCopier(views, area.rows, blocks_per_chunk)
                    for views in group_views
                ]
                self.areas[area.name] = area
                continue
            if not area.pinned and area.rows.is_contiguous():
                addresses = pin_host_area(area.rows.numpy())
                self._registered += addresses
                area = HostArea(area.name, area.rows, pinned=bool(addresses))
            self.areas[area.name] = area
        self._handlers: dict[
            tuple[str, bool, int, bool], SingleDirectionOffloadingHandler
        ] = {}
        self._ids = itertools.count(1)
        # Transfers on vLLM's handlers not yet reported by poll(): with none,
        # poll() returns at once (it runs every engine step).
        self._on_handlers = 0

    def submit(
        self,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> int:
        """Queue the copies of ``plan`` (group ``group``'s GPU blocks <-> rows
        of ``area``); returns the transfer id."""
        if area in self._scatter:
            return self._submit_scatter(area, group, plan, to_host)
        gpu_ids, rows, skip = vllm_block_spec(plan, self.blocks_per_chunk)
        gpu = GPULoadStoreSpec(gpu_ids.tolist(), [len(gpu_ids)], [skip])
        host = CPULoadStoreSpec(rows.tolist())
        handler = self._handler(area, to_host, group, expedited and not to_host)
        transfer = next(self._ids)
        src, dst = (gpu, host) if to_host else (host, gpu)
        if not handler.transfer_async(transfer, src, dst):
            raise RuntimeError(f"kvtier: vLLM refused transfer {transfer}")
        self._on_handlers += 1
        return transfer

    def poll(self) -> dict[int, float]:
        """Completed transfers since the last call: id -> device seconds."""
        done: dict[int, float] = {}
        if self._on_handlers:
            for handler in self._handlers.values():
                for result in handler.get_finished():
                    done[result.job_id] = result.transfer_time or 0.0
            self._on_handlers -= len(done)
        for transfer, (start, end) in list(self._events.items()):
            if end.query():
                del self._events[transfer]
                done[transfer] = start.elapsed_time(end) / 1000
        return done

    @property
    def device(self) -> torch.device:
        """The KV cache's device (a thread issuing copies runs on a stream
        of it)."""
        return self.group_views[0][0].device

    def mark(self) -> torch.Event:
        """A point in the calling thread's stream (see :meth:`follow`):
        recording an event costs microseconds and never waits."""
        event = torch.Event(device=self.device)
        event.record(current_platform.current_stream(self.device))
        return event

    def follow(self, mark: torch.Event) -> None:
        """Order this thread's later transfers after ``mark``: its current
        stream waits for the event (on the device, not on the host)."""
        current_platform.current_stream(self.device).wait_event(mark)

    def drain(self) -> None:
        """Return once every transfer submitted so far completed; from any
        thread (the device's work, not the handlers' bookkeeping, which
        stays this path's thread's: they are reported by its next poll)."""
        torch.accelerator.synchronize(self.device)

    def wait(self, transfers: set[int]) -> None:
        for handler in self._handlers.values():
            handler.wait(transfers)
        for transfer in transfers & self._events.keys():
            self._events[transfer][1].synchronize()

    def shutdown(self) -> None:
        """Drain every handler (vLLM's shutdown waits for its transfers)."""
        errors: list[BaseException] = []
        for handler in self._handlers.values():
            try:
                handler.shutdown()
            except Exception as exc:  # drain the others before reporting
                errors.append(exc)
        self._handlers.clear()
        self._on_handlers = 0
        if self._stream is not None:
            self._stream.synchronize()
        self._events.clear()
        self._scatter.clear()
        self.group_views = []
        if errors:
            # Never unlock memory a stuck copy may still touch, nor let it be
            # unmapped while registered (a later mapping at its addresses
            # would meet the stale registration): the areas stay referenced
            # until the process exits, a deliberate leak.
            _HELD_AREAS.append((self.areas, self._registered))
            self.areas = {}
            raise errors[0]
        self.areas = {}
        unpin_host_area(self._registered)

    def _submit_scatter(self, area: str, group: int, plan: CopyPlan, to_host: bool) -> int:
        """Device staging rows -> KV cache (see the class doc)."""
        if to_host:
            raise ValueError(f"the device area {area!r} is only copied from")
        copier = self._scatter[area][group]
        device = copier.kv[0].device
        if self._stream is None:
            self._stream = current_platform.Stream(device)
        stream = self._stream
        stream.wait_stream(current_platform.current_stream(device))
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        with current_platform.stream(stream):
            start.record(stream)
            copier.copy(plan, to_cpu=False)
            end.record(stream)
        transfer = next(self._ids)
        self._events[transfer] = (start, end)
        return transfer

    def _handler(
        self, area: str, to_host: bool, group: int, expedited: bool
    ) -> SingleDirectionOffloadingHandler:
        key = (area, to_host, group, expedited)
        handler = self._handlers.get(key)
        if handler is None:
            handler = self._make_handler(self.areas[area], to_host, group)
            self._handlers[key] = handler
        return handler

    def _make_handler(
        self, area: HostArea, to_host: bool, group: int
    ) -> SingleDirectionOffloadingHandler:
        views = self.group_views[group]
        bpc = self.blocks_per_chunk
        host_views: list[torch.Tensor] = []
        offset = 0
        for view in views:
            span = bpc * view.shape[1]
            host_views.append(area.rows[:, offset : offset + span].view(torch.int8))
            offset += span
        if offset > area.rows.shape[1]:
            raise ValueError(
                f"a {area.name} row holds {area.rows.shape[1]} B, group {group} "
                f"needs {offset} B"
            )
        return SingleDirectionOffloadingHandler(
            gpu_tensors=[v.view(torch.int8) for v in views],
            cpu_tensors=host_views,
            blocks_per_chunk=bpc,
            layer_refs_per_group=[
                [CanonicalKVCacheRef(i, v.shape[1]) for i, v in enumerate(views)]
            ],
            gpu_to_cpu=to_host,
            host_memory_is_pinned=area.pinned,
        )
