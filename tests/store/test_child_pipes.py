"""PipeChannel: the parent's end of a helper process's pipes never waits on
the other end; ChildStarter: a helper process is started once, off the
asking thread, and handed over once (kvtier.store.child_process)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kvtier.store import child_process
from kvtier.store.child_process import ChildStarter, PipeChannel, SchedulingWatch, frame

DEADLINE_S = 30.0


@pytest.fixture
def ends():
    """(channel, the other end's request reader, the other end's reply
    writer fd): the other end reads requests with a plain Connection."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    chan = PipeChannel(req_w, resp_r)
    other = Connection(req_r, writable=False)
    yield chan, other, resp_w
    chan.close()
    other.close()
    with contextlib.suppress(OSError):  # the test may have closed it
        os.close(resp_w)


def _within_deadline(fn) -> bool:
    """Whether ``fn`` returned within DEADLINE_S (run on a thread)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    return not t.is_alive()


def test_send_never_waits_for_a_reader_and_keeps_order(ends):
    chan, other, _resp_w = ends
    msgs = [(i, [(j, bytes([i % 256]) * 36) for j in range(500)]) for i in range(200)]
    # ~5 MB of requests, far above any pipe's room, with nobody reading.
    assert _within_deadline(lambda: [chan.send(m) for m in msgs])
    assert chan.unsent > 0  # the pipe took only part of it
    got: list = []

    def read_all() -> None:
        while len(got) < len(msgs):
            got.append(other.recv())

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    deadline = time.monotonic() + DEADLINE_S
    while reader.is_alive() and chan.unsent:
        assert time.monotonic() < deadline, f"{chan.unsent} bytes never sent"
        chan.receive(0.01)  # each call sends on what the pipe takes
    reader.join(DEADLINE_S)
    assert got == msgs and chan.unsent == 0


def test_a_message_written_in_part_is_taken_whole_later(ends):
    chan, _other, resp_w = ends
    whole = frame(("done", 7, [0, 1, 2], [5, 6, 7], (1, 2)))
    os.write(resp_w, whole[:3])  # not even the length yet
    assert chan.receive(0) == []
    os.write(resp_w, whole[3:10])
    assert _within_deadline(lambda: chan.receive(0.2))  # returns, empty-handed
    assert chan.receive(0) == []
    os.write(resp_w, whole[10:] + frame(("ready",)))
    assert chan.receive(1.0) == [("done", 7, [0, 1, 2], [5, 6, 7], (1, 2)), ("ready",)]


def test_the_long_length_form_is_read(ends):
    chan, _other, resp_w = ends
    payload = frame({"a": 1})[4:]
    os.write(resp_w, struct.pack("!iQ", -1, len(payload)) + payload)
    assert chan.receive(1.0) == [{"a": 1}]


def test_whole_messages_before_a_close_count_then_eof(ends):
    chan, _other, resp_w = ends
    os.write(resp_w, frame(("done", 1)) + frame(("done", 2))[:5])  # then dies
    os.close(resp_w)
    assert chan.receive(1.0) == [("done", 1)]
    with pytest.raises(EOFError):
        chan.receive(1.0)


def test_a_reader_gone_breaks_send(ends):
    chan, other, _resp_w = ends
    other.close()
    with pytest.raises(BrokenPipeError):
        chan.send(("x",))


# ------------------------------------------------------------ ChildStarter


def test_a_starter_starts_once_when_asked_and_hands_over_once() -> None:
    calls: list[str] = []
    entered, go = threading.Event(), threading.Event()

    def start() -> str:
        calls.append(threading.current_thread().name)
        entered.set()
        assert go.wait(DEADLINE_S)
        return "child"

    starter = ChildStarter("kvtier-starter", start)
    assert starter.take() is None and not starter.asked
    starter.ask()
    starter.ask()  # once
    assert entered.wait(DEADLINE_S)
    assert starter.take() is None  # not started yet: take never waits
    go.set()
    deadline = time.monotonic() + DEADLINE_S
    while (got := starter.take()) is None:
        assert time.monotonic() < deadline, "never handed over"
        time.sleep(0.01)
    assert got == "child" and starter.take() is None and not starter.failed
    assert calls == ["kvtier-starter"]
    assert starter.thread.is_alive()  # stays for the child's life
    assert starter.close() is None  # taken already
    starter.release()
    starter.thread.join(DEADLINE_S)
    assert not starter.thread.is_alive()


def test_close_waits_for_a_start_under_way_and_returns_what_it_made() -> None:
    """The owner stops what was started: a child started as the owner
    closed is never left running unseen."""
    entered, go = threading.Event(), threading.Event()

    def start() -> str:
        entered.set()
        assert go.wait(DEADLINE_S)
        return "child"

    starter = ChildStarter("kvtier-starter", start)
    starter.ask()
    assert entered.wait(DEADLINE_S)
    closed: list[object] = []
    closer = threading.Thread(target=lambda: closed.append(starter.close()))
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waits for the start under way
    go.set()
    closer.join(DEADLINE_S)
    assert closed == ["child"]
    starter.release()
    starter.thread.join(DEADLINE_S)
    assert not starter.thread.is_alive()


def test_a_start_that_raises_is_no_child() -> None:
    def start() -> None:
        raise RuntimeError("no such thing")

    starter = ChildStarter("kvtier-starter", start)
    starter.ask()
    deadline = time.monotonic() + DEADLINE_S
    while not starter.failed:
        assert time.monotonic() < deadline, "never said it failed"
        time.sleep(0.01)
    assert starter.take() is None
    starter.thread.join(DEADLINE_S)  # no child to stay for: it left
    assert not starter.thread.is_alive()


@pytest.mark.parametrize("end", ["close", "release"])
def test_ended_before_asked_it_never_starts(end: str) -> None:
    calls: list[int] = []
    starter = ChildStarter("kvtier-starter", lambda: calls.append(1))
    getattr(starter, end)()
    starter.ask()
    starter.thread.join(DEADLINE_S)
    assert not starter.thread.is_alive() and calls == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_a_watch_says_thread_states_and_cpu_since_the_last_look() -> None:
    """A process that sleeps, then is stopped: its threads' states (S, then
    T), and the CPU they got and waited for, first over its life, then
    since the last look; unknown once it exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    probe = SchedulingWatch()

    def until(state: str) -> None:
        deadline = time.monotonic() + 30
        while not probe.look(proc.pid).startswith(f"threads {state};"):
            assert time.monotonic() < deadline, f"never {state}: {probe.look(proc.pid)}"
            time.sleep(0.01)

    times = r"\d+\.\d s: \d+\.\d\d s on a CPU, \d+\.\d\d s waiting for one"
    try:
        until("S1")  # its interpreter started, it sleeps
        watch = SchedulingWatch()
        assert re.fullmatch(rf"threads S1; in its {times}", watch.look(proc.pid))
        assert re.fullmatch(rf"threads S1; in the last {times}", watch.look(proc.pid))
        os.kill(proc.pid, signal.SIGSTOP)
        until("T1")
        watch.look(proc.pid)
        # Stopped, it runs no more: nothing on a CPU since the last look.
        assert re.fullmatch(
            r"threads T1; in the last \d+\.\d s: 0\.00 s on a CPU, "
            r"0\.00 s waiting for one",
            watch.look(proc.pid),
        )
    finally:
        proc.kill()
        proc.wait()
    assert watch.look(proc.pid) == "its state unknown"  # it exited


