"""ReadWaiter / wait_all: a Future-backed read and a polled one (kvikio's
IOFuture has no timed wait) are waited for one way, with a deadline."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvtier.store.read_waiter import ReadWaiter, wait_all


def _polled(landed: threading.Event, nbytes: int) -> ReadWaiter:
    """A read that only says done() (no Future), like kvikio's."""

    def get() -> int:
        assert landed.wait(10)
        return nbytes

    return ReadWaiter(get, landed.is_set)


def test_a_held_read_of_either_kind_keeps_wait_all_false_until_it_lands() -> None:
    fut: Future[int] = Future()
    landed = threading.Event()
    waiters = [ReadWaiter.of_future(fut), _polled(landed, 4096)]
    assert not wait_all(waiters, 0.02)
    fut.set_result(8192)
    assert not wait_all(waiters, 0.02)  # the polled one is still out
    assert [w.done() for w in waiters] == [True, False]
    landed.set()
    assert wait_all(waiters, 10.0)
    assert [w() for w in waiters] == [8192, 4096]


def test_a_failed_read_raises_from_its_waiter_not_from_wait_all() -> None:
    fut: Future[int] = Future()
    fut.set_exception(OSError(5, "EIO"))
    waiter = ReadWaiter.of_future(fut)
    assert wait_all([waiter], 1.0) and waiter.done()
    with pytest.raises(OSError):
        waiter()
