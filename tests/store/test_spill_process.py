"""The spill process (kvtier.store.spill_process): the scheduler side's disk
jobs run in a child over the same slab files and CPU tier rows.

Real files, a real child, a real CPU tier file (made here as a worker
makes it, attached as the scheduler side attaches it). What the child wrote
is read back here through the store, byte for byte; a stopped or killed
child costs its jobs (failed whole, as I/O failures), never a hang, and
later jobs run in the engine's process."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import BLOCK_BYTES

from kvtier.host.cpu_tier import AttachedRows, CpuBlockBuffer
from kvtier.store import child_process, spill_process
from kvtier.store import runtime as runtime_mod
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.runtime import DiskRuntime
from kvtier.store.slabs import SlabStats
from kvtier.store.slot import LayoutFingerprint, ReadOutcome, SlotHeader
from kvtier.store.store import DiskStore
from kvtier.store.transfers import FinishedJob
from kvtier.testing.procs import terminal_standing, wait_gone
from kvtier.tiers.plans import PromoteOrder, SpillOrder

ROWS = 32
SLOTS = 64
DEADLINE_S = 30.0


def key_of(i: int) -> bytes:
    return b"spill-process-key-" + i.to_bytes(4, "big")


class Rig:
    """A CPU tier of ROWS rows (the worker's file, random bytes), a store of
    SLOTS slots and a runtime over them, jobs in a spill process."""

    def __init__(self, tmp_path: Path, fingerprint: LayoutFingerprint) -> None:
        path = str(tmp_path / "cpu" / "tier.cpu")
        os.makedirs(os.path.dirname(path), mode=0o700)
        self.worker = CpuBlockBuffer(ROWS, BLOCK_BYTES, path, owner=True)
        rng = np.random.default_rng(7)
        self.worker.array[:] = rng.integers(0, 256, self.worker.array.shape, np.uint8)
        self.store = DiskStore(
            [str(tmp_path / "disk")], SLOTS, BLOCK_BYTES, fingerprint, backend="posix"
        )
        self.runtime = DiskRuntime(
            [self.store], [AttachedRows(path, ROWS, BLOCK_BYTES)], spill_process=True
        )
        self.next_job = 0
        self.slot = 0

    def spill(self, rows: list[int]) -> tuple[int, list[tuple[bytes, int, int]]]:
        """Submit a spill of ``rows`` to fresh slots; (job id, items)."""
        self.next_job += 1
        items = []
        for row in rows:
            items.append((key_of(self.slot), row, self.slot))
            self.slot += 1
        self.runtime.submit_spill(SpillOrder(self.next_job, items))
        return self.next_job, items

    def finished(self, job_id: int) -> FinishedJob:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            for job in self.runtime.poll():
                if job.job_id == job_id:
                    return job
            assert time.monotonic() < deadline, f"job {job_id} never finished"
            time.sleep(0.005)

    def all_finished(self, job_ids: list[int]) -> dict[int, FinishedJob]:
        """The results of ``job_ids``, by id, whatever order they finish in."""
        deadline = time.monotonic() + DEADLINE_S
        done: dict[int, FinishedJob] = {}
        while len(done) < len(job_ids):
            done.update((job.job_id, job) for job in self.runtime.poll())
            assert time.monotonic() < deadline, f"jobs {job_ids} never finished"
            time.sleep(0.005)
        return done

    def in_child(self) -> int:
        """Spill one block (the first job starts the child, and runs here),
        then wait until jobs run in the child; its pid."""
        job_id, _ = self.spill([0])
        assert self.finished(job_id).success
        deadline = time.monotonic() + DEADLINE_S
        while self.runtime.spill_pid is None:
            assert time.monotonic() < deadline, "the spill process never started"
            time.sleep(0.01)
        pid = self.runtime.spill_pid
        assert pid is not None and pid != os.getpid()
        return pid

    def read(self, slot: int) -> tuple[ReadOutcome, np.ndarray]:
        out = np.zeros(BLOCK_BYTES, np.uint8)
        return self.store.read_block(slot, key_of(slot), out), out

    def header(self, slot: int) -> SlotHeader:
        from kvtier.store.slot import HEADER_SIZE

        idx, offset = self.store.files.offset_of(slot)
        with open(self.store.files.slabs[idx].path, "rb") as f:
            f.seek(offset)
            return SlotHeader.unpack(f.read(HEADER_SIZE))

    def child_stats(self) -> SlabStats:
        """The spill process's store counters, as of its last answer."""
        (stats,) = self.runtime._process.stats()
        return stats

    def close(self) -> None:
        self.runtime.close()
        self.worker.close()


@pytest.fixture
def rig(tmp_path: Path, fingerprint: LayoutFingerprint) -> Iterator[Rig]:
    r = Rig(tmp_path, fingerprint)
    try:
        yield r
    finally:
        r.close()


def test_the_child_writes_the_blocks_the_rows_hold(rig: Rig) -> None:
    rig.in_child()
    writes_here = rig.store.stats().blocks_written
    job_id, items = rig.spill(list(range(ROWS)))
    job = rig.finished(job_id)
    assert job.success and job.bytes == ROWS * BLOCK_BYTES
    for _key, row, slot in items:
        outcome, got = rig.read(slot)
        assert outcome is ReadOutcome.OK
        assert np.array_equal(got, rig.worker.array[row]), slot
    # Written there, not here: the child's counters, which the runtime adds.
    assert rig.store.stats().blocks_written == writes_here
    assert rig.child_stats().blocks_written == ROWS
    # Seqs reserved here, in item order, above every earlier block's.
    seqs = [rig.header(slot).seq for _, _, slot in items]
    assert seqs == list(range(seqs[0], seqs[0] + ROWS))
    assert all(rig.header(s).seq < seqs[0] for s in range(items[0][2]))
    assert rig.store.next_seq() > seqs[-1]


def test_promotions_in_the_child_fill_the_rows(rig: Rig) -> None:
    rig.in_child()
    job_id, items = rig.spill([3, 4, 5])
    assert rig.finished(job_id).success
    want = rig.worker.array[[3, 4, 5]].copy()
    rig.worker.array[10:13] = 0
    reads_here = rig.store.stats().blocks_read
    promote = [(key, slot, 10 + i) for i, (key, _row, slot) in enumerate(items)]
    rig.runtime.submit_promote(PromoteOrder(99, promote))
    assert rig.finished(99).success
    assert np.array_equal(rig.worker.array[10:13], want)
    # Read there, not here.
    assert rig.store.stats().blocks_read == reads_here
    assert rig.child_stats().blocks_ok == 3


def test_a_reset_reaches_the_child_in_order(rig: Rig) -> None:
    rig.in_child()
    before, _ = rig.spill([1])
    rig.runtime.drain(DEADLINE_S)
    rig.runtime.mark_reset()
    after, _ = rig.spill([2])
    assert rig.finished(before).success and rig.finished(after).success
    first = rig.slot - 2
    assert not rig.header(first).after_reset
    assert rig.header(first + 1).after_reset
    assert rig.child_stats().blocks_written == 2  # both written there


def _held_spawn(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Spawns of the spill process wait for the event returned (a child
    that takes long to start)."""
    release = threading.Event()
    real = child_process.spawn

    def slow_spawn(*args):
        release.wait(DEADLINE_S)
        return real(*args)

    monkeypatch.setattr(child_process, "spawn", slow_spawn)
    return release


def test_a_reset_while_the_child_starts_reaches_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's configuration says whether the stores were reset; a
    reset after it was made, while the child was starting, must reach the
    child too, before any job: blocks it wrote unflagged would be adopted
    by a warm restart under other weights."""
    release = _held_spawn(monkeypatch)
    first, _ = rig.spill([1])  # asks for the child; runs here
    assert rig.finished(first).success
    rig.runtime.drain(DEADLINE_S)
    rig.runtime.mark_reset()  # the child is not there yet
    release.set()
    rig.in_child()
    written = rig.child_stats().blocks_written
    after, _ = rig.spill([2])
    assert rig.finished(after).success
    assert rig.child_stats().blocks_written == written + 1  # written there
    assert not rig.header(0).after_reset  # before the reset, written here
    assert rig.header(rig.slot - 1).after_reset


def test_giving_up_while_the_child_starts_leaves_no_child(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain that timed out gives the spill process up; one still being
    started then is stopped as well, never left running unseen."""
    release = _held_spawn(monkeypatch)
    job, _ = rig.spill([1])
    assert rig.finished(job).success
    process = rig.runtime._process
    assert process is not None and process._starter is not None
    giving_up = threading.Thread(target=process.give_up)
    giving_up.start()
    giving_up.join(0.2)
    release.set()  # the start under way finishes, and is stopped
    giving_up.join(DEADLINE_S)
    assert not giving_up.is_alive()
    assert process.pid is None and process._proc is None
    process._starter.thread.join(DEADLINE_S)
    assert not process._starter.thread.is_alive()
    children = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "-f", "kvtier.store.spill_process"],
        capture_output=True,
        text=True,
    )
    assert children.stdout.strip() == ""  # none left running


def test_a_cancel_reaches_the_child_in_order(rig: Rig) -> None:
    """The child's engine cancels what it holds queued when the cancel
    arrives, between the jobs sent before and after it. Sent while the
    child is stopped, twelve jobs of 4 blocks (a batch per block, on its
    four threads) are all in its pipe when it reads the cancel: batches its
    threads started by then are written, the others cancelled. Every block
    is either written and readable or cancelled (never a failure of the
    drive), and the job sent after the cancel is written whole."""
    pid = rig.in_child()
    os.kill(pid, signal.SIGSTOP)
    try:
        sent = [rig.spill([(4 * j + i) % ROWS for i in range(4)]) for j in range(12)]
        rig.runtime.cancel_queued()
        after = rig.spill([3])
    finally:
        os.kill(pid, signal.SIGCONT)
    results = rig.all_finished([job_id for job_id, _ in sent] + [after[0]])
    cancelled = 0
    for job_id, items in sent:
        job = results[job_id]
        assert job.lost_keys == job.io_failed_keys == job.cancelled_keys
        cancelled += len(job.cancelled_keys)
        for key, row, slot in items:
            outcome, got = rig.read(slot)
            if key in job.cancelled_keys:
                assert outcome is not ReadOutcome.OK
            else:
                assert outcome is ReadOutcome.OK
                assert np.array_equal(got, rig.worker.array[row])
    assert cancelled > 0
    job = results[after[0]]
    assert job.success and job.cancelled_keys == []
    outcome, got = rig.read(after[1][0][2])
    assert outcome is ReadOutcome.OK and np.array_equal(got, rig.worker.array[3])
    # (The first spill of in_child ran here, before the child was ready.)
    assert rig.child_stats().blocks_written == 48 - cancelled + 1


def test_the_engines_loop_looks_at_the_pipe_only_when_an_answer_is_due(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's loop polls at every step, and an in-process engine's
    loop never blocks. A look at the pipe is a system call, which hands the
    interpreter lock over: made at every step, it starved the engine's other
    threads (make demo's first disk loads: 5.9 s instead of 0.12 s). Nothing
    held: no look at all; a job held: at most one look per switch interval."""
    pid = rig.in_child()
    looks: list[float] = []
    real = spill_process.receive

    def counted(pipes: object, timeout: float) -> object:
        looks.append(timeout)
        return real(pipes, timeout)

    monkeypatch.setattr(spill_process, "receive", counted)
    for _ in range(20_000):
        assert rig.runtime.poll() == []
    assert looks == []

    os.kill(pid, signal.SIGSTOP)  # the job stays held: an answer is due
    try:
        job_id, _ = rig.spill([5])
        steps, started = 0, time.monotonic()
        while steps < 20_000 or not looks:
            assert rig.runtime.poll() == []
            steps += 1
            assert time.monotonic() - started < DEADLINE_S, "never looked"
        elapsed = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(timeout == 0.0 for timeout in looks)
    assert len(looks) <= elapsed / sys.getswitchinterval() + 2, (len(looks), steps)
    assert rig.finished(job_id).success


def test_the_first_jobs_thread_neither_waits_for_the_child_nor_takes_it_along(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first job asks for the child and runs here at once. The thread
    that submitted it once started the child itself: it waited until the
    child ran (the scheduler's step; 9.3 s seen for the worker's read
    process on a busy CPU), and the child died with it when it exited (the
    kernel's parent-death signal follows the starting thread): an
    in-process engine driven from a pool's threads lost its spill process
    with the first thread that retired."""
    release = threading.Event()
    spawned: list[bool] = []
    real = child_process.spawn

    def slow_spawn(*args):
        release.wait(DEADLINE_S)
        spawned.append(True)
        return real(*args)

    monkeypatch.setattr(child_process, "spawn", slow_spawn)
    seen: dict[str, object] = {}

    def pool_thread() -> None:  # submits the first job, then retires
        job_id, _ = rig.spill([0])
        seen["spawned_when_submit_returned"] = bool(spawned)
        seen["job"] = rig.finished(job_id)

    t = threading.Thread(target=pool_thread)
    t.start()
    t.join(DEADLINE_S + 5)
    assert not t.is_alive(), "the first job's submit did not return"
    assert seen["spawned_when_submit_returned"] is False
    assert seen["job"].success  # ran here
    release.set()
    pid = rig.in_child()
    job_id, items = rig.spill(list(range(1, 9)))
    assert rig.finished(job_id).success
    assert rig.runtime.spill_pid == pid  # the same child, alive
    assert rig.child_stats().blocks_written >= 8
    for _key, row, slot in items:
        outcome, got = rig.read(slot)
        assert outcome is ReadOutcome.OK and np.array_equal(got, rig.worker.array[row])


@pytest.mark.skipif(
    sys.platform != "linux" or sys.version_info < (3, 11),
    reason="reads /proc; Python 3.10 gives the child a session of its own",
)
def test_the_child_is_in_the_engines_session_and_a_group_of_its_own(
    rig: Rig,
) -> None:
    """As the read process (tests/reliability/test_read_process.py): the
    engine's session (its autogroup, its share of the CPU), a process
    group of its own (Ctrl-C is the engine's), SIGTTOU ignored."""
    assert terminal_standing(rig.in_child()) == (True, True, True)


def test_the_childs_log_lines_are_logged_by_the_engine_as_the_childs(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """The child's records reach the engine's loggers (vLLM's handlers and
    format), naming the child: its back-end line, at INFO, reached no one."""
    with caplog.at_level("INFO", logger="vllm.kvtier"):
        pid = rig.in_child()
        deadline = time.monotonic() + DEADLINE_S
        while not [r for r in caplog.records if r.process == pid]:
            assert time.monotonic() < deadline, caplog.text
            rig.runtime.poll()
            time.sleep(0.01)
    (said,) = [r for r in caplog.records if r.process == pid]
    assert said.levelname == "INFO" and said.processName == spill_process.CHILD_NAME
    assert said.getMessage() == (
        "kvtier disk I/O back end: posix (the spill process's writes, as the engine's)"
    )


def test_a_killed_child_fails_its_jobs_and_later_ones_run_here(rig: Rig) -> None:
    pid = rig.in_child()
    os.kill(pid, signal.SIGSTOP)  # holds the job: it cannot answer
    job_id, items = rig.spill([6, 7])
    os.kill(pid, signal.SIGKILL)
    job = rig.finished(job_id)
    keys = [key for key, _, _ in items]
    assert not job.success and job.lost_keys == keys and job.io_failed_keys == keys
    assert rig.runtime.spill_pid is None
    # From now on in this process, and still right.
    writes_here = rig.store.stats().blocks_written
    job_id, items = rig.spill([8])
    assert rig.finished(job_id).success
    assert rig.store.stats().blocks_written == writes_here + 1
    outcome, got = rig.read(items[0][2])
    assert outcome is ReadOutcome.OK and np.array_equal(got, rig.worker.array[8])


def test_a_stall_in_the_child_is_said_with_where_its_threads_stand(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stall watch's line names the spill process and its threads'
    scheduler states: stopped (T) here; D would be a hung drive, R with a
    long wait a child starved of CPU."""
    monkeypatch.setattr(runtime_mod, "STALL_S", 0.3)
    pid = rig.in_child()
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.kvtier"):
            job_id, _ = rig.spill([5])
            deadline = time.monotonic() + DEADLINE_S
            while "no disk job has finished" not in caplog.text:
                assert time.monotonic() < deadline, "the stall was never said"
                assert rig.runtime.poll() == []
                time.sleep(0.01)
        said = next(m for m in caplog.messages if "no disk job has finished" in m)
        assert f"jobs run in spill process {pid}: threads T" in said, said
        assert re.search(r"\d+\.\d\d s on a CPU, \d+\.\d\d s waiting for one", said)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert rig.finished(job_id).success  # and it went on


def test_a_stopped_child_is_given_up_by_a_drain_that_times_out(rig: Rig) -> None:
    pid = rig.in_child()
    os.kill(pid, signal.SIGSTOP)
    job_id, items = rig.spill([9])
    started = time.monotonic()
    assert rig.runtime.drain(0.5) is False
    assert time.monotonic() - started < DEADLINE_S
    assert rig.runtime.broken is not None
    job = rig.finished(job_id)
    assert not job.success and job.io_failed_keys == [items[0][0]]
    assert wait_gone(pid, DEADLINE_S)  # killed


def test_close_ends_the_child(rig: Rig) -> None:
    pid = rig.in_child()
    rig.runtime.close()
    assert wait_gone(pid, DEADLINE_S)


def test_a_slab_swapped_under_its_name_is_never_written(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """A reopened store writes through the descriptor the store that made
    the slab checked and opened (given, here duplicated in its own process),
    so a file planted under the slab's name is never written; a helper
    without that descriptor opens the slab by name, and refuses a file that
    is not the one checked."""
    with DiskStore([str(tmp_path)], 8, BLOCK_BYTES, fingerprint, backend="posix") as s:
        reopen = s.reopener()
        path = s.files.slabs[0].path
        os.rename(path, path + ".old")
        with open(path, "wb") as f:
            f.truncate(os.path.getsize(path + ".old"))
        other = reopen(PosixBackend())
        try:
            data = np.arange(BLOCK_BYTES, dtype=np.uint8)
            other.write_block(0, key_of(0), data, 1)
        finally:
            other.close()
        # Written into the checked file, now named .old; still readable here
        # (the store's own descriptor outlived the helper's close).
        out = np.zeros(BLOCK_BYTES, np.uint8)
        assert s.read_block(0, key_of(0), out) is ReadOutcome.OK
        assert np.array_equal(out, data)
        assert os.path.getsize(path) == os.path.getsize(path + ".old")
        with open(path, "rb") as f:
            assert not any(f.read())  # nothing written into the planted file
        # A process that was not given the descriptor (its number is a file
        # of its own there): by name, refused, and its own file left open.
        (fd,) = s.files.descriptors()
        probe = (
            "import os, pickle, sys\n"
            "import numpy as np\n"
            "from kvtier.store.backends.posix import PosixBackend\n"
            f"mine = os.open({str(tmp_path / 'mine')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
            f"os.dup2(mine, {fd})\n"
            "store = pickle.loads(sys.stdin.buffer.read())(PosixBackend())\n"
            "try:\n"
            f"    store.write_block(1, b'k', np.zeros({BLOCK_BYTES}, np.uint8), 2)\n"
            "    print('written')\n"
            "except PermissionError as exc:\n"
            "    print('refused', exc)\n"
            "finally:\n"
            "    store.close()\n"
            f"os.fstat({fd})  # still this process's own file\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe],
            input=pickle.dumps(reopen),
            capture_output=True,
            timeout=DEADLINE_S,
            check=True,
        )
        assert done.stdout.decode().startswith("refused"), done
        with open(path, "rb") as f:
            assert not any(f.read())


def test_a_store_directory_removed_before_the_first_spill(rig: Rig) -> None:
    """The child is given the slabs as the store's open descriptors: a store
    directory removed (or swapped) after engine start, before the child
    started, leaves spills working, as they do in the engine's process."""
    shutil.rmtree(rig.store.files.dirs[0])
    rig.in_child()
    job_id, items = rig.spill(list(range(8)))
    assert rig.finished(job_id).success
    assert rig.child_stats().blocks_written == 8
    for _key, row, slot in items:
        outcome, got = rig.read(slot)
        assert outcome is ReadOutcome.OK
        assert np.array_equal(got, rig.worker.array[row]), slot


def test_a_child_that_never_starts_leaves_the_jobs_here(
    tmp_path: Path, fingerprint: LayoutFingerprint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that exits before it is ready (here: a module that does not
    exist) costs nothing: every job runs in this process, right."""
    real = child_process.spawn
    monkeypatch.setattr(
        child_process,
        "spawn",
        lambda module, fds, args=(): real("kvtier.store.no_such", fds, args),
    )
    rig = Rig(tmp_path, fingerprint)
    try:
        for _ in range(3):
            job_id, items = rig.spill([11, 12])
            assert rig.finished(job_id).success
        process = rig.runtime._process
        assert process.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while process._proc is not None:  # seen gone at a later call
            assert time.monotonic() < deadline, "the dead child was never seen"
            rig.runtime.poll()
            time.sleep(0.01)
        assert rig.runtime.spill_pid is None
        assert rig.child_stats().blocks_written == 0
        assert rig.store.stats().blocks_written == 6
        for _key, row, slot in items:
            outcome, got = rig.read(slot)
            assert outcome is ReadOutcome.OK and np.array_equal(
                got, rig.worker.array[row]
            )
    finally:
        rig.close()


def test_every_rank_spills_in_the_child(
    tmp_path: Path, fingerprint_factory: Callable[..., LayoutFingerprint]
) -> None:
    """Two TP ranks: two stores, two CPU tier files, each rank's rows into
    its own store, each with the seqs reserved from its own store."""
    workers, stores, rows = [], [], []
    for rank in range(2):
        path = str(tmp_path / f"cpu{rank}" / "tier.cpu")
        os.makedirs(os.path.dirname(path), mode=0o700)
        worker = CpuBlockBuffer(ROWS, BLOCK_BYTES, path, owner=True)
        worker.array[:] = rank + 1 + np.arange(ROWS, dtype=np.uint8)[:, None]
        workers.append(worker)
        fp = fingerprint_factory(tp_rank=rank)
        stores.append(
            DiskStore([str(tmp_path / "disk")], SLOTS, BLOCK_BYTES, fp, backend="posix")
        )
        rows.append(AttachedRows(path, ROWS, BLOCK_BYTES))
    runtime = DiskRuntime(stores, rows, spill_process=True)
    try:
        runtime.submit_spill(SpillOrder(1, [(key_of(0), 0, 0)]))  # starts it
        deadline = time.monotonic() + DEADLINE_S
        while runtime.spill_pid is None:
            assert time.monotonic() < deadline, "the spill process never started"
            runtime.poll()
            time.sleep(0.01)
        first = [store.next_seq() for store in stores]
        items = [(key_of(slot), slot, slot) for slot in range(1, 9)]
        runtime.submit_spill(SpillOrder(2, items))
        done: list[FinishedJob] = []
        while not any(job.job_id == 2 for job in done):
            assert time.monotonic() < deadline, "job 2 never finished"
            done += runtime.poll()
            time.sleep(0.005)
        assert all(job.success for job in done)
        for rank, store in enumerate(stores):
            assert store.stats().blocks_written <= 1  # job 1 at most, here
            for _key, row, slot in items:
                out = np.zeros(BLOCK_BYTES, np.uint8)
                assert store.read_block(slot, key_of(slot), out) is ReadOutcome.OK
                assert np.array_equal(out, workers[rank].array[row]), (rank, slot)
            assert store.next_seq() > first[rank] + len(items)
        assert [s.blocks_written >= 8 for s in runtime._process.stats()] == [True, True]
    finally:
        runtime.close()
        for worker in workers:
            worker.close()
