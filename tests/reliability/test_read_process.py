"""The worker's read process (kvtier.store.read_process): slots read and
verified in a child process into a shared bounce area give the outcomes and
bytes the in-process reader gives; a child that dies costs the batches it
held (IO_ERROR: recomputed, never served) and later batches are read in the
engine's process; closing ends the child within a deadline.

Real files written by a real DiskStore, a real child process, real signals.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from reliability_common import Rig, key_of, pattern

from kvtier.store import child_process, read_process
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.child_process import frame
from kvtier.store.read_process import CHILD_NAME, ProcessRead, ReadProcess
from kvtier.store.reader import PendingRead, SlotReader
from kvtier.store.slabs import SlabFiles
from kvtier.store.slot import HEADER_SIZE, ReadOutcome
from kvtier.testing.faults import flip_byte
from kvtier.testing.procs import terminal_standing, wait_gone

DEADLINE_S = 30.0


def _written(rig: Rig, count: int) -> list[bytes]:
    keys = [key_of(i) for i in range(count)]
    for slot, key in enumerate(keys):
        rig.store.write_block(slot, key, pattern(key), rig.store.next_seq())
    return keys


def _files(rig: Rig, backend: PosixBackend) -> SlabFiles:
    s = rig.store
    return SlabFiles.open(s.paths, s.fingerprint, s.num_slots, backend, owns_backend=True)


def _reader(rig: Rig, **kw) -> ReadProcess:
    return ReadProcess(
        _files(rig, PosixBackend(threads=2)),
        disk_io="posix",
        threads=2,
        capacity=8,
        **kw,
    )


def _running(rp: ReadProcess) -> ReadProcess:
    """Start the child and wait (with a deadline) until it takes batches."""
    rp.start()
    deadline = time.monotonic() + DEADLINE_S
    while not rp.running:
        assert time.monotonic() < deadline, "the read process did not start"
        rp.poll(0.05)
    return rp


def _serves_slot_0(rp: ReadProcess, key: bytes) -> None:
    """A batch of slot 0 goes to the child and comes back verified and
    byte-exact."""
    pending = rp.submit([(0, key)])
    assert isinstance(pending, ProcessRead)
    (got,) = rp.complete(pending)
    assert got.outcome is ReadOutcome.OK
    assert np.array_equal(rp.rows[got.row], pattern(key))


def _flip_payload_byte(rig: Rig, reader: ReadProcess, slot: int) -> None:
    offset = slot * rig.store.slot_size + HEADER_SIZE + 100
    flip_byte(reader.files.slabs[0].path, offset, 0x40)


def test_the_child_reads_and_verifies_as_the_engines_process_would(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    keys = _written(rig, 5)
    rp = _running(_reader(rig))
    try:
        _flip_payload_byte(rig, rp, 2)  # corrupt on disk
        items = [
            (0, keys[0]),
            (1, keys[1]),
            (2, keys[2]),
            (3, keys[0]),  # slot 3 holds another key
            (4, keys[4]),
            (5, key_of(5)),  # never written
        ]
        said = rp.describe()
        assert said.startswith(
            f"read process {rp.pid}: 0 batches held, 0 bytes not sent yet"
        )
        assert "; posix" in said
        pending = rp.submit(items, first_row=1)
        assert isinstance(pending, ProcessRead)  # the child read it
        got = rp.complete(pending)
        if sys.platform == "linux":  # named for ps and top, its readers too
            task = Path(f"/proc/{rp.pid}/task")
            names = {(t / "comm").read_text().strip() for t in task.iterdir()}
            assert (task / str(rp.pid) / "comm").read_text().strip() == CHILD_NAME
            assert any(n.startswith("kvtier-posix_") for n in names), names
            # It sees no accelerator (it reads into host memory; a CUDA
            # context there would take GPU memory vLLM does not count).
            environ = Path(f"/proc/{rp.pid}/environ").read_bytes().split(b"\0")
            assert b"CUDA_VISIBLE_DEVICES=" in environ, environ
        local = SlotReader(_files(rig, PosixBackend(threads=1)), capacity=8)
        try:
            want = local.read(items)
        finally:
            local.close()
        outcomes = [r.outcome for r in got]
        assert outcomes == [r.outcome for r in want]
        assert outcomes == [
            ReadOutcome.OK,
            ReadOutcome.OK,
            ReadOutcome.CHECKSUM_MISMATCH,
            ReadOutcome.KEY_MISMATCH,
            ReadOutcome.OK,
            ReadOutcome.EMPTY,
        ]
        for (_slot, key), r in zip(items, got):
            if r.outcome is ReadOutcome.OK:
                assert 1 <= r.row < 7
                assert np.array_equal(rp.rows[r.row], pattern(key))  # shared memory
        stats = rp.stats()
        assert stats.blocks_ok == 3 and stats.checksum_failures >= 1
    finally:
        rp.close()


def test_the_childs_log_lines_are_logged_by_the_engine_as_the_childs(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    """Its WARNING for a corrupt block reached stderr bare (no level, time
    or process: log-based alerting missed it, as an operator's walkthrough
    found) and its INFO lines nowhere. The child sends its records; the
    engine's loggers (vLLM's handlers and format) log them, naming the
    child, its pid, file and line."""
    rig = make_rig()
    keys = _written(rig, 3)
    rp = _running(_reader(rig))
    try:
        _flip_payload_byte(rig, rp, 1)
        with caplog.at_level("INFO", logger="vllm.kvtier"):
            got = rp.complete(rp.submit([(1, keys[1])], first_row=1))
            assert [r.outcome for r in got] == [ReadOutcome.CHECKSUM_MISMATCH]
            deadline = time.monotonic() + 30
            while not [r for r in caplog.records if r.process == rp.pid]:
                assert time.monotonic() < deadline, caplog.text
                rp.poll(0.05)
        (said,) = [r for r in caplog.records if "rejected" in r.getMessage()]
        assert said.levelname == "WARNING" and said.name.startswith("vllm.kvtier.")
        assert "payload checksum mismatch" in said.getMessage()
        assert (said.process, said.processName) == (rp.pid, CHILD_NAME)
        assert said.pathname.endswith(".py") and "kvtier" in said.pathname
        assert said.lineno > 0
    finally:
        rp.close()


def test_the_child_runs_this_kvtier_whatever_the_working_directory_holds(
    make_rig: Callable[..., Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m`` puts the working directory first on the child's path,
    ahead of the kvtier the worker runs: a ``kvtier`` package (another
    checkout, or one another user planted in a shared directory such as
    /tmp) there ran in the child instead, as this user."""
    cwd = tmp_path / "cwd"
    planted = cwd / "kvtier"
    planted.mkdir(parents=True)
    marker = cwd / "planted-code-ran"
    (planted / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n"
    )
    rig = make_rig()
    keys = _written(rig, 1)
    monkeypatch.chdir(cwd)
    rp = _reader(rig)
    try:
        _running(rp)
        assert not marker.exists()
        _serves_slot_0(rp, keys[0])
    finally:
        rp.close()


