"""What a worker reports about a transfer job that did not deliver.

Two kinds of failure reach a job. A disk block that fails (I/O error,
checksum, header, another key's slot) is expected: the slot reader reports
it per block and only that block is given up; why it failed
(:data:`BAD`, :data:`IO_ERROR` or :data:`UNREAD`) tells the scheduler
whether its disk copy goes or stays (the disk core's read-failure rule). Anything *raised* while a job
runs (a bug, an error no one foresaw in the reader or the copy path)
is unexpected: the worker contains it, so that it never reaches vLLM's model
runner, and fails the whole job, as nothing the job wrote can be trusted.
:class:`JobExceptions` logs and counts those; :func:`whole_load_error` is
what such a load reports.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec

from kvtier.connector.specs import TierLoadSpec
from kvtier.connector.worker.job_plan import GroupPlan
from kvtier.log import get_logger
from kvtier.store.slot import ReadOutcome

logger = get_logger("connector")

# Distinct causes remembered for the log; past that, every one is a repeat.
MAX_CAUSES = 64


# Why a disk block of a load was not delivered (``LoadTask.failed``, one
# per block of the spec; 0: delivered, or not failed so far).
# Read, and its bytes failed verification (or the slot holds another block):
# the disk copy is dropped.
BAD = 1
# Its read failed (any errno, a read that stalled past the load thread's
# deadline, a device's short read): the copy stays, counted.
IO_ERROR = 2
# Never read (every bounce part held by stalled reads): the copy stays.
UNREAD = 3


def failure_of(outcome: ReadOutcome) -> int:
    """The failure a slot's read outcome (not OK) means."""
    return IO_ERROR if outcome is ReadOutcome.IO_ERROR else BAD


@dataclass
class LoadError:
    """What a failed load could not deliver: ``keys``, the disk blocks shown
    bad (failed verification: their copies are dropped); ``io_failed``,
    disk blocks whose read failed (an I/O error: their copies stay,
    counted); ``unloaded``, disk blocks not delivered for a reason that says
    nothing about their copies (not read, or the job raised: the copies
    stay); and the GPU blocks that were left unfilled."""

    keys: list[bytes] = field(default_factory=list)
    gpu_block_ids: set[int] = field(default_factory=set)
    unloaded: list[bytes] = field(default_factory=list)
    io_failed: list[bytes] = field(default_factory=list)

    def merge(self, other: LoadError) -> LoadError:
        """One error with everything both name (a job fails once)."""
        return LoadError(
            keys=list(dict.fromkeys(self.keys + other.keys)),
            gpu_block_ids=self.gpu_block_ids | other.gpu_block_ids,
            unloaded=list(dict.fromkeys(self.unloaded + other.unloaded)),
            io_failed=list(dict.fromkeys(self.io_failed + other.io_failed)),
        )


def disk_load_error(
    spec: TierLoadSpec, groups: list[GroupPlan], failed: np.ndarray
) -> LoadError:
    """A load whose disk blocks ``failed`` (per block of the spec: 0, or
    why it failed: :data:`BAD`, :data:`IO_ERROR`, :data:`UNREAD`) could not
    be delivered: their keys by cause and the GPU blocks they were to fill,
    in every KV-cache group."""
    def keys(cause: int) -> list[bytes]:
        return [spec.keys[p] for p in np.flatnonzero(failed == cause)]

    error = LoadError(keys=keys(BAD), unloaded=keys(UNREAD), io_failed=keys(IO_ERROR))
    for gp in groups:
        mask = failed[gp.plan.row_ids] != 0
        error.gpu_block_ids.update(int(b) for b in gp.plan.gpu_ids[mask])
    return error


def whole_load_error(src: LoadStoreSpec, dst: GPULoadStoreSpec) -> LoadError:
    """A load that raised: every disk key of the job as *unloaded* (their
    promotion rows are given back unwritten; the disk copies were not shown
    bad, so they stay and a later request may load them) and every GPU
    block, whether meant for a disk or a CPU block (a partial load counts
    for nothing)."""
    keys = [k for k in src.keys if k] if isinstance(src, TierLoadSpec) else []
    return LoadError(unloaded=keys, gpu_block_ids={int(b) for b in dst.block_ids})


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
