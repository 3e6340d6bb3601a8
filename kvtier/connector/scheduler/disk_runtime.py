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

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.host.cpu_buffer import CpuBlockBuffer
from kvtier.log import get_logger
from kvtier.store.engine import TransferEngine
from kvtier.store.slot import LayoutFingerprint, ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.tiers.plans import PromoteOrder, SpillOrder

logger = get_logger("connector")

SPILL = "spill"
PROMOTE = "promote"


# Bound on waiting for the I/O threads at close(): a hung disk must not hang
# the engine's shutdown.
CLOSE_TIMEOUT_S = 10.0


class _LazyRows:
    """Rank ``rank``'s CPU-tier rows, mapped at start-up or on first use.

    vLLM (0.32 EngineCore) builds the workers and their KV caches, so the
    CPU-tier files, before the scheduler: the runtime maps every rank's file
    in its constructor (``attach``) and removes the name, so the memory goes
    back to the system when the last process mapping it ends, however it
    ends. A file not there yet is mapped at the first job instead (that can
    only follow a completed store); a failure to map then surfaces in that
    job's submission, which the runtime turns into failed keys (misses), not
    an exception in the scheduler step."""

    def __init__(self, runtime: DiskRuntime, rank: int):
        self._runtime = runtime
        self._rank = rank
        self.block_bytes = runtime.block_bytes

    def attach(self) -> CpuBlockBuffer:
        """Map the rank's file (a live worker's) and remove its name."""
        rt = self._runtime
        buffer = rt._buffers[self._rank]
        if buffer is None:
            buffer = CpuBlockBuffer(
                rt.num_cpu_blocks,
                rt.block_bytes,
                rt._buffer_paths[self._rank],
                owner=False,
            )
            rt._buffers[self._rank] = buffer
            # Every process that needs the name has it open now.
            buffer.unlink_name()
        return buffer

    @property
    def array(self) -> np.ndarray:
        return self.attach().array


@dataclass
class FinishedJob:
    """A job every rank finished. ``failed_keys``: keys that failed on some
    rank; ``io_failed_keys`` (of them): keys whose failure says nothing
    against their disk copy on any rank (an I/O error, or never moved: a
    job refused or given up), so a promotion's slot may be read again.
    ``seconds``: the slowest rank's, from submission to completion."""

    kind: str  # SPILL or PROMOTE
    job_id: int
    failed_keys: set[bytes]
    bytes: int
    seconds: float
    io_failed_keys: set[bytes] = field(default_factory=set)


