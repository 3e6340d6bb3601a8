"""A load job's work on the worker's load thread, and what the thread hands
back (see :mod:`kvtier.connector.worker.load_runner`).

A :class:`LoadTask` is one ``submit_load``'s slow part, cut into units the
thread takes turns on: batches of CPU-row copies (the CPU platform) and
read batches of disk blocks (:class:`ReadBatch` while in flight). The task
comes back once everything of it is done, failed or given up, and every
copy it issued landed.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.connector.specs import TierLoadSpec
from kvtier.connector.worker.job_errors import failure_of
from kvtier.connector.worker.job_plan import GroupPlan
from kvtier.host.block_copy import CopyPlan
from kvtier.store.slot import ReadOutcome


@dataclass(eq=False)
class LoadTask:
    """One load job's work on the load thread.

    ``host_plans``: CPU-row copies the thread performs (synchronous copy
    paths only; on accelerators the worker issues them at submission).
    ``spec``: the job's load spec when it has disk blocks. After the thread
    returned it: ``failed`` (per block of the spec, 0 or why the block
    failed: :data:`~kvtier.connector.worker.job_errors.BAD`,
    ``IO_ERROR``, ``UNREAD``), ``error`` (an exception it raised: the whole
    job failed), ``seconds`` (wall time from its first unit of work to its
    last), ``nbytes`` (bytes it copied into the KV cache itself).

    ``cancelled`` (set through :meth:`LoadRunner.cancel`): the worker gave
    the job up; from then on the thread issues nothing more for it.

    ``after``: on accelerators, the model runner's stream at submission
    (:meth:`~kvtier.host.block_copy.CopyPath.mark`); the thread's copies for
    the task follow it.

    The fields after ``lock`` are the thread's progress through the task:
    units of CPU-row copies left, disk blocks not yet submitted (positions
    in the spec), read batches in flight, and ``copies``, the transfers it
    issued that have not landed (changed under ``lock``: with ``cancelled``
    set and none in flight, nothing of the thread's can still write the
    job's blocks, so the worker may report it without the thread)."""

    job_id: int
    groups: list[GroupPlan]
    spec: TierLoadSpec | None = None
    host_plans: list[tuple[int, CopyPlan]] = field(default_factory=list)
    expedited: bool = False
    after: Any = None
    failed: np.ndarray | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    nbytes: int = 0
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    host_left: deque[tuple[int, CopyPlan]] = field(default_factory=deque, init=False)
    disk_left: np.ndarray | None = field(default=None, init=False)
    batches: int = field(default=0, init=False)
    started: float | None = field(default=None, init=False)
    copies: int = field(default=0, init=False)

    def cut(self, per_unit: int) -> None:
        """Cut the task's work into units of at most ``per_unit`` blocks:
        CPU-row copies (``host_left``) and the disk blocks to read
        (``disk_left``, positions in the spec)."""
        step = max(1, per_unit)
        for group, plan in self.host_plans:
            for lo in range(0, len(plan), step):
                part = CopyPlan(
                    plan.gpu_ids[lo : lo + step],
                    plan.row_ids[lo : lo + step],
                    plan.sub_ids[lo : lo + step],
                )
                self.host_left.append((group, part))
        if self.spec is not None:
            self.disk_left = np.flatnonzero(self.spec.on_disk)

    def delivered(self, positions: np.ndarray, results: list[Any]) -> np.ndarray:
        """Note a read batch's outcomes (one per block at ``positions`` of the
        spec): the bounce row of every block it delivered verified, -1
        elsewhere; the others are marked in ``failed`` with their cause."""
        assert self.spec is not None and self.failed is not None
        bounce_row = np.full(len(self.spec.block_ids), -1, dtype=np.int64)
        for p, result in zip(positions, results):
            if result.outcome is ReadOutcome.OK:
                bounce_row[p] = result.row
            else:
                self.failed[p] = failure_of(result.outcome)
        return bounce_row

    def promote(self, bounce_row: np.ndarray, rows: Any, cpu_buffer: Any) -> None:
        """Copy the delivered blocks that have a promotion row from the
        reader's ``rows`` into those CPU rows: one gathered copy per batch,
        not one per block."""
        assert self.spec is not None
        up = np.flatnonzero((bounce_row >= 0) & (self.spec.promote_rows >= 0))
        if len(up):
            src = rows[bounce_row[up]]
            if isinstance(src, torch.Tensor):  # a device staging area
                src = src.cpu().numpy()
            dst = cpu_buffer.array  # not kept: the buffer may unmap later
            dst[self.spec.promote_rows[up]] = src
            del dst

    def has_work(self) -> bool:
        """Units left to start (CPU-row copies or disk reads)."""
        return bool(self.host_left) or (
            self.disk_left is not None and len(self.disk_left) > 0
        )


@dataclass(eq=False)
class ReadBatch:
    """A read batch in flight: its task, the reader's handle, the spec
    positions it reads, the bounce part it reads into, when it started."""

    task: LoadTask
    read: Any  # the reader's pending batch
    positions: np.ndarray
    part: int
    since: float