def test_a_slot_out_of_range_is_refused_as_the_protocol_says(
    make_rig: Callable[..., Rig],
) -> None:
    """SlotReads.submit raises IndexError for a slot outside the store,
    with the child running as without it, instead of the child failing the
    batch's valid slots with it as I/O errors; the child keeps serving."""
    rig = make_rig()
    keys = _written(rig, 1)
    rp = _reader(rig)
    try:
        num_slots = rig.store.num_slots
        with pytest.raises(IndexError, match="out of range"):
            rp.submit([(0, keys[0]), (num_slots, key_of(1))])  # no child yet
        _running(rp)
        with pytest.raises(IndexError, match="out of range"):
            rp.submit([(0, keys[0]), (num_slots, key_of(1))])
        _serves_slot_0(rp, keys[0])
    finally:
        rp.close()


def test_a_dead_child_costs_its_batches_then_reads_stay_here(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig()
    keys = _written(rig, 4)
    rp = _running(_reader(rig))
    try:
        pid = rp.pid
        os.kill(pid, signal.SIGSTOP)  # holds the batch: no answer can come
        held = rp.submit([(0, keys[0]), (1, keys[1])], first_row=0)
        assert isinstance(held, ProcessRead)
        assert not rp.ready(held)
        with caplog.at_level("ERROR", logger="vllm.kvtier.store"):
            os.kill(pid, signal.SIGKILL)
            assert rp.wait(held, DEADLINE_S)
        assert [r.outcome for r in rp.complete(held)] == [ReadOutcome.IO_ERROR] * 2
        assert any("read process stopped" in m for m in caplog.messages)
        assert not rp.running
        later = rp.submit([(2, keys[2]), (3, keys[3])], first_row=2)
        assert isinstance(later, PendingRead)  # read in this process
        got = rp.complete(later)
        assert [r.outcome for r in got] == [ReadOutcome.OK] * 2
        for key, r in zip(keys[2:], got):
            assert np.array_equal(rp.rows[r.row], pattern(key))
    finally:
        rp.close()


def _returns_in_time(fn: Callable[[], object]) -> bool:
    """Whether ``fn`` returned within DEADLINE_S (run on a thread)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    return not t.is_alive()


def test_a_child_that_stops_reading_never_stops_the_caller(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped child (or one whose thread waits on a hung read) drains
    neither pipe. Requests beyond the pipe's room used to block ``submit``
    in ``write``, the load thread with it, CPU-tier loads included."""
    monkeypatch.setattr(child_process, "PIPE_BYTES", 4096)  # a one-page pipe
    rig = make_rig(num_slots=8)
    keys = _written(rig, 8)
    items = list(enumerate(keys))
    rp = _running(_reader(rig))
    batches: list = []
    try:
        os.kill(rp.pid, signal.SIGSTOP)
        # 200 batches of the same 8 slots into the same 8 rows (the same bytes
        # land there whichever read writes last): ~80 KB of requests, more
        # than a default 64 KiB pipe holds.
        assert _returns_in_time(
            lambda: batches.extend(rp.submit(items) for _ in range(200))
        )
        assert all(isinstance(b, ProcessRead) for b in batches)
        assert _returns_in_time(lambda: rp.wait(batches[-1], 0.2))
        assert not rp.ready(batches[-1])
        # What a stalled load's log line says of it: every batch held, the
        # requests the pipe could not take, and its threads stopped (T).
        said = rp.describe()
        unsent = re.search(r"200 batches held, (\d+) bytes not sent yet", said)
        assert unsent and int(unsent[1]) > 0, said
        if sys.platform == "linux":
            state = r", threads T\d+; in its \d+\.\d s: \d+\.\d\d s on a CPU, "
            assert re.search(state, said), said
            again = rp.describe()  # the next look: what it got since this one
            assert re.search(r", threads T\d+; in the last \d+\.\d s: ", again), again
        os.kill(rp.pid, signal.SIGCONT)
        for b in batches:  # each sent on, read, verified and answered
            assert rp.wait(b, DEADLINE_S)
            assert [r.outcome for r in rp.complete(b)] == [ReadOutcome.OK] * 8
        for key, r in zip(keys, rp.complete(batches[-1])):
            assert np.array_equal(rp.rows[r.row], pattern(key))
    finally:
        if rp.pid is not None:
            os.kill(rp.pid, signal.SIGCONT)
        rp.close()


def test_abandoning_a_batch_a_stopped_child_holds_ends_the_child(
    make_rig: Callable[..., Rig],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The load thread's last act (its end, at shutdown) gives up the
    batches in flight; a child that never answers is stopped and reaped
    then, so the worker's shutdown completes and its rows are safe."""
    monkeypatch.setattr(read_process, "ABANDON_WAIT_S", 0.3)
    rig = make_rig()
    keys = _written(rig, 2)
    rp = _running(_reader(rig))
    try:
        pid = rp.pid
        os.kill(pid, signal.SIGSTOP)
        held = rp.submit([(0, keys[0]), (1, keys[1])], first_row=0)
        with caplog.at_level("ERROR", logger="vllm.kvtier.store"):
            assert _returns_in_time(lambda: rp.abandon(held))
        assert [r.outcome for r in rp.complete(held)] == [ReadOutcome.IO_ERROR] * 2
        assert any("did not answer a batch given up" in m for m in caplog.messages)
        assert wait_gone(pid, DEADLINE_S)  # killed
        later = rp.submit([(1, keys[1])], first_row=1)
        assert isinstance(later, PendingRead)  # read in this process now
        assert [r.outcome for r in rp.complete(later)] == [ReadOutcome.OK]
    finally:
        rp.close()


@pytest.mark.parametrize(
    "garbage",
    [frame(("done", "not an id")), frame(("done", 1, [99], [0], ())), b"\0\0\0\2xx"],
    ids=["short", "unknown-outcome", "not-a-pickle"],
)
def test_an_answer_that_does_not_read_costs_the_child_not_the_load_thread(
    make_rig: Callable[..., Rig], garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A message of the wrong shape (a bug on either side) is the child
    lost: what it held fails (recomputed), later reads run here; nothing
    escapes into the load thread, which would stop serving loads."""
    rig = make_rig()
    keys = _written(rig, 2)
    rp = _running(_reader(rig))
    try:
        os.kill(rp.pid, signal.SIGSTOP)  # its own answer cannot come first
        held = rp.submit([(0, keys[0])], first_row=0)
        assert rp._pipes is not None
        rp._pipes._inbox += garbage  # as if the child had sent it
        with caplog.at_level("ERROR", logger="vllm.kvtier.store"):
            rp.poll(0.0)
        assert [r.outcome for r in rp.complete(held)] == [ReadOutcome.IO_ERROR]
        assert any("read process stopped" in m for m in caplog.messages)
        later = rp.submit([(1, keys[1])], first_row=1)
        assert isinstance(later, PendingRead)
        assert [r.outcome for r in rp.complete(later)] == [ReadOutcome.OK]
    finally:
        rp.close()


# An engine's process of its own (its own session, so its Ctrl-C reaches
# nothing else): starts a read process over the slabs given on stdin, takes
# a terminal's Ctrl-C as an engine that lives on would (it ignores it here),
# sends one to its whole process group, then has slot 0 read.
_CTRL_C_ENGINE = """
import os, pickle, signal, sys, time
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.read_process import ProcessRead, ReadProcess
from kvtier.store.slabs import SlabFiles
paths, fingerprint, num_slots, key = pickle.load(sys.stdin.buffer)
files = SlabFiles.open(paths, fingerprint, num_slots, PosixBackend(threads=1), owns_backend=True)
rp = ReadProcess(files, capacity=2, disk_io="posix", threads=1)
rp.start()
deadline = time.monotonic() + 30
while not rp.running and time.monotonic() < deadline:
    rp.poll(0.05)
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.killpg(0, signal.SIGINT)
pending = rp.submit([(0, key)])
served = isinstance(pending, ProcessRead) and rp.wait(pending, 30)
print("RESULT", served, [r.outcome.name for r in rp.complete(pending)], flush=True)
rp.close()
"""


def test_a_terminals_ctrl_c_is_the_engines_not_the_childs(
    make_rig: Callable[..., Rig],
) -> None:
    """Ctrl-C at a terminal goes to its whole foreground process group.
    The child was in the engine's: it died of it with a KeyboardInterrupt
    traceback, and an engine that lived on (an interrupted call in an
    in-process engine) read in its own process from then on."""
    rig = make_rig()
    (key,) = _written(rig, 1)
    s = rig.store
    engine = subprocess.run(
        [sys.executable, "-c", _CTRL_C_ENGINE],
        input=pickle.dumps((s.paths, s.fingerprint, s.num_slots, key)),
        capture_output=True,
        start_new_session=True,
        timeout=120,
    )
    out = engine.stdout.decode()
    assert engine.returncode == 0, engine.stderr.decode()[-2000:]
    assert "RESULT True ['OK']" in out, out + engine.stderr.decode()[-2000:]
    assert b"KeyboardInterrupt" not in engine.stderr


@pytest.mark.skipif(
    sys.platform != "linux" or sys.version_info < (3, 11),
    reason="reads /proc; Python 3.10 gives the child a session of its own",
)
def test_the_child_is_in_the_engines_session_and_a_group_of_its_own(
    make_rig: Callable[..., Rig],
) -> None:
    """Its own process group keeps a terminal's Ctrl-C the engine's; the
    engine's session keeps it in the engine's autogroup: in a session of
    its own, on the CPU where vLLM's worker waited for the load, it got
    next to no CPU and every load passed its deadline. In a background
    group, a terminal with ``tostop`` would stop it at its first log line:
    it ignores SIGTTOU."""
    rig = make_rig()
    rp = _running(_reader(rig))
    try:
        assert terminal_standing(rp.pid) == (True, True, True)
    finally:
        rp.close()


def test_close_ends_even_a_stuck_child_within_its_deadline(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    _written(rig, 1)
    rp = _running(_reader(rig))
    pid = rp.pid
    os.kill(pid, signal.SIGSTOP)  # never sees its pipe close
    monkeypatch.setattr(read_process, "CLOSE_WAIT_S", 0.2)
    started = time.monotonic()
    rp.close()
    assert time.monotonic() - started < DEADLINE_S
    assert wait_gone(pid, DEADLINE_S)  # killed
    rp.close()  # idempotent


def test_without_a_child_every_read_is_made_here(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    keys = _written(rig, 2)
    monkeypatch.setattr(ReadProcess, "spawn", False)
    rp = _reader(rig)
    try:
        rp.start()
        assert rp.pid is None and not rp.running
        assert rp.describe().startswith("engine's process; posix")
        pending = rp.submit([(0, keys[0]), (1, keys[1])])
        assert isinstance(pending, PendingRead)
        got = rp.complete(pending)
        assert [r.outcome for r in got] == [ReadOutcome.OK] * 2
        assert rp.stats().blocks_ok == 2
    finally:
        rp.close()


def test_the_child_reads_a_store_whose_directory_was_removed(
    make_rig: Callable[..., Rig],
) -> None:
    """The child is given the slabs as the descriptors open here, never
    their names: the store directory removed (``rm -rf`` under a running
    engine) once they are open leaves the child's reads verified and exact.
    Before every slab is open it is not started at all (batches are read
    here)."""
    rig = make_rig()
    keys = _written(rig, 2)
    rp = _reader(rig)
    try:
        slab = rp.files.slabs[0].path
        os.rename(slab, slab + ".away")
        rp.start()  # the slab cannot open: no child asked for yet
        assert not rp._starter.asked and rp.files.handles == [None]
        pending = rp.submit([(0, keys[0])])
        assert isinstance(pending, PendingRead)  # read here (and failed)
        assert [r.outcome for r in rp.complete(pending)] == [ReadOutcome.IO_ERROR]
        os.rename(slab + ".away", slab)
        rp.start()
        assert rp._starter.asked
        shutil.rmtree(os.path.dirname(slab))
        _running(rp)
        _serves_slot_0(rp, keys[0])
        pending = rp.submit([(1, keys[1])])
        assert isinstance(pending, ProcessRead)
        assert [r.outcome for r in rp.complete(pending)] == [ReadOutcome.OK]
    finally:
        rp.close()


def _libgomp() -> str | None:
    """The OpenMP runtime vLLM preloads into its CPU workers (torch's)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_the_child_keeps_the_cpus_of_the_thread_that_starts_it(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU worker's environment binds OpenMP to the model's CPUs and
    preloads the runtime, which would pin the child's first thread to the
    first of them as it loads: the child must not inherit that binding."""
    allowed = os.sched_getaffinity(0)
    gomp = _libgomp()
    if len(allowed) < 2 or gomp is None:
        pytest.skip("needs two CPUs and torch's libgomp")
    model_cpu = min(allowed)
    monkeypatch.setenv("LD_PRELOAD", gomp)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(model_cpu))
    rig = make_rig()
    rp = _reader(rig)
    seen: dict[str, object] = {}

    def load_thread() -> None:  # as place_background_thread moves it
        os.sched_setaffinity(0, allowed - {model_cpu})
        try:
            _running(rp)
            seen["child"] = os.sched_getaffinity(rp.pid)
        except BaseException as exc:  # reported below, with the deadline's
            seen["error"] = exc

    t = threading.Thread(target=load_thread)
    t.start()
    t.join(DEADLINE_S + 5)
    try:
        assert "error" not in seen, seen
        assert "child" in seen, "the load thread did not finish in time"
        assert seen["child"] == allowed - {model_cpu}
    finally:
        rp.close()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux: nice levels per thread"
)
def test_asking_for_the_child_never_waits_for_it_to_start(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load thread asks for the child (``start``) and goes on with its
    loads. When it started the child itself, it waited until the child ran:
    9 s under CI's load, on a CPU the model's OpenMP threads kept busy,
    past the worker's load deadline (every load in flight failed), and the
    child imported at the load thread's lowered priority for as long again.
    Now a thread at the priority of the reader's maker starts it, and the
    child takes the asking thread's nice level once it is up."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if base >= 19:
        pytest.skip("already at the lowest priority")
    lowered = min(19, base + 5)
    rig = make_rig()
    (key,) = _written(rig, 1)
    seen: dict[str, object] = {}
    release = threading.Event()
    real_spawn = child_process.spawn

    def slow_spawn(*args):  # a child that takes long to start
        seen["starter_nice"] = os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id()
        )
        release.wait(DEADLINE_S)
        seen["spawned"] = True
        return real_spawn(*args)

    monkeypatch.setattr(child_process, "spawn", slow_spawn)
    rp = _reader(rig)
    asked = threading.Event()

    def load_thread() -> None:  # as place_background_thread lowers it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), lowered)
        rp.start()
        seen["spawned_when_start_returned"] = "spawned" in seen
        asked.set()

    t = threading.Thread(target=load_thread)
    t.start()
    try:
        assert asked.wait(DEADLINE_S + 5), "start() did not return"
        assert seen["spawned_when_start_returned"] is False
        release.set()
        _running(rp)
        assert seen["starter_nice"] == base
        _serves_slot_0(rp, key)
        # Its own threads: the first, and the back end's readers (a thread
        # numpy's import made, idle, keeps the priority it had).
        task = Path(f"/proc/{rp.pid}/task")
        nice = {
            (t / "comm").read_text().strip(): os.getpriority(
                os.PRIO_PROCESS, int(t.name)
            )
            for t in task.iterdir()
        }
        ours = {n: v for n, v in nice.items() if n.startswith("kvtier-")}
        assert CHILD_NAME in ours and len(ours) > 1, nice
        assert set(ours.values()) == {lowered}, nice
    finally:
        release.set()
        t.join(DEADLINE_S)
        rp.close()
    assert rp._starter is not None
    rp._starter.thread.join(DEADLINE_S)
    assert not rp._starter.thread.is_alive()  # it stayed for the child's life only


def test_a_reader_closed_before_it_asked_for_a_child_starts_none(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    _written(rig, 1)
    started: list[tuple] = []
    monkeypatch.setattr(child_process, "spawn", lambda *a: started.append(a))
    rp = _reader(rig)
    rp.close()
    assert rp._starter is not None
    rp._starter.thread.join(DEADLINE_S)
    assert not rp._starter.thread.is_alive() and started == []
    rp.start()  # after close: nothing
    assert started == [] and rp.pid is None
