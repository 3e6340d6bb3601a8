"""Scheduler-side execution of the hierarchy's spill and promotion orders.

The CPU tier lives in shared memory (one file per TP rank under /dev/shm),
so the scheduler process can move blocks between it and the disk tier on
background threads without involving the model workers: spills and
promotions never enter the GPU step. Each TP rank has its own shard files
(its fingerprint carries the rank), and a job finishes when every rank's
part finished; a key that failed on any rank failed.

No vLLM import: this module is plain kvtier.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.io.cpu_buffer import CpuBlockBuffer
from kvtier.io.disk_store import DiskStore, ReadOutcome
from kvtier.io.engine import TransferEngine
from kvtier.io.format import LayoutFingerprint
from kvtier.tiers.plans import PromoteOrder, SpillOrder

logger = logging.getLogger("kvtier.connector")

SPILL = "spill"
PROMOTE = "promote"


def cpu_buffer_path(engine_id: str, rank: int, world_size: int) -> str:
    """Where rank ``rank``'s CPU tier lives, shared by scheduler and worker."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return os.path.join(base, f"kvtier-{safe}-r{rank}of{world_size}.cpu")


@dataclass
class FinishedJob:
    kind: str  # SPILL or PROMOTE
    job_id: int
    failed_keys: set[bytes]
    bytes: int
    seconds: float


@dataclass
class _RankedJob:
    kind: str
    remaining: int
    failed: set[bytes] = field(default_factory=set)
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class DiskIOTotals:
    """Cumulative disk-tier I/O as seen by finished jobs."""

    write_bytes: int = 0
    write_seconds: float = 0.0
    read_bytes: int = 0
    read_seconds: float = 0.0


