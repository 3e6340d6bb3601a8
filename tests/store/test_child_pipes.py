"""PipeChannel: the parent's end of a helper process's pipes never waits on
the other end (kvtier.store.child_process)."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kvtier.store.child_process import PipeChannel, frame
from kvtier.testing.state import unsent

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
    assert unsent(chan) > 0  # the pipe took only part of it
    got: list = []

    def read_all() -> None:
        while len(got) < len(msgs):
            got.append(other.recv())

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    deadline = time.monotonic() + DEADLINE_S
    while reader.is_alive() and unsent(chan):
        assert time.monotonic() < deadline, f"{unsent(chan)} bytes never sent"
        chan.receive(0.01)  # each call sends on what the pipe takes
    reader.join(DEADLINE_S)
    assert got == msgs and unsent(chan) == 0


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
