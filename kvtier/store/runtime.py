"""What the scheduler side's disk jobs run on, and their life: one
:class:`~kvtier.store.store.DiskStore` per TP rank, each rank's host rows,
a :class:`~kvtier.store.transfers.TransferEngine` in this process and,
where configured, a :class:`~kvtier.store.spill_process.SpillProcess`
running the same engine in a child; the warm-restart scan; the bounded
drain and stop.

The scheduler side turns the hierarchy's decisions into
:class:`~kvtier.tiers.plans.SpillOrder` and
:class:`~kvtier.tiers.plans.PromoteOrder` jobs and hands them to
:class:`DiskRuntime`, which never blocks its step: a job goes to the spill
process while it runs, else to the engine here, and ``poll`` returns each
job once, wherever it ran.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.host.cpu_tier import AttachedRows
from kvtier.log import get_logger
from kvtier.store.child_process import SchedulingWatch
from kvtier.store.slabs import SlabStats
from kvtier.store.slot import ReadOutcome
from kvtier.store.spill_process import SpillProcess
from kvtier.store.store import DiskStore
from kvtier.store.transfers import (
    CLOSE_TIMEOUT_S,
    FinishedJob,
    HostRows,
    TransferEngine,
)
from kvtier.tiers.plans import PromoteOrder, SpillOrder, TransferItem

logger = get_logger("store")

# How long shutdown goes on running the jobs queued before it cancels the
# rest: vLLM gives an engine core a few seconds to exit before it kills it
# (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 by default).
SHUTDOWN_SPILL_S = 2.0
# The most spills a shutdown orders (the newest dirty blocks): more than the
# spill path writes in SHUTDOWN_SPILL_S at 4 KiB blocks on this project's VM
# (docs/benchmarks.md, "Start, reset, shutdown and event backlogs at
# scale"), while bounding the ordering itself (a disk victim each), which
# for a CPU tier of hundreds of thousands of blocks took seconds of the few
# vLLM gives an engine core to exit.
SHUTDOWN_SPILL_BLOCKS = 131_072
# No disk job finished for this long while some wait: a hung or failing
# drive, said once per stall (a write has no deadline of its own: a pwrite
# cannot be taken back).
STALL_S = 15.0


@dataclass
class DiskIOTotals:
    """Cumulative disk-tier I/O as seen by finished jobs."""

    write_bytes: int = 0
    write_seconds: float = 0.0
    read_bytes: int = 0
    read_seconds: float = 0.0


class DiskRuntime:
    """Runs SpillOrders and PromoteOrders for every TP rank; never blocks.

    ``stores`` (one :class:`~kvtier.store.store.DiskStore` per rank, from
    :func:`~kvtier.store.store.open_stores`) are the runtime's from the
    call on: closed by :meth:`close`, or at once if the constructor fails.
    ``rows``: one :class:`HostRows` per rank; :class:`AttachedRows` (the CPU
    tier's files) are mapped at start-up when the workers created them, else
    at the first job, and unmapped by :meth:`close`. ``spill_process``
    (every rank's rows :class:`AttachedRows`): jobs run in a
    :class:`~kvtier.store.spill_process.SpillProcess`, asked for at the
    first job (and started off the caller's thread), once it is ready and
    until it is gone; in this process's engine before and after. Where a
    job ran changes nothing below.

    Contract: ``submit_*`` return at once and never raise for I/O set-up
    problems (rows that cannot be mapped, a stopped runtime): the job's keys
    fail instead. ``poll`` returns each job exactly once after every rank
    finished it. ``drain`` waits for everything submitted (shutdown and
    reset only), at most ``timeout``; when it times out the runtime is
    *broken*: its threads never touch a row again (so the caller may reuse
    every row; the spill process is killed), the next ``poll`` reports
    every unfinished job failed, all its keys (no late result of its I/O
    ever reaches ``poll``), and later jobs fail at once. All I/O threads of
    this process start in the constructor, so what can fail fails at
    start-up, with the real error (nothing is left behind); a spill process
    that cannot start or dies costs its jobs, never the engine."""

    def __init__(
        self,
        stores: Sequence[DiskStore],
        rows: Sequence[HostRows],
        *,
        threads: int = 4,
        spill_process: bool = False,
    ):
        self.stores, self.rows = list(stores), list(rows)
        self.totals = DiskIOTotals()
        self._broken: str | None = None
        self._final = False  # shutting down: no spill process starts now
        self._given_up: list[FinishedJob] = []
        self._lock = threading.Lock()
        self._attached = [r for r in self.rows if isinstance(r, AttachedRows)]
        # Jobs submitted and not yet returned by poll, and when one last
        # returned (or the first was submitted to an idle runtime): a stall
        # is logged from them at no cost per job (_watch).
        self._outstanding = 0
        self._progress_at = time.monotonic()
        self._stalled = False
        first = self.stores[0]
        try:
            # Each rank's own threads' worth, as each rank's stores have.
            self._engine: TransferEngine | None = TransferEngine(
                self.stores, self.rows, threads=threads * len(self.stores)
            )
        except BaseException:
            for store in self.stores:
                store.close()
            raise
        # Jobs run in a child once it is ready (the CPU tier's files mapped
        # there too), in the engine's process before and after it.
        self._process: SpillProcess | None = None
        self._child_watch = SchedulingWatch()  # the spill process's, for _where
        if spill_process and len(self._attached) == len(self.rows):
            self._process = SpillProcess(
                self.stores, self.rows, threads=threads * len(self.stores)
            )
        for rank, r in enumerate(self._attached):
            r.attach_at_start(rank)
        logger.info(
            "kvtier disk tier: %d blocks of %d B per rank on %s via %s",
            first.num_slots,
            first.block_bytes,
            first.paths,
            first.backend.describe(),
        )

    def scan_restore(self) -> list[tuple[bytes, int]]:
        """Blocks a previous run left on disk that every rank holds intact
        headers for (same key, same fingerprint), oldest first: one per key,
        at most one per slot, so never more than the store holds. A block
        written after a connector reset (``after_reset``, see
        :meth:`mark_reset`) is never adopted: its slot is free.

        Payload checksums are verified lazily, on promotion: a bad payload
        then costs one miss, and start-up reads only headers, and only of
        slots that existed before this start (a new or grown slab's new
        slots hold nothing)."""
        per_rank: list[dict[int, tuple[bytes, int]]] = []
        for store in self.stores:
            found: dict[int, tuple[bytes, int]] = {}
            for slot, header, outcome in store.scan(skip_new=True):
                if (
                    outcome is ReadOutcome.OK
                    and header is not None
                    and not header.after_reset
                ):
                    found[slot] = (header.key, header.seq)
            per_rank.append(found)
        entries = sorted(
            (seq, slot, key)
            for slot, (key, seq) in per_rank[0].items()
            if all(other.get(slot, (None,))[0] == key for other in per_rank[1:])
        )
        # Two slots with the same key can exist after a crash between a
        # respill and an invalidate; keep the newest.
        newest = {key: slot for _seq, slot, key in entries}
        return [(key, slot) for _seq, slot, key in entries if newest[key] == slot]

    def cancel_queued(self) -> None:
        """Every job item submitted so far that has not started yet fails
        without I/O, wherever it waits (here or in the spill process), and
        is named in its job's ``cancelled_keys``; what is moving finishes.
        For a connector reset, which forgets every block: a ``drain`` right
        after waits for the batches in progress, not for a queue that may
        hold a CPU tier's worth of spills. Never blocks."""
        if self._engine is None or self._broken is not None:
            return
        self._engine.cancel_queued()
        if self._process is not None:
            self._process.cancel_queued()

    def mark_reset(self) -> None:
        """A connector reset: every rank's blocks written from now on are
        never adopted by a warm restart (:meth:`DiskStore.mark_reset`).
        Callers drain first, so the spills of blocks computed before the
        reset are written without the flag. No I/O."""
        for store in self.stores:
            store.mark_reset()
        if self._process is not None:
            self._process.mark_reset()

    @property
    def spill_pid(self) -> int | None:
        """The spill process's pid while jobs run there, else None."""
        process = self._process
        return process.pid if process is not None and process.running else None

    @property
    def broken(self) -> str | None:
        """Why the runtime stopped taking jobs (a drain timed out), or None."""
        return self._broken

    def submit_spill(self, order: SpillOrder) -> None:
        self._submit(order.job_id, order.items, True)

    def submit_promote(self, order: PromoteOrder) -> None:
        self._submit(order.job_id, order.items, False)

    def _submit(self, job_id: int, items: Sequence[TransferItem], spill: bool) -> None:
        engine, process = self._engine, self._process
        if not self._outstanding:
            self._progress_at = time.monotonic()
        self._outstanding += 1
        try:
            if self._broken is not None or engine is None:
                raise RuntimeError(self._broken or "the disk tier is closed")
            if process is not None and (
                process.running if self._final else process.start()
            ):
                # Seqs from this process's stores: blocks written there and
                # here order as one store's.
                seqs = (
                    [s.reserve_seqs(len(items)) for s in self.stores] if spill else None
                )
                process.submit(job_id, items, spill, seqs)
            elif spill:
                engine.submit_spill(job_id, items)
            else:
                engine.submit_promote(job_id, items)
        except Exception as exc:
            logger.debug("kvtier disk tier refused job %d: %s", job_id, exc)
            keys = list(dict.fromkeys(it[0] for it in items))
            with self._lock:
                self._given_up.append(
                    FinishedJob(job_id, False, 0, 0.0, keys, keys, spill)
                )

    def poll(self) -> list[FinishedJob]:
        with self._lock:
            done, self._given_up = self._given_up, []
        answered = 0  # jobs the I/O answered (not refused, given up, cancelled)
        if self._engine is not None and self._broken is None:
            finished = self._engine.get_finished()
            if self._process is not None:
                finished += self._process.poll()
            for job in finished:
                done.append(job)
                whole = job.cancelled_keys and job.cancelled_keys == job.lost_keys
                if whole and not job.bytes:
                    continue  # cancelled whole: its time in the queue is no I/O
                answered += 1
                if job.spill:
                    self.totals.write_bytes += job.bytes
                    self.totals.write_seconds += job.seconds
                else:
                    self.totals.read_bytes += job.bytes
                    self.totals.read_seconds += job.seconds
        self._watch(len(done), answered)
        return done

    def _watch(self, returned: int, answered: int) -> None:
        """Say when no job has been answered by the I/O for ``STALL_S``
        while some wait (a hung drive or mount, which nothing else reports
        until it recovers: a write has no deadline), and when the I/O
        answers again. ``returned`` jobs left the runtime, ``answered`` of
        them through their I/O (the others were refused, given up at a
        drain's timeout, or cancelled before any I/O: no sign of a drive)."""
        now = time.monotonic()
        self._outstanding = max(0, self._outstanding - returned)
        if not self._outstanding and not self._stalled:
            self._progress_at = now
        if answered:
            if self._stalled:
                self._stalled = False
                logger.warning(
                    "kvtier: disk jobs return again, after %.0f s without one",
                    now - self._progress_at,
                )
            self._progress_at = now
        elif (
            self._outstanding
            and not self._stalled
            and now - self._progress_at > STALL_S
            and self._broken is None
        ):
            self._stalled = True
            logger.error(
                "kvtier: no disk job has finished for %.0f s, %d waiting (spills "
                "and promotions on %s): a hung or failing drive or mount? Until "
                "they finish, the CPU tier keeps the rows of the blocks waiting "
                "to spill, so new blocks are declined as it fills "
                "(stores_declined). Check the drive (dmesg, smartctl) and the "
                "mount; kvtier recovers by itself when the writes return (%s)",
                now - self._progress_at,
                self._outstanding,
                self.stores[0].paths if self.stores else "?",
                self._where(),
            )

    def _where(self) -> str:
        """Where the jobs run, for the stall's log line: the spill process
        and how its threads stand with the CPU scheduler (D: waiting on the
        drive; R with a long wait: starved of CPU), or this process."""
        pid = self.spill_pid
        if pid is None:
            return "jobs run in the engine's process"
        return f"jobs run in spill process {pid}: {self._child_watch.look(pid)}"

    def stalled_s(self) -> float:
        """Seconds since a job was last answered by its I/O (or since the
        first was submitted to an idle runtime) while some wait: 0 when
        none waits. As of the last ``poll``; the stall watch's measure."""
        if not self._outstanding or self._broken is not None:
            return 0.0
        return time.monotonic() - self._progress_at

    @property
    def pending(self) -> int:
        if self._engine is None or self._broken:
            return 0
        process = self._process
        return self._engine.pending() + (0 if process is None else process.pending)

    def wait(self, timeout: float | None) -> bool:
        """Wait until every submitted job finished (results stay for poll),
        at most ``timeout`` seconds in all; False if some have not, which
        changes nothing else (they go on)."""
        engine, process = self._engine, self._process
        if engine is None or self._broken is not None:
            return self._broken is None
        deadline = None if timeout is None else time.monotonic() + timeout
        return engine.wait(timeout=timeout) and (
            process is None
            or process.wait(None if deadline is None else deadline - time.monotonic())
        )

    def drain(self, timeout: float | None = 60.0) -> bool:
        """:meth:`wait`, after which a job still running is a hung disk:
        returns False on timeout, the runtime then broken (see the class
        docstring)."""
        if self.wait(timeout):
            return True
        if self._broken is None and self._engine is not None:
            self._break(f"disk jobs did not finish within {timeout} s (a hung disk?)")
        return self._broken is None

    def _break(self, why: str) -> None:
        """Stop for good: no thread touches a row again, unfinished jobs fail
        whole at the next ``poll``, later jobs fail at once (misses)."""
        engine = self._engine
        if self._broken is None:
            self._broken = why
            logger.error(
                "kvtier disk tier stopped: %s. Pending spills and promotions are "
                "dropped and the disk tier takes no more jobs (lookups miss); "
                "restart the engine once the disk is healthy",
                why,
            )
        given = [] if engine is None else engine.give_up()
        if self._process is not None:
            given += self._process.give_up()
        with self._lock:
            self._given_up.extend(given)

    def _stats(self) -> list[SlabStats]:
        """Every rank's store counters, the spill process's writes included."""
        stats = [s.stats() for s in self.stores]
        if self._process is not None:
            stats += self._process.stats()
        return stats

    def checksum_failures(self) -> int:
        return sum(s.checksum_failures for s in self._stats())

    def io_errors(self) -> int:
        return sum(s.io_errors for s in self._stats())

    def shutdown(self, spills: Sequence[SpillOrder] = ()) -> None:
        """The engine stops: queue ``spills`` (the last ones: they never
        start a spill process, which would only be closed again), run the
        jobs queued for up to
        ``SHUTDOWN_SPILL_S`` (a spill's blocks are adopted by a warm
        restart), cancel those not started by then, and :meth:`close`,
        which waits for the batches moving (a hung disk: at most
        ``CLOSE_TIMEOUT_S``, then they are abandoned).
        The blocks of spills cancelled are lost with the CPU tier, as they
        would be without a disk tier; a slow drive behind a long queue
        held the engine's exit for up to a minute (then logging that the
        disk tier stopped), past the few seconds vLLM gives an engine core
        before it kills it."""
        self._final = True
        for order in spills:
            self.submit_spill(order)
        if self._broken is None and not self.wait(SHUTDOWN_SPILL_S):
            self.cancel_queued()
            logger.info(
                "kvtier: disk jobs not started %.0f s into shutdown are cancelled; "
                "the blocks of spills among them are not kept for a warm restart",
                SHUTDOWN_SPILL_S,
            )
        # close() waits for the batches moving, at most CLOSE_TIMEOUT_S (a
        # hung disk: then they are abandoned), not the drain's minute.
        self.close()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the I/O threads (at most ``timeout`` s), unmap the rows and
        close the stores. Threads still blocked then (a hung disk) are
        abandoned: the mappings and descriptors they use (and the store
        locks) are left open, since a closed descriptor number could be
        reused by another file, until that I/O returned (a thread then
        releases them: :func:`_release_when_returned`) or the process
        exits. Idempotent."""
        started = time.monotonic()
        process, self._process = self._process, None
        # The child finishes its jobs and exits; one that does not (a hung
        # disk) is killed, and touches no row after a spill staged it. One
        # the kill does not end may still write its slots: as with threads
        # left blocked here, the stores' descriptors and locks stay until it
        # is gone.
        reaped = process is None or process.close(timeout / 2)  # + the kill's wait
        engine, self._engine = self._engine, None
        left = max(1.0, timeout - (time.monotonic() - started))
        stopped = engine is None or engine.shutdown(timeout=left)
        if not (stopped and reaped):
            self._break(
                "I/O threads did not stop at shutdown (a hung disk?)"
                if not stopped
                else "the spill process did not exit at shutdown (a hung disk?)"
            )
            for store in self.stores:
                store.abandon()
            threading.Thread(
                target=_release_when_returned,
                args=(engine, None if process is None else process.left),
                kwargs={"rows": self._attached, "stores": self.stores},
                name="kvtier-disk-release",
                daemon=True,
            ).start()
        else:
            for r in self._attached:
                r.close()
            for store in self.stores:
                store.close()
        self.rows, self.stores = [], []


def _release_when_returned(
    engine: TransferEngine | None,
    process: subprocess.Popen[bytes] | None,
    *,
    rows: list[AttachedRows],
    stores: list[DiskStore],
) -> None:
    """What :meth:`DiskRuntime.close` left open for I/O that did not return
    (a hung disk), closed once it returned: the rows unmapped, the slabs
    closed and the store directories' locks released, so that a new engine
    in this process can take the store (an in-process engine made again
    found it "in use" by its own pid until the process exited)."""
    if engine is not None:
        engine.shutdown(timeout=None)  # joins the threads, however long
    if process is not None:
        process.wait()
    for r in rows:
        r.close()
    for store in stores:
        store.close()
    logger.warning(
        "kvtier: the disk I/O left blocked at shutdown returned; the store is "
        "released"
    )