def test_a_childs_records_go_to_the_parent_at_the_parents_level(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The child forwards kvtier's records at VLLM_LOGGING_LEVEL until its
    configuration gives the parent's level (a VLLM_LOGGING_CONFIG_PATH entry
    for vllm.kvtier at DEBUG reached no helper), and the parent logs each
    as the child's, with its pid, name, file and line; a record whose
    message cannot be made, or that cannot be sent, is said on stderr, not
    lost (formatted where it can be)."""
    import logging

    from kvtier.log import ROOT, get_logger

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    kvtier = logging.getLogger(ROOT)
    saved = kvtier.level, kvtier.propagate, list(kvtier.handlers)
    sent: list[tuple] = []

    def send(msg: tuple) -> None:
        if "gone" in msg[5]:
            raise BrokenPipeError  # the parent's end closed
        sent.append(msg)

    try:
        child_process.forward_logs(send, "kvtier-test")
        log = get_logger("store")
        log.debug("not at INFO")
        log.info("at INFO %d", 1)
        child_process.set_log_level(logging.DEBUG)  # the parent's, configured
        log.debug("at DEBUG")
        log.info("broken %d", "x")  # cannot be formatted
        log.info("parent gone: back end %s (%s)", "posix", "O_DIRECT")
        try:
            raise ValueError("the cause")
        except ValueError:
            log.exception("parent gone while failing")
    finally:
        kvtier.setLevel(saved[0])
        kvtier.propagate = saved[1]
        kvtier.handlers[:] = saved[2]
    assert [m[5] for m in sent] == ["at INFO 1", "at DEBUG"]
    err = capsys.readouterr().err.splitlines()
    who = f"{ROOT}.store (pid {os.getpid()})"
    assert err[:2] == [
        f"INFO {who}: broken %d ('x',)",
        f"INFO {who}: parent gone: back end posix (O_DIRECT)",
    ]
    assert err[2] == f"ERROR {who}: parent gone while failing"
    assert err[3] == "Traceback (most recent call last):"
    assert err[-1] == "ValueError: the cause"
    kind, level, name, path, line, *_rest, pid, who, _created = sent[0]
    assert (kind, level, name, pid, who) == (
        "log",
        logging.INFO,
        f"{ROOT}.store",
        os.getpid(),
        "kvtier-test",
    )
    assert path == __file__ and line > 0
    with caplog.at_level("DEBUG", logger=ROOT):
        for msg in sent:
            child_process._log_forwarded(msg)
    got = [(r.getMessage(), r.processName, r.process) for r in caplog.records]
    assert got == [
        ("at INFO 1", "kvtier-test", os.getpid()),
        ("at DEBUG", "kvtier-test", os.getpid()),
    ]
