"""Disk reads of loads, and their verification, in a process of their own:
both ends, and the pipes between them.

:class:`ReadProcess` is a :class:`~kvtier.store.reader.SlotReads` for the
worker's load thread whose reads and checks run in a child process
(:func:`child_main`, ``python -m kvtier.store.read_process``): the bounce
area is a memory file (``memfd``) both processes map, the child reads slots
into it with its own back end and verifies them with the one
:class:`~kvtier.store.reader.SlotReader`, and sends back one message per
batch (each slot's outcome and row). The engine's process keeps only what
must touch its memory: copying verified rows into the KV cache.

Why: the engine's loop and the load thread share one interpreter lock,
which every returning read and every slot check takes back from the loop;
in a process of their own they cost the engine one message per batch
(docs/benchmarks.md, "Engine step stalls").

Contract (beyond :class:`~kvtier.store.reader.SlotReads`):
  - The child is asked for in :meth:`ReadProcess.start` (the load thread's
    turns), not at construction, once every slab is open here: it is given
    them as these descriptors, never their names. Until it says it is
    ready, batches are read in this process by a ``SlotReader`` over the
    same area (the same outcomes).
  - ``start`` never waits for a process to start: the reader's
    :class:`~kvtier.store.child_process.ChildStarter`, made at construction
    (on the worker's thread, at its priority), starts the child on the
    CPUs of the thread that asked; the child takes that thread's nice level
    once its imports are done (started at nice 10 on a busy CPU, it took
    as long again to import).
  - If the child dies or its pipe breaks, the batches it held fail as
    IO_ERROR (their blocks are recomputed, never served), it is reaped, and
    later batches are read in this process: a missing child costs speed,
    never a load.
  - A batch's rows are written by one process only, and only until its
    outcome arrived (or the child is known dead).
  - The child holds nothing beyond its own fds: it exits when the worker's
    end of the request pipe closes (``close``, or the worker's process
    dying) and, on Linux, is killed with the thread that started it (its
    starter's, which stays until close; ``PR_SET_PDEATHSIG``).
  - No call waits on the child beyond its own timeout (``submit``,
    ``ready``: not at all): :class:`PipeChannel` sends a request the pipe
    cannot take yet on later calls, and takes an answer the child wrote part
    of whole on a later call. A child that stops reading (stopped, or its one
    thread on a hung read) holds its batches only, until ``abandon`` (the
    load thread giving a batch up at its end) stops it after
    ``ABANDON_WAIT_S``, as if it had died.
  - Used by one thread (the load thread); ``stats()`` from any thread.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection

import numpy as np

from kvtier.host.placement import (
    lower_thread_priority_to,
    name_this_thread,
    thread_placement,
)
from kvtier.log import get_logger
from kvtier.store.child_process import (
    KILL_WAIT_S,
    PIPE_WAIT_S,
    ChildStarter,
    PipeChannel,
    SchedulingWatch,
    die_with_parent,
    log_level,
    receive,
    replying,
    set_log_level,
    start_configured,
    stay_off_the_terminal,
    stop,
)
from kvtier.store.reader import PendingRead, SlotRead, SlotReader, unallocatable
from kvtier.store.slabs import SlabFiles, SlabStats
from kvtier.store.slot import ReadOutcome

logger = get_logger("store")

# How long close() waits for the child to exit before it kills it.
CLOSE_WAIT_S = 5.0
# How long abandon() waits for the child's answer before it stops the child.
ABANDON_WAIT_S = 5.0
# The child's name in ps and top (its read threads are kvtier-posix_N).
CHILD_NAME = "kvtier-read"


@dataclass(eq=False)
class ProcessRead:
    """A batch handed to the child: its id and items; ``result`` once the
    child answered (``[]`` standing for "every item failed")."""

    rid: int
    items: list[tuple[int, bytes | None]]
    first_row: int
    result: list[SlotRead] | None = None


class ReadProcess:
    """Reads and verifies disk slots in a child process (see the module doc).

    ``spawn`` False (a class attribute, for tests whose back end must see
    every read) keeps every read in this process.
    """

    spawn = True

    def __init__(
        self, files: SlabFiles, *, capacity: int, disk_io: str, threads: int
    ) -> None:
        self.slot_size = files.slot_size
        nbytes = capacity * self.slot_size
        self._fd = os.memfd_create("kvtier-bounce", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED)
        except OSError as exc:
            os.close(self._fd)
            raise unallocatable(nbytes, exc) from exc
        except BaseException:
            os.close(self._fd)
            raise
        area = np.frombuffer(self._map, dtype=np.uint8)
        area.fill(0)  # its pages in now, not during the first load
        # Reads here while the child starts, and after it is gone.
        self._local = SlotReader(files, area=area)
        self.backend = files.backend  # this process's (the child makes its own)
        self.capacity = self._local.capacity
        self.rows = self._local.rows
        self.pinned = False
        self.files = self._local.files
        self._child_config = {
            "disk_io": disk_io,
            "threads": threads,
            "nbytes": nbytes,
            "log_level": log_level(),
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipes: PipeChannel | None = None
        self._ready = False
        self._next = 0
        self._held: dict[int, ProcessRead] = {}
        self._child_stats = SlabStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._cpus: set[int] | None = None  # the asking thread's
        self._watch = SchedulingWatch()  # the child's, for describe
        self._starter = (
            ChildStarter("kvtier-starter", self._start_child) if self.spawn else None
        )

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Ask for the child (once), if every slab can be opened here now;
        batches go to it once it is ready. Until then they are read here,
        and each call tries again (the load thread's turns). Never waits for
        the child: the reader's starter thread starts it."""
        if self._closed:
            return
        # The child is given the slabs as descriptors open here, never
        # their names (a store directory removed or swapped under the
        # engine would fail every read there), so it waits for all of them:
        # a new store's slabs exist once the scheduler side made them.
        files = self._local.files
        opened = files.open_all()
        starter = self._starter
        if not self.spawn or starter is None or starter.asked:
            return  # spawn: a class attribute, False in some tests
        if opened < len(files.slabs):
            return
        self._child_config["files"] = files.reopener()
        self._child_config["nice"], self._cpus = thread_placement()
        starter.ask()

    def _start_child(self) -> tuple[subprocess.Popen[bytes], PipeChannel] | None:
        """On the starter's thread: the child, started where the asking
        thread runs, and its pipes; None (logged) when it cannot start."""
        if self._cpus:
            try:  # the child inherits this thread's CPUs
                os.sched_setaffinity(0, self._cpus)
            except OSError as exc:
                logger.debug("kvtier: read process CPUs unchanged: %s", exc)
        return start_configured(
            "kvtier.store.read_process",
            [self._fd, *self._local.files.descriptors()],
            [str(self._fd)],
            self._child_config,
            "read process",
            "loads read in the engine's process",
        )

    def _adopt(self) -> None:
        """Take the child the starter started, once it has. On the load
        thread; ``close`` takes it instead once the load thread stopped
        (the worker closes the reader only then), never both at once."""
        if self._starter is not None and self._proc is None:
            started = self._starter.take()
            if started is not None:
                self._proc, self._pipes = started

    def close(self) -> None:
        """Stop the child (waits up to ``CLOSE_WAIT_S``, then kills it and
        waits as long again), then unmap. A child the kill does not end in
        that time (stuck in the kernel: a read from a hung mount) is left,
        named in the log, rather than hang the worker's shutdown; it dies
        when its read returns."""
        if self._closed:
            return
        self._closed = True
        if self._starter is not None:
            started = self._starter.close()  # none starts from now on
            if started is not None:  # started, not taken yet
                self._proc, self._pipes = started
        if self._pipes is not None:
            self._pipes.close()  # the child reads EOF and exits
        if self._proc is not None:
            stop(self._proc, CLOSE_WAIT_S, "read process")
        if self._starter is not None:
            self._starter.release()  # the kernel kills a child left behind
        self._local.close()
        # Unmapped once the last view is gone (the worker's copy paths may
        # still hold views of the rows); the memory file goes with the fd.
        self.rows = None
        self._map = None
        os.close(self._fd)

    @property
    def running(self) -> bool:
        """Whether batches go to the child (it said it is ready)."""
        return self._ready

    @property
    def pid(self) -> int | None:
        """The child's process id, while there is one."""
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    def describe(self) -> str:
        """Where the reads run, for logs and reports; for the read process,
        the batches it holds and how its threads stand with the CPU
        scheduler (why it may not have answered)."""
        pid = self.pid
        if not self.running or pid is None:
            return f"engine's process; {self.backend.describe()}"
        unsent = 0 if self._pipes is None else self._pipes.unsent
        state = self._watch.look(pid)
        return (
            f"read process {pid}: {len(self._held)} batches held, {unsent} bytes "
            f"not sent yet, {state}; {self.backend.describe()}"
        )

    def stats(self) -> SlabStats:
        local = self._local.stats()
        with self._stats_lock:
            child = self._child_stats
        return SlabStats(*(a + b for a, b in zip(astuple(local), astuple(child))))

    # ------------------------------------------------------------ the reads

    def submit(
        self, items: Sequence[tuple[int, bytes | None]], first_row: int = 0
    ) -> ProcessRead | PendingRead:
        self.poll(0.0)
        if not self._ready or self._pipes is None:
            return self._local.submit(items, first_row)
        if not 0 <= first_row <= self.capacity - len(items):
            raise ValueError(
                f"{len(items)} slots from row {first_row} exceed capacity "
                f"{self.capacity}"
            )
        # The protocol's IndexError, here: in the child it would fail the
        # whole batch as an I/O error instead, valid slots included.
        num_slots = self._local.files.num_slots
        for slot, _ in items:
            if not 0 <= slot < num_slots:
                raise IndexError(f"slot {slot} out of range [0, {num_slots})")
        self._next += 1
        read = ProcessRead(self._next, list(items), first_row)
        self._held[read.rid] = read
        try:  # never waits: what the pipe cannot take yet goes out later
            self._pipes.send((read.rid, read.items, first_row))
        except OSError:
            self._lost("its pipe broke")
        return read

    def ready(self, pending: ProcessRead | PendingRead) -> bool:
        if isinstance(pending, PendingRead):
            return self._local.ready(pending)
        self.poll(0.0)
        return pending.result is not None

    def wait(self, pending: ProcessRead | PendingRead, timeout: float) -> bool:
        if isinstance(pending, PendingRead):
            return self._local.wait(pending, timeout)
        deadline = time.monotonic() + timeout
        while pending.result is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(left)
        return True

    def complete(self, pending: ProcessRead | PendingRead) -> list[SlotRead]:
        if isinstance(pending, PendingRead):
            return self._local.complete(pending)
        while pending.result is None:
            self.poll(PIPE_WAIT_S)
        if not pending.result and pending.items:
            return [SlotRead(ReadOutcome.IO_ERROR, -1) for _ in pending.items]
        return pending.result

    def abandon(self, pending: ProcessRead | PendingRead) -> None:
        if isinstance(pending, PendingRead):
            self._local.abandon(pending)
            return
        deadline = time.monotonic() + ABANDON_WAIT_S
        while pending.result is None:
            if time.monotonic() >= deadline:
                # The child does not answer (stopped, or its thread on a read
                # that does not return): stop it. Nothing writes its rows once
                # it is reaped; a read it cannot leave keeps that wait.
                self._lost("it did not answer a batch given up")
                break
            self.poll(PIPE_WAIT_S)

    # ------------------------------------------------------------ internals

    def poll(self, timeout: float) -> None:
        """Take the child's messages, waiting up to ``timeout`` for one (and
        sending on what the request pipe could not take before). Never
        longer: a message the child wrote part of waits for the next call."""
        self._adopt()
        pipes = self._pipes
        if pipes is None:
            return
        msgs, gone = receive(pipes, timeout)
        if gone is not None:
            self._lost(gone)
            return
        for msg in msgs:
            try:
                self._take(msg)
            except Exception as exc:  # not a message of ours: a bug
                self._lost(f"it answered {str(msg)[:80]} ({exc!r})")
                return

    def _take(self, msg: tuple) -> None:
        if msg[0] == "ready":
            self._ready = True
            return
        _, rid, codes, rows, stats = msg
        result = [SlotRead(ReadOutcome(c), r) for c, r in zip(codes, rows)]
        read = self._held.pop(rid, None)
        if read is not None:  # else no longer waited for
            read.result = result
        with self._stats_lock:
            self._child_stats = SlabStats(*stats)

    def _lost(self, why: str) -> None:
        """The child is gone: reap it, fail what it held, read here from now."""
        proc = self._proc
        if proc is not None:
            stop(proc, KILL_WAIT_S, "read process", kill=True)
        if not self._closed and not self._ready and not self._held:
            logger.warning(
                "kvtier: the read process did not start (%s, exit status %s); "
                "loads read in the engine's process",
                why,
                None if proc is None else proc.returncode,
            )
        elif not self._closed:
            logger.error(
                "kvtier: the read process stopped (%s, exit status %s); %d batches "
                "in flight are recomputed, later loads read in the engine's process",
                why,
                None if proc is None else proc.returncode,
                len(self._held),
            )
        for read in self._held.values():
            read.result = []
        self._held.clear()
        self._ready = False
        if self._pipes is not None:
            self._pipes.close()
        self._pipes = None
        if self._starter is not None:
            self._starter.release()  # the child is gone: its starter leaves