class DiskRuntime:
    """Runs SpillOrders and PromoteOrders for all TP ranks; never blocks.

    Contract: ``submit`` returns at once; ``poll`` returns each job exactly
    once after every rank finished it; ``drain`` waits for everything
    submitted (shutdown and reset only)."""

    def __init__(
        self,
        *,
        disk_paths: Sequence[str],
        num_disk_blocks: int,
        num_cpu_blocks: int,
        block_bytes: int,
        fingerprints: Sequence[LayoutFingerprint],
        cpu_buffer_paths: Sequence[str],
        disk_io: str = "auto",
        compression: str = "none",
        elem_size: int = 2,
        threads: int = 4,
    ):
        if len(fingerprints) != len(cpu_buffer_paths):
            raise ValueError("one fingerprint and one CPU buffer per rank")
        self.num_cpu_blocks = num_cpu_blocks
        self.block_bytes = block_bytes
        self._buffer_paths = list(cpu_buffer_paths)
        self.stores: list[DiskStore] = []
        try:
            for fp in fingerprints:
                self.stores.append(
                    DiskStore(
                        disk_paths,
                        num_disk_blocks,
                        block_bytes,
                        fp,
                        backend=disk_io,
                        compression=compression,
                        elem_size=elem_size,
                        threads=threads,
                    )
                )
        except BaseException:
            self.close()
            raise
        self._threads = threads
        # CPU buffers are mapped lazily: the workers create them at start-up,
        # and the first spill can only follow a completed store.
        self._buffers: list[CpuBlockBuffer | None] = [None] * len(fingerprints)
        self._engines: list[TransferEngine | None] = [None] * len(fingerprints)
        self._jobs: dict[int, _RankedJob] = {}
        self._lock = threading.Lock()
        self.totals = DiskIOTotals()
        logger.info(
            "kvtier disk tier: %d blocks of %d B per rank on %s via %s",
            num_disk_blocks,
            block_bytes,
            list(disk_paths),
            self.stores[0].backend.describe(),
        )

    # ------------------------------------------------------------ restart

    def scan_restore(self) -> list[tuple[bytes, int]]:
        """Blocks a previous run left on disk that every rank holds intact
        headers for (same key, same fingerprint), oldest first.

        Payload checksums are verified lazily, on promotion: a bad payload
        then costs one miss, and start-up reads only headers."""
        per_rank: list[dict[int, tuple[bytes, int]]] = []
        for store in self.stores:
            found: dict[int, tuple[bytes, int]] = {}
            for slot, header, outcome in store.scan():
                if outcome is ReadOutcome.OK and header is not None:
                    found[slot] = (header.key, header.seq)
            per_rank.append(found)
        first = per_rank[0]
        entries = []
        for slot, (key, seq) in first.items():
            if all(other.get(slot, (None,))[0] == key for other in per_rank[1:]):
                entries.append((seq, slot, key))
        entries.sort()
        # Two slots with the same key can exist after a crash between a
        # respill and an invalidate; keep the newest.
        newest: dict[bytes, int] = {}
        for _seq, slot, key in entries:
            newest[key] = slot
        kept = [(key, slot) for _seq, slot, key in entries if newest[key] == slot]
        return kept

    # ---------------------------------------------------------------- jobs

    def _engine(self, rank: int) -> TransferEngine:
        engine = self._engines[rank]
        if engine is None:
            buffer = CpuBlockBuffer(
                self.num_cpu_blocks,
                self.block_bytes,
                self._buffer_paths[rank],
                owner=None,
                pin=False,
            )
            self._buffers[rank] = buffer
            engine = TransferEngine(buffer, self.stores[rank], threads=self._threads)
            self._engines[rank] = engine
        return engine

    def submit_spill(self, order: SpillOrder) -> None:
        items = [(it.key, it.src_slot, it.dst_slot) for it in order.items]
        self._submit(SPILL, order.job_id, items)

    def submit_promote(self, order: PromoteOrder) -> None:
        items = [(it.key, it.src_slot, it.dst_slot) for it in order.items]
        self._submit(PROMOTE, order.job_id, items)

    def _submit(
        self, kind: str, job_id: int, items: list[tuple[bytes, int, int]]
    ) -> None:
        with self._lock:
            self._jobs[job_id] = _RankedJob(kind, remaining=len(self.stores))
        for rank in range(len(self.stores)):
            engine = self._engine(rank)
            if kind == SPILL:
                engine.submit_spill(job_id, items)
            else:
                engine.submit_promote(job_id, items)

    def poll(self) -> list[FinishedJob]:
        done: list[FinishedJob] = []
        for engine in self._engines:
            if engine is None:
                continue
            for result in engine.get_finished():
                with self._lock:
                    job = self._jobs[result.job_id]
                    job.failed.update(result.failed_keys)
                    job.bytes += result.bytes
                    job.seconds = max(job.seconds, result.seconds)
                    job.remaining -= 1
                    if job.remaining:
                        continue
                    del self._jobs[result.job_id]
                if job.kind == SPILL:
                    self.totals.write_bytes += job.bytes
                    self.totals.write_seconds += job.seconds
                else:
                    self.totals.read_bytes += job.bytes
                    self.totals.read_seconds += job.seconds
                done.append(
                    FinishedJob(
                        job.kind, result.job_id, job.failed, job.bytes, job.seconds
                    )
                )
        return done

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def drain(self, timeout: float | None = 60.0) -> None:
        for engine in self._engines:
            if engine is not None:
                engine.wait(list(self._jobs), timeout=timeout)

    def checksum_failures(self) -> int:
        return sum(s.stats().checksum_failures for s in self.stores)

    def io_errors(self) -> int:
        return sum(s.stats().io_errors for s in self.stores)

    def close(self) -> None:
        for engine in self._engines:
            if engine is not None:
                engine.shutdown()
        self._engines = [None] * len(self._engines)
        for buffer in self._buffers:
            if buffer is not None:
                buffer.close()
        self._buffers = [None] * len(self._buffers)
        for store in self.stores:
            store.close()
        self.stores = []
