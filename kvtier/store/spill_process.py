"""Spills and promotions of the disk tier in a process of their own: both
ends, and what they say to each other.

:class:`SpillProcess` runs :class:`~kvtier.store.runtime.DiskRuntime`'s
jobs in a child (:func:`child_main`, ``python -m
kvtier.store.spill_process``): the same
:class:`~kvtier.store.transfers.TransferEngine` over the same slab files
(each rank's :class:`~kvtier.store.store.DiskStore` reopened there for
writing, :meth:`~kvtier.store.store.DiskStore.reopener`) and the same CPU
tier rows (the files the workers made, mapped there from the descriptors
the scheduler side keeps, :attr:`~kvtier.host.cpu_tier.AttachedRows.fd`).
The engine's process sends one message per job and takes one answer per
finished job.

Why: the spill threads stage, hash and write whole batches; each of their
hand-offs of the interpreter lock takes it back from the engine's loop. In
the engine's process they stall its steps, and a busy loop slows them;
from a child the steps keep their pace and the spills most of theirs
(docs/benchmarks.md, "Spills next to a busy loop").

Contract (what :class:`~kvtier.store.runtime.DiskRuntime` relies on):
  - :meth:`SpillProcess.start` asks for the child (once, when every rank's
    rows are mapped here) and never waits for it: the
    :class:`~kvtier.store.child_process.ChildStarter` made with the object
    starts it. Until it says it is ready, and after it is gone,
    :attr:`running` is False and the runtime moves its jobs in this process.
  - ``submit`` and ``poll(0)`` never wait on the child (its pipes are
    :class:`~kvtier.store.child_process.PipeChannel`'s). Every job submitted
    is answered exactly once by ``poll``: the child's result, or, if the
    child dies, its pipe breaks or :meth:`give_up` stops it, failed whole
    (every key unread, as I/O failures: nothing showed its bytes bad).
  - A spill's blocks carry the seqs the runtime reserved from this
    process's stores (``first_seqs``), so blocks written there and here
    order as one store's; :meth:`mark_reset` reaches the child's stores in
    order with the jobs around it, and so does :meth:`cancel_queued` (the
    child's engine cancels what it holds queued then).
  - After :meth:`give_up` or :meth:`close` returned, the child no longer
    runs (or is left stuck in the kernel on a hung disk, named in the log:
    it touches no row again, since a spill stages its rows before it
    writes). The child dies with its starter's thread, which stays until
    then (not with the thread of the first job, which in an in-process
    engine may be a pool's thread that exits), and exits when its request
    pipe closes.
  - Used by one thread (the engine's loop); :meth:`stats` from any.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.store.child_process import (
    KILL_WAIT_S,
    PIPE_WAIT_S,
    ChildStarter,
    PipeChannel,
    die_with_parent,
    log_level,
    receive,
    replying,
    set_log_level,
    start_configured,
    stay_off_the_terminal,
    stop,
)
from kvtier.store.slabs import SlabStats
from kvtier.store.store import DiskStore
from kvtier.store.transfers import (
    CLOSE_TIMEOUT_S,
    ArrayRows,
    FinishedJob,
    TransferEngine,
)

logger = get_logger("store")

# How long close() waits for the child to finish its jobs and exit.
CLOSE_WAIT_S = 10.0
# The child's name in ps and top (its I/O threads are kvtier-xfer-N).
CHILD_NAME = "kvtier-spill"


@dataclass
class _Held:
    """A job the child holds: enough to fail it whole."""

    keys: list[bytes]
    spill: bool


class SpillProcess:
    """Runs disk jobs in a child process (see the module doc).

    ``stores`` and ``rows`` are the runtime's (borrowed: every store must
    have been created here, every row set must have a descriptor once
    mapped); ``threads``: the child's I/O threads, for all ranks. ``spawn``
    False (a class attribute, for tests whose fault plans must see every
    write) keeps every job in the engine's process.
    """

    spawn = True

    def __init__(
        self, stores: Sequence[DiskStore], rows: Sequence[Any], *, threads: int
    ) -> None:
        self.stores, self.rows, self.threads = list(stores), list(rows), threads
        self._proc: subprocess.Popen[bytes] | None = None
        # The child close() could not reap (stuck in the kernel), if any.
        self.left: subprocess.Popen[bytes] | None = None
        self._pipes: PipeChannel | None = None
        self._ready = False
        self._ended = False  # started and gone, or closed: never again
        self._held: dict[int, _Held] = {}
        self._results: list[FinishedJob] = []  # taken, not returned by poll yet
        self._looked = 0.0  # when a poll without a timeout last read the pipe
        self._child_stats = [SlabStats() for _ in self.stores]
        self._stats_lock = threading.Lock()
        # What the starter starts the child with: its descriptors, its
        # configuration (made on the asking thread).
        self._start_with: tuple[list[int], dict[str, Any]] | None = None
        self._starter = (
            ChildStarter("kvtier-starter", self._start_child) if self.spawn else None
        )

    # ------------------------------------------------------------ lifecycle

    def start(self) -> bool:
        """Ask for the child if it can be started and was not yet: every
        rank's rows mapped here (``rows[r].fd``). Returns whether it is
        running; never waits for it to start."""
        starter = self._starter
        if not self.spawn or starter is None or self._ended or starter.asked:
            return self.running
        fds = []
        for r in self.rows:
            try:
                r.array  # noqa: B018  (maps it, once the worker made it)
            except OSError:
                return False  # tried again at the next job
            fds.append(r.fd)
        try:
            config = {
                "stores": [store.reopener() for store in self.stores],
                "rows": [
                    (fd, r.num_blocks, r.block_bytes) for fd, r in zip(fds, self.rows)
                ],
                "threads": self.threads,
                "after_reset": any(store.after_reset for store in self.stores),
                "log_level": log_level(),
            }
            # The slabs go as the descriptors the stores opened: the child
            # never reopens them by name (a store directory removed or
            # swapped since engine start would stop every spill there).
            slab_fds = [fd for store in self.stores for fd in store.files.descriptors()]
        except (OSError, ValueError) as exc:
            self._ended = True
            logger.warning(
                "kvtier: no spill process (%s); disk jobs run in the engine", exc
            )
            return False
        self._start_with = ([*fds, *slab_fds], config)
        starter.ask()
        return False

    def _start_child(self) -> tuple[subprocess.Popen[bytes], PipeChannel] | None:
        """On the starter's thread: the child and its pipes, its
        configuration sent; None (logged) when it cannot start."""
        assert self._start_with is not None
        fds, config = self._start_with
        return start_configured(
            "kvtier.store.spill_process",
            fds,
            [],
            config,
            "spill process",
            "disk jobs run in the engine's process",
        )

    def _adopt(self) -> None:
        """Take the child the starter started, once it has (or learn that
        none will run)."""
        starter = self._starter
        if starter is None or self._ended or self._proc is not None:
            return
        started = starter.take()
        if started is not None:
            self._proc, self._pipes = started
            assert self._start_with is not None
            if (
                any(s.after_reset for s in self.stores)
                and not (self._start_with[1]["after_reset"])
            ):
                # A reset came while the child started (its configuration
                # predates it): the child hears of it before any job.
                self.mark_reset()
        elif starter.failed:
            self._ended = True

    @property
    def running(self) -> bool:
        """Whether jobs go to the child (it said it is ready). Until it has,
        this takes what the child said (:meth:`_take`, without waiting): a
        read of the pipe, so only the thread that polls asks it, as
        :meth:`poll` and :meth:`start` do."""
        self._adopt()
        if self._pipes is not None and not self._ready:
            self._take(0.0)
        return self._ready

    @property
    def pid(self) -> int | None:
        """The child's process id, while there is one."""
        proc = self._proc
        if proc is None or self._ended or proc.returncode is not None:
            return None
        return proc.pid

    def close(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Close the pipes (the child finishes the jobs it holds, without
        answering, and exits), wait up to ``timeout`` for it, then kill it.
        Returns whether it was reaped. Idempotent. A start under way is
        waited for first (the starter's fork and exec: not counted in
        ``timeout``), so the child it makes is stopped too."""
        self._ended = True
        self._ready = False
        if self._starter is not None:
            started = self._starter.close()  # none starts from now on
            if started is not None:  # started, not taken yet
                self._proc, self._pipes = started
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        proc, self._proc = self._proc, None
        reaped = proc is None or stop(proc, timeout, "spill process")
        if not reaped:
            self.left = proc
        if self._starter is not None:
            self._starter.release()  # the kernel kills a child left behind
        return reaped

    # ------------------------------------------------------------ the jobs

    def submit(
        self,
        job_id: int,
        items: Sequence[tuple[bytes, int, int]],
        spill: bool,
        first_seqs: Sequence[int] | None = None,
    ) -> None:
        """Send a job to the running child (never waits: what the pipe cannot
        take yet goes out at later calls)."""
        if not self._ready or self._pipes is None:
            raise RuntimeError("the spill process is not running")
        if job_id in self._held:
            raise ValueError(f"job {job_id} is already pending")
        plain = [(key, src, dst) for key, src, dst in items]
        self._held[job_id] = _Held(list(dict.fromkeys(k for k, _, _ in plain)), spill)
        kind = "spill" if spill else "promote"
        msg = (kind, job_id, plain, None if first_seqs is None else list(first_seqs))
        try:
            self._pipes.send(msg)
        except OSError:
            self._lose("its pipe broke")

    def mark_reset(self) -> None:
        """Every block the child writes after the jobs sent so far carries
        the after-reset flag (:meth:`DiskStore.mark_reset`)."""
        if self._pipes is not None:
            try:
                self._pipes.send(("reset",))
            except OSError:
                self._lose("its pipe broke")

    def cancel_queued(self) -> None:
        """The child cancels the items of the jobs sent so far that have not
        started there yet (:meth:`TransferEngine.cancel_queued`); their
        answers name them in ``cancelled_keys``. Never waits."""
        if self._pipes is not None:
            try:
                self._pipes.send(("cancel",))
            except OSError:
                self._lose("its pipe broke")

    def poll(self, timeout: float = 0.0) -> list[FinishedJob]:
        """Jobs finished since the last call (``FinishedJob``), waiting up to
        ``timeout`` for the child's next message; the jobs of a lost child
        come back failed whole."""
        self._take(timeout)
        done, self._results = self._results, []
        return done

    @property
    def pending(self) -> int:
        """Jobs sent and not answered yet."""
        return len(self._held)

    def wait(self, timeout: float | None) -> bool:
        """Take answers until no job is pending (they stay for ``poll``);
        False after ``timeout`` seconds (answers already in the pipe are
        taken first, however little time is left)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take(0.0)
        while self._held:
            left = PIPE_WAIT_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            if self._pipes is None:  # a killed child not reaped yet
                time.sleep(min(left, PIPE_WAIT_S))
            self._take(min(left, PIPE_WAIT_S))
        return True

    def give_up(self) -> list[FinishedJob]:
        """Stop the child for good (kill it, wait up to ``KILL_WAIT_S`` for
        it to go) and fail every job it held, as ``poll`` would; results
        taken but not returned yet come first. A child the kill does not end
        in that time is stuck in the kernel on a write or read of a hung
        disk: it never touches a row again (a spill stages its rows before
        it writes; a promotion reads into a buffer of its own first)."""
        self._lose("the disk tier stopped", log=False, wait=True)
        self._release(force=True)
        done, self._results = self._results, []
        return done

    def stats(self) -> list[SlabStats]:
        """Per rank, the child's store counters as of its last answer."""
        with self._stats_lock:
            return list(self._child_stats)

    # ------------------------------------------------------------ internals

    def _take(self, timeout: float) -> None:
        """Take the child's messages, waiting up to ``timeout`` for one (and
        sending on what the request pipe could not take before).

        Without a timeout (the engine's loop polls at every step) the pipe
        is looked at only when an answer is due (jobs held, or the child not
        ready yet), and then at most once per switch interval: a look is a
        system call, which lets the interpreter lock go and takes it back,
        and CPython hands the lock to a waiting thread only after a whole
        switch interval without a switch. A loop that never blocks and
        switches at every step starves every other thread of the process:
        an in-process engine's load thread, whose first disk loads in
        ``make demo`` waited 5.9 s instead of 0.12 s."""
        self._adopt()
        pipes = self._pipes
        if pipes is None:
            self._release()
            return
        if timeout <= 0:
            if self._ready and not self._held:
                return  # nothing due: a dead child shows at the next send
            now = time.monotonic()
            if now - self._looked < sys.getswitchinterval():
                return
            self._looked = now
        msgs, gone = receive(pipes, timeout)
        if gone is not None:
            self._lose(gone)
            return
        for msg in msgs:
            try:
                if msg[0] == "ready":
                    self._ready = True
                    continue
                _, *fields, stats = msg
                job = FinishedJob(*fields)
                stats = [SlabStats(*s) for s in stats]
            except Exception as exc:  # not a message of ours: a bug
                self._lose(f"it answered {str(msg)[:80]} ({exc!r})")
                return
            if self._held.pop(job.job_id, None) is None:
                continue  # given up meanwhile
            with self._stats_lock:
                self._child_stats = stats
            self._results.append(job)

    def _lose(self, why: str, *, log: bool = True, wait: bool = False) -> None:
        """The child is gone or must go: kill it and run every later job in
        this process. The jobs it held fail once it is reaped (at once when
        it already exited, else at a later call: the engine's loop never
        waits for it, unless ``wait``), never while it may still touch
        their rows."""
        if self._starter is not None and self._proc is None:
            # None starts from now on; one under way (give_up during a
            # start) is taken, to be killed with the rest.
            started = self._starter.close()
            if started is not None:
                self._proc, self._pipes = started
        was_ready = self._ready
        self._ready = False
        self._ended = True
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        proc = self._proc
        code = None
        if proc is not None:
            if wait:
                stop(proc, KILL_WAIT_S, "spill process", kill=True)
            elif proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.poll()
            code = proc.returncode
        if not log or proc is None:
            pass
        elif was_ready or self._held:
            logger.error(
                "kvtier: the spill process stopped (%s, exit status %s); %d disk "
                "jobs in flight failed (their blocks stay in the CPU tier or are "
                "recomputed), later ones run in the engine's process",
                why,
                code,
                len(self._held),
            )
        else:
            logger.warning(
                "kvtier: the spill process did not start (%s, exit status %s); "
                "disk jobs run in the engine's process",
                why,
                code,
            )
        if self._starter is not None:
            self._starter.release()  # killed: its starter may leave
        self._release()

    def _release(self, force: bool = False) -> None:
        """Once the lost child is reaped (or with ``force``: it is left stuck
        in the kernel), fail every job it held, all keys as I/O failures
        (nothing showed their bytes bad)."""
        proc = self._proc
        if proc is not None and proc.poll() is None and not force:
            return
        self._proc = None
        for job_id, held in self._held.items():
            self._results.append(
                FinishedJob(job_id, False, 0, 0.0, held.keys, held.keys, held.spill)
            )
        self._held.clear()


# ------------------------------------------------------------ the child


def _map_rows(fd: int, num_blocks: int, block_bytes: int) -> ArrayRows:
    """One rank's CPU tier rows, mapped here from the descriptor passed."""
    area = mmap.mmap(fd, num_blocks * block_bytes, mmap.MAP_SHARED)
    os.close(fd)  # the mapping keeps the file
    rows = np.frombuffer(area, dtype=np.uint8).reshape(num_blocks, block_bytes)
    return ArrayRows(rows, block_bytes)


def _serve(req: Connection, send: Callable[[tuple], None]) -> None:
    from kvtier.store.backends.factory import make_backend

    cfg = req.recv()
    set_log_level(cfg["log_level"])
    stores: list[Any] = []
    try:
        for reopen in cfg["stores"]:
            backend = make_backend(
                "posix", threads=1, why="the spill process's writes, as the engine's"
            )
            stores.append(reopen(backend))
        rows = [_map_rows(*r) for r in cfg["rows"]]
        for store in stores:
            store.files.open_all()
            if cfg["after_reset"]:
                store.mark_reset()
        engine = TransferEngine(stores, rows, threads=cfg["threads"])
    except BaseException:
        for store in stores:
            store.close()
        raise
    stopping = threading.Event()

    def answer() -> None:
        """Send each finished job's result with the stores' counters. If it
        cannot, the child ends at once: the engine reads EOF and fails the
        jobs it held, rather than wait for answers that never come."""
        try:
            while not (stopping.is_set() and not engine.pending()):
                for job in engine.get_finished(PIPE_WAIT_S * 10):
                    stats = [astuple(store.stats()) for store in stores]
                    send(("done", *astuple(job), stats))
        except OSError:  # the engine closed its end: nobody to answer
            return
        except BaseException:
            logger.exception("kvtier spill process: answering failed; exiting")
            os._exit(1)

    send(("ready",))
    answerer = threading.Thread(target=answer, name="kvtier-spill-answer", daemon=True)
    answerer.start()
    handlers: dict[str, Callable[..., None]] = {
        "spill": engine.submit_spill,
        "promote": lambda job_id, items, _seqs: engine.submit_promote(job_id, items),
    }
    try:
        while True:
            msg = req.recv()  # EOFError: the engine left or closed us
            if msg[0] == "reset":
                for store in stores:
                    store.mark_reset()
                continue
            if msg[0] == "cancel":
                engine.cancel_queued()
                continue
            kind, job_id, items, first_seqs = msg
            try:
                handlers[kind](job_id, items, first_seqs)
            except Exception as exc:
                logger.error("kvtier spill process: job %d refused: %s", job_id, exc)
                keys = list(dict.fromkeys(k for k, _, _ in items))
                stats = [astuple(store.stats()) for store in stores]
                job = FinishedJob(job_id, False, 0, 0.0, keys, keys, kind == "spill")
                send(("done", *astuple(job), stats))
    finally:
        stopping.set()
        if engine.shutdown(timeout=CLOSE_TIMEOUT_S):
            for store in stores:
                store.close()


def child_main(argv: list[str]) -> int:
    """The child's side: reopen each rank's store for writing and map its
    rows (both described by the first message, the rows' descriptors
    passed), then run each job it is sent on a ``TransferEngine``:
    ``("ready",)`` once, then one ``("done", *FinishedJob's fields,
    per-rank store counters)`` per job, in the order they finish; ``("reset",)`` and
    ``("cancel",)`` act between the jobs sent before and after them. It
    exits when the request pipe closes, after the jobs it holds finished."""
    parent, req_fd, resp_fd = (int(a) for a in argv[1:4])
    die_with_parent(parent)
    stay_off_the_terminal()
    name_this_thread(CHILD_NAME)
    req = Connection(req_fd, writable=False)
    send = replying(resp_fd, CHILD_NAME)
    with contextlib.suppress(BrokenPipeError, EOFError):
        _serve(req, send)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv))
