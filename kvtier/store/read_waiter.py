"""A read in flight, as the device staging path waits for it.

Two kinds of asynchronous read reach :class:`kvtier.store.device_staging.
DeviceStagingReader`: kvikio's own ``CuFile.pread`` (an IOFuture, through
``KvikioBackend.start_read``) and any back end's ``submit_read`` (a
``concurrent.futures.Future``). Both are handed around as a
:class:`ReadWaiter`, so the reader polls, waits and collects them one way.

Contract:
  - ``waiter()`` blocks until the read returned and gives its byte count
    (short at end of file), or raises OSError; it may be called again.
  - ``waiter.done()`` says whether ``waiter()`` would return at once; it
    never blocks and never raises.
  - :func:`wait_all` waits up to a deadline. A Future-backed read is waited
    for with ``concurrent.futures.wait`` (one timed wait, no polling);
    kvikio's IOFuture has no timed wait, so it is polled every millisecond
    (on the load thread: a GIL hand-off per poll while it is outstanding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

POLL_S = 0.001


class ReadWaiter:
    """One read in flight; see the module contract."""

    __slots__ = ("_get", "_done", "future")

    def __init__(
        self,
        get: Callable[[], int],
        done: Callable[[], bool],
        future: Future[int] | None = None,
    ):
        self._get = get
        self._done = done
        # Set where a timed wait exists (a back end's Future).
        self.future = future

    @classmethod
    def of_future(cls, fut: Future[int]) -> ReadWaiter:
        """A back end's ``submit_read`` Future as a waiter."""
        return cls(lambda: int(fut.result()), fut.done, fut)

    def __call__(self) -> int:
        return self._get()

    def done(self) -> bool:
        return self._done()


def wait_all(waiters: Sequence[ReadWaiter], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every read; whether all returned."""
    deadline = time.monotonic() + timeout
    futures = [w.future for w in waiters if w.future is not None]
    if futures and wait_futures(futures, timeout).not_done:
        return False
    while not all(w.done() for w in waiters):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