@dataclass
class _RankedJob:
    kind: str
    remaining: int
    keys: list[bytes] = field(default_factory=list)
    failed: set[bytes] = field(default_factory=set)
    # Failed on an I/O error (or not moved) on every rank it failed on.
    io_failed: set[bytes] = field(default_factory=set)
    # Failed on bytes shown bad on some rank.
    bad: set[bytes] = field(default_factory=set)
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

    Contract: ``submit`` returns at once and never raises for I/O set-up
    problems (a CPU-tier file that cannot be mapped, a stopped runtime): the
    job's keys fail instead. ``poll`` returns each job exactly once after
    every rank finished it. ``drain`` waits for everything submitted
    (shutdown and reset only), at most ``timeout``; when it times out the
    runtime is *broken*: its threads never touch a CPU row again (so the
    caller may reuse every row), the next ``poll`` reports every unfinished
    job failed, all its keys (no late result of its I/O ever reaches
    ``poll``), and later jobs fail at once. All I/O
    threads start in the constructor, so what can fail fails at start-up,
    with the real error (nothing is left behind)."""

    def __init__(
        self,
        *,
        disk_paths: Sequence[str],
        num_disk_blocks: int,
        block_bytes: int,
        fingerprints: Sequence[LayoutFingerprint],
        num_cpu_blocks: int = 0,
        cpu_buffer_paths: Sequence[str] = (),
        disk_io: str = "auto",
        compression: str = "none",
        elem_size: int = 2,
        threads: int = 4,
    ):
        if cpu_buffer_paths and len(fingerprints) != len(cpu_buffer_paths):
            raise ValueError("one fingerprint and one CPU buffer per rank")
        # Everything close() touches exists before anything can fail.
        self.num_cpu_blocks = num_cpu_blocks
        self.block_bytes = block_bytes
        self._buffer_paths = list(cpu_buffer_paths)
        self._threads = threads
        self.stores: list[DiskStore] = []
        # CPU buffers are mapped lazily (see _LazyRows).
        self._buffers: list[CpuBlockBuffer | None] = [None] * len(fingerprints)
        self._engines: list[TransferEngine | None] = [None] * len(fingerprints)
        self._jobs: dict[int, _RankedJob] = {}
        # (job_id, failed keys) of rank parts that could not be submitted.
        self._refused: list[tuple[int, list[bytes]]] = []
        # Jobs a timed-out drain gave up, reported failed by the next poll.
        self._given_up: list[tuple[int, _RankedJob]] = []
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._warned: set[str] = set()
        self.totals = DiskIOTotals()
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
            for rank in range(len(fingerprints)):
                self._engine(rank)  # the I/O threads start now, not at a spill
        except BaseException:
            self.close()
            raise
        for rank in range(len(fingerprints)):
            self._attach_at_start(rank)
        logger.info(
            "kvtier disk tier: %d blocks of %d B per rank on %s via %s",
            num_disk_blocks,
            block_bytes,
            list(disk_paths),
            self.stores[0].backend.describe(),
        )

    def _attach_at_start(self, rank: int) -> None:
        """Map rank ``rank``'s CPU-tier file now if its worker created it
        (and remove its name), else at the first spill."""
        try:
            _LazyRows(self, rank).attach()
        except OSError as exc:  # not created yet: mapped at the first job
            logger.info(
                "kvtier: CPU tier of rank %d not mapped at start-up (%s); "
                "mapping it at the first spill",
                rank,
                exc,
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
            engine = TransferEngine(
                _LazyRows(self, rank),  # type: ignore[arg-type]  (duck-typed)
                self.stores[rank],
                threads=self._threads,
            )
            self._engines[rank] = engine
        return engine

    @property
    def broken(self) -> str | None:
        """Why the runtime stopped taking jobs (a drain timed out), or None."""
        return self._broken

    def _warn_once(self, what: str, exc: BaseException | str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "kvtier disk tier: %s (%s); the affected blocks are misses "
                "(recomputed), the engine keeps running",
                what,
                exc,
            )

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
            self._jobs[job_id] = _RankedJob(
                kind, remaining=len(self.stores), keys=[key for key, _, _ in items]
            )
        for rank in range(len(self.stores)):
            try:
                if self._broken is not None:
                    raise RuntimeError(self._broken)
                engine = self._engine(rank)
                if kind == SPILL:
                    engine.submit_spill(job_id, items)
                else:
                    engine.submit_promote(job_id, items)
            except Exception as exc:
                # E.g. the CPU-tier file cannot be mapped: a miss, not a crash.
                self._warn_once(f"cannot run {kind} jobs on rank {rank}", exc)
                with self._lock:
                    self._refused.append((job_id, [key for key, _, _ in items]))

    def poll(self) -> list[FinishedJob]:
        with self._lock:
            # Refused rank parts moved nothing: their keys failed, unread.
            parts = [(job_id, keys, keys, 0, 0.0) for job_id, keys in self._refused]
            self._refused.clear()
            # Given up by a timed-out drain: failed whole, once, unread.
            done = [
                FinishedJob(
                    job.kind, job_id, set(job.keys), job.bytes, job.seconds, set(job.keys)
                )
                for job_id, job in self._given_up
            ]
            self._given_up.clear()
        for engine in self._engines:
            if engine is not None:
                parts.extend(
                    (r.job_id, r.failed_keys, r.io_failed_keys, r.bytes, r.seconds)
                    for r in engine.get_finished()
                )
        for job_id, failed, io_failed, nbytes, seconds in parts:
            with self._lock:
                job = self._jobs.get(job_id)
                if job is None:
                    continue  # given up by a timed-out drain: reported already
                io = set(io_failed)
                job.failed.update(failed)
                job.io_failed |= io
                job.bad.update(k for k in failed if k not in io)
                job.bytes += nbytes
                job.seconds = max(job.seconds, seconds)
                job.remaining -= 1
                if job.remaining:
                    continue
                del self._jobs[job_id]
            if job.kind == SPILL:
                self.totals.write_bytes += job.bytes
                self.totals.write_seconds += job.seconds
            else:
                self.totals.read_bytes += job.bytes
                self.totals.read_seconds += job.seconds
            done.append(
                FinishedJob(
                    job.kind,
                    job_id,
                    job.failed,
                    job.bytes,
                    job.seconds,
                    job.io_failed - job.bad,
                )
            )
        return done

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def drain(self, timeout: float | None = 60.0) -> bool:
        """Wait until every submitted job finished (results stay for poll);
        at most ``timeout`` seconds in all. Returns False on timeout, after
        which the runtime is broken (see the class docstring)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            ids = list(self._jobs)
        for engine in self._engines:
            if engine is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not engine.wait(ids, timeout=left):
                self._break(
                    f"disk jobs did not finish within {timeout} s (a hung disk?)"
                )
                return False
        return True

    def _break(self, why: str) -> None:
        """Stop for good: no thread touches a CPU row again, unfinished jobs
        fail whole at the next ``poll``, later jobs fail at once (misses)."""
        if self._broken is None:
            self._broken = why
            logger.error(
                "kvtier disk tier stopped: %s. Pending spills and promotions are "
                "dropped and the disk tier takes no more jobs (lookups miss); "
                "restart the engine once the disk is healthy",
                why,
            )
        for engine in self._engines:
            if engine is not None:
                engine.abandon()
        with self._lock:
            self._given_up.extend(self._jobs.items())
            self._jobs.clear()
            self._refused.clear()

    def checksum_failures(self) -> int:
        return sum(s.stats().checksum_failures for s in self.stores)

    def io_errors(self) -> int:
        return sum(s.stats().io_errors for s in self.stores)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the I/O threads (at most ``timeout`` s in all), unmap the CPU
        tier and close the stores. Threads still blocked then (a hung disk)
        are abandoned: the mappings and descriptors they use are left open
        (a closed descriptor number could be reused by another file) until
        the process exits. Idempotent; safe after a failed constructor."""
        deadline = time.monotonic() + timeout
        stopped = True
        for engine in self._engines:
            if engine is not None:
                left = max(0.0, deadline - time.monotonic())
                stopped = engine.shutdown(timeout=left) and stopped
        self._engines = [None] * len(self._engines)
        if not stopped:
            self._break("I/O threads did not stop at shutdown (a hung disk?)")
            for store in self.stores:
                store.abandon()
            self._buffers = [None] * len(self._buffers)
            self.stores = []
            return
        for buffer in self._buffers:
            if buffer is not None:
                buffer.close()
        self._buffers = [None] * len(self._buffers)
        for store in self.stores:
            store.close()
        self.stores = []