# ------------------------------------------------------------ the child


def _serve(fd: int, req: Connection, send: Callable[[tuple], None]) -> None:
    from kvtier.store.backends.factory import make_backend  # not in the worker

    cfg = req.recv()
    set_log_level(cfg["log_level"])
    # The asking thread's priority, now that the imports are done; before
    # the back end's threads start, which inherit it.
    lower_thread_priority_to(cfg["nice"])
    shared = mmap.mmap(fd, cfg["nbytes"], mmap.MAP_SHARED)
    area = np.frombuffer(shared, dtype=np.uint8)
    backend = make_backend(cfg["disk_io"], threads=cfg["threads"])
    reader = SlotReader(cfg["files"](backend), area=area)
    reader.files.open_all()
    send(("ready",))
    # One thread (the reader is single-threaded): start every batch that
    # arrived, then verify and answer the oldest; the back end's threads
    # read the others meanwhile.
    started: deque[tuple[int, PendingRead | None]] = deque()
    try:
        while True:
            while not started or req.poll(0):
                rid, items, first_row = req.recv()  # EOFError: the worker left
                try:
                    pending = reader.submit(items, first_row)
                except Exception:
                    logger.exception("kvtier read process: a batch could not start")
                    pending = None
                started.append((rid, pending))
            rid, pending = started.popleft()
            out: list[SlotRead] = []
            if pending is not None:
                try:
                    out = reader.complete(pending)
                except Exception:
                    logger.exception("kvtier read process: a batch raised")
            codes = [r.outcome.value for r in out]  # none: all IO_ERROR
            rows = [r.row for r in out]
            send(("done", rid, codes, rows, astuple(reader.stats())))
    finally:
        for _rid, pending in started:
            if pending is not None:
                reader.abandon(pending)
        reader.close()


def child_main(argv: list[str]) -> int:
    """The child's side: map the worker's bounce area (a memory file passed
    by fd), read and verify each batch it is sent with a
    :class:`~kvtier.store.reader.SlotReader` over it, and answer one message
    per batch in the order they came: ``("ready",)`` once, then ``("done",
    rid, outcome codes, rows, reader stats)``, no codes for a batch that
    failed whole. It exits when the request
    pipe closes."""
    parent, fd, req_fd, resp_fd = (int(a) for a in argv[1:5])
    die_with_parent(parent)
    stay_off_the_terminal()
    name_this_thread(CHILD_NAME)
    req = Connection(req_fd, writable=False)
    send = replying(resp_fd, CHILD_NAME)
    with contextlib.suppress(BrokenPipeError, EOFError):
        _serve(fd, req, send)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv))
